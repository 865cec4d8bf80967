"""Dropping the /dev/shm staging a killed daemon left behind, never a live daemon's.

A real ``accelpact-ckptd`` process holds its node directory's lock; a file in its staging root stands for a
rank's slot.  No sleeps: every wait polls against a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ckpt_service.layout import node_dir, socket_path, staging_root
from ckpt_service.staging import NOTHING, REMOVED, SERVED, drop_unserved, main
from tests.conftest import REPO, decoder_text


def _wait(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)  # polling interval, not synchronisation


@pytest.mark.slow
def test_a_live_daemons_staging_is_left_alone_and_a_killed_ones_is_dropped(tmp_path):
    """Negative control: while the daemon lives, its slot stays (SERVED); after its kill -9 it goes (REMOVED)."""
    config = tmp_path / "job.yaml"
    config.write_text(decoder_text())
    run_dir = tmp_path / "run"
    ndir = node_dir(str(run_dir), "nodeA")
    root = staging_root(ndir)
    log = open(tmp_path / "ckptd.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "accelpact_slurm.cli.ckptd", str(config), "--run-dir",
                             str(run_dir), "--node", "nodeA", "--node-index", "0", "--num-nodes", "1"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONPATH=REPO))
    try:
        _wait(lambda: os.path.exists(socket_path(ndir)) or proc.poll() is not None, 120, "the daemon's socket")
        assert proc.poll() is None, (tmp_path / "ckptd.log").read_text()
        os.makedirs(root, mode=0o700, exist_ok=True)
        slot = os.path.join(root, "rank-0.slot-0")  # what a rank stages into
        with open(slot, "wb") as fh:
            fh.write(b"\0" * 4096)

        what, why = drop_unserved(ndir)
        assert what == SERVED and str(proc.pid) in why and os.path.exists(slot)

        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert os.path.exists(slot) and os.path.exists(socket_path(ndir))  # kill -9: nobody dropped them
        what, why = drop_unserved(ndir)
        assert what == REMOVED, why
        assert not os.path.exists(root) and not os.path.exists(socket_path(ndir))
        assert drop_unserved(ndir)[0] == NOTHING
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        log.close()


def test_without_a_node_directory_nothing_is_touched(tmp_path):
    ndir = str(tmp_path / "never-served")
    assert drop_unserved(ndir)[0] == NOTHING and not os.path.exists(ndir)  # no directory created either


def test_what_ranks_staged_for_a_node_directory_no_daemon_could_serve_is_dropped(tmp_path):
    """A file where the node directory should be: its daemon could not start, the node's ranks staged anyway
    (they learn it at their first hand-over); nobody reads those slots, so they go.  The file stays."""
    ndir = str(tmp_path / "node1")
    with open(ndir, "w") as fh:
        fh.write("a file where the node directory should be\n")
    root = staging_root(ndir)
    os.makedirs(os.path.join(root, "step-0000000002"), mode=0o700)
    with open(os.path.join(root, "rank-0.slot-0"), "wb") as fh:
        fh.write(b"\0" * 4096)
    what, why = drop_unserved(ndir)
    assert what == REMOVED and "no daemon could serve" in why, why
    assert not os.path.exists(root) and os.path.isfile(ndir)
    assert drop_unserved(ndir)[0] == NOTHING


def test_the_module_entry_drops_and_reports(tmp_path, capsys):
    ndir = str(tmp_path / "node-local" / "n1")
    os.makedirs(ndir)
    root = staging_root(ndir)
    os.makedirs(root, mode=0o700, exist_ok=True)
    assert main(["--drop", ndir, str(tmp_path / "absent")]) == 0
    out = capsys.readouterr().out
    assert f"removed {root}" in out and "no node directory" in out
    assert not os.path.exists(root)
    proc = subprocess.run([sys.executable, "-m", "ckpt_service.staging", "--help"], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0 and "--drop NODE_DIR" in proc.stdout


def test_a_killed_daemons_half_written_snapshot_is_dropped_a_live_ones_is_not(tmp_path):
    """A daemon killed while writing leaves ``.tmp-step-N-PID`` (and a half-deleted ``.del-...``); the job's end
    removes them once the node directory's lock is free, a live daemon's (its lock held) stay, and so do the
    committed snapshots.  Negative control: before, only the staging and the socket went; the directory stayed
    until the node directory's next daemon, which a job that ends never starts (the fault campaign's
    ``kill_daemon`` run: "temporary directories left")."""
    import fcntl

    ndir = tmp_path / "node1"
    for name in (".tmp-step-0000000006-4242", ".del-step-0000000003-4242", "step-0000000003"):
        (ndir / name).mkdir(parents=True)
        (ndir / name / "__0_0.distcp").write_bytes(b"x" * 100)
    fd = os.open(ndir / "ckptd.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a live daemon holds it
        assert drop_unserved(str(ndir))[0] == SERVED and (ndir / ".tmp-step-0000000006-4242").is_dir()
    finally:
        os.close(fd)
    what, why = drop_unserved(str(ndir))
    assert what == REMOVED and ".tmp-step-0000000006-4242" in why, why
    assert sorted(p.name for p in ndir.iterdir()) == ["ckptd.lock", "step-0000000003"]


def test_a_dead_daemons_half_made_copy_in_the_shared_tier_is_dropped_a_live_ones_is_not(tmp_path):
    """A daemon killed during an upload leaves ``<shared>/.tmp-step-N-<node>-<pid>``; the launcher's end removes it
    when that pid is gone, and leaves a live daemon's copy, another node's and the committed snapshots alone.
    Negative control: before, nothing removed it (the fault campaign's ``daemon_commit_kill`` at step 9, while
    step 6 was being uploaded: "temporary directories left")."""
    from ckpt_service.tiers import drop_dead_copies

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)
    names = [f".tmp-step-0000000006-node2-{gone.pid}", f".tmp-step-0000000006-node2-{os.getpid()}",
             f".tmp-step-0000000006-node1-{gone.pid}", "step-0000000003"]
    for name in names:
        (tmp_path / name).mkdir()
    assert drop_dead_copies(str(tmp_path), "node2") == [names[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])
    assert drop_dead_copies(str(tmp_path / "missing"), "node2") == []
