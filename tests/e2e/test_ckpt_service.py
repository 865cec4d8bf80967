"""The checkpoint service end to end: real ranks, real daemons, real kill -9, real corruption.

Runs are expensive on 2 cores, so they are shared through module-scoped fixtures;
the model is tiny (2 layers, width 32).  No sleeps: every wait polls against a deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from ckpt_service.index import newest_verified, read_record, scan
from ckpt_service.layout import socket_path, staging_root, step_dirname
from tests.conftest import REPO, run_cli, wait_for

pytestmark = pytest.mark.multiproc

CONFIG = """
name: ck
entry: {entry}
seed: 1234
steps: {steps}
log_every: 4
topology: {{nodes: {nodes}, ranks_per_node: 2}}
checkpoint: {{every_steps: {every}, keep_last: 2, compress: {compress}{extra}}}
timeouts: {{collective_s: 3, control_s: 20, startup_s: 60, shutdown_s: 5}}
recovery: {{max_restarts: 0}}
params: {{fsdp: fsdp1, mesh: device_mesh, layers: 2, width: 32, heads: 4, vocab: 64, seq_len: 16, dropout: 0.1,
          sequences: 10000, batch_per_rank: 2, lr: 0.003, min_lr: 0.0003, warmup_steps: 2, weight_decay: 0.01}}
"""
DECODER_ENTRY = os.path.join(REPO, "examples", "decoder", "train_decoder.py") + ":main"


def write_config(path, *, steps=8, nodes=2, every=4, compress="false", extra="", entry=DECODER_ENTRY):
    path.write_text(CONFIG.format(steps=steps, nodes=nodes, every=every, compress=compress, extra=extra,
                                  entry=entry))
    return str(path)


COMPLETED = (0,)


def run(config, run_dir, env=None, expect=0):
    proc = run_cli(["accelpact_slurm.cli.run", config, "--run-dir", str(run_dir)], env=env, timeout=300)
    if expect == 0:
        assert proc.returncode in COMPLETED and os.path.exists(os.path.join(run_dir, "summary.json")), \
            proc.stdout[-3000:] + proc.stderr[-3000:]
    elif expect is not None:
        assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def summary(run_dir):
    with open(os.path.join(run_dir, "summary.json")) as fh:
        return json.load(fh)


def ckpt_events(run_dir):
    from accelpact_slurm.core.events import read_events

    return [e for e in read_events(os.path.join(run_dir, "events.jsonl")) if e["event"] == "checkpoint"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A: uninterrupted (uncompressed); B: compressed, stopped after verified step 4, then resumed."""
    base = tmp_path_factory.mktemp("ckpt")
    plain = write_config(base / "plain.yaml")
    comp = write_config(base / "comp.yaml", compress="true")
    run(plain, base / "a")
    stopped = run(comp, base / "b", env={"ACCELPACT_CKPT_EXIT_AFTER_VERIFIED": "4"}, expect=75)
    snap_b = scan(str(base / "b" / "node-local" / "node1"))
    run(comp, base / "b")
    return {"base": base, "a": base / "a", "b": base / "b", "stopped": stopped, "b_after_stop": snap_b}


def test_resume_reproduces_the_loss_curve(runs):
    a, b = summary(runs["a"]), summary(runs["b"])
    assert [(r.step, r.state) for r in runs["b_after_stop"]] == [(4, "verified")]
    assert b["final_state_digest"] == a["final_state_digest"]
    assert b["losses"] == a["losses"] and len(a["losses"]) == 8
    loads = [json.loads(ln) for ln in open(runs["b"] / "events.jsonl") if '"restart_load"' in ln]
    assert [e["step"] for e in loads] == [4]


def test_snapshots_committed_verified_and_indexed(runs):
    for node in ("node1", "node2"):
        recs = scan(str(runs["a"] / "node-local" / node))
        assert [(r.step, r.state) for r in recs] == [(4, "verified"), (8, "verified")]
        idx = json.load(open(runs["a"] / "ckpt-index" / f"{node}.json"))
        assert idx["node"] == node and [s["state"] for s in idx["snapshots"]] == ["verified", "verified"]
        assert set(idx["snapshots"][0]) == {"step", "state", "size_bytes", "created", "path", "milestone", "reason"}
        from ckpt_service import auth, committed

        assert committed.read(committed.path_of(str(runs["a"]), node), auth.load_key(str(runs["a"]))) == (8, "signed")
        m = json.load(open(recs[0].path + "/manifest.json"))
        assert ".metadata" in m["files"] and m["step"] == 4
        assert m["capture"]["ok"] is True and "match the live state dict" in m["capture"]["reason"]
    states = [(e["hostname"], e["step"], e["state"]) for e in ckpt_events(runs["a"])]
    assert ("node1", 4, "committed") in states and ("node2", 8, "verified") in states
    b = json.load(open(scan(str(runs["b"] / "node-local" / "node1"))[-1].path + "/manifest.json"))
    assert b["compressed"] is True


@pytest.mark.parametrize("which", ["a", "b"])
def test_stock_dcp_to_torch_save_without_project_code(runs, which, tmp_path):
    snap = scan(str(runs[which] / "node-local" / "node2"))[-1].path
    code = (
        "import sys, torch\n"
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        f"dcp_to_torch_save({snap!r}, 'out.pt')\n"
        "sd = torch.load('out.pt', weights_only=False)\n"
        "assert 'model' in sd and 'optim' in sd and 'extra' in sd, list(sd)\n"
        "assert sd['model']['tok.weight'].shape == (64, 32)\n"
        "assert not [m for m in sys.modules if m.startswith(('accelpact', 'ckpt_service'))]\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.parametrize("damage", ["bitflip", "truncate", "missing_shard", "missing_metadata"])
def test_corruption_is_rejected_and_the_previous_verified_is_chosen(runs, tmp_path, damage):
    ndir = tmp_path / "node1"
    shutil.copytree(runs["a"] / "node-local" / "node1", ndir)
    newest = ndir / step_dirname(8)
    shard = next(p for p in newest.iterdir() if p.name.endswith(".distcp"))
    if damage == "bitflip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "missing_shard":
        shard.unlink()
    else:
        (newest / ".metadata").unlink()
    proc = run_cli(["accelpact_slurm.cli.ckpt", "verify", str(ndir), "--run-dir", str(runs["a"])], timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"REJECTED  {newest}" in proc.stdout
    rec = read_record(str(newest))
    assert rec.state == "rejected" and rec.reason
    best, _ = newest_verified(scan(str(ndir)))
    assert best.step == 4


def test_cli_list_and_export(runs, tmp_path):
    proc = run_cli(["accelpact_slurm.cli.ckpt", "list", str(runs["a"]), "--json"], timeout=60)
    rows = json.loads(proc.stdout)
    assert sorted((r["node"], r["step"]) for r in rows) == [("node1", 4), ("node1", 8), ("node2", 4), ("node2", 8)]
    out = tmp_path / "x.pt"
    snap = scan(str(runs["b"] / "node-local" / "node1"))[-1].path
    proc = run_cli(["accelpact_slurm.cli.ckpt", "export", snap, str(out)], timeout=120)
    assert proc.returncode == 0 and out.stat().st_size > 0, proc.stderr


# --------------------------------------------------------------------------- kill -9


def _start_daemon(config, run_dir, env=None, log_path=None):
    full = dict(os.environ, PYTHONPATH=REPO, **(env or {}))
    out = open(log_path, "w") if log_path else subprocess.PIPE
    try:
        return subprocess.Popen([sys.executable, "-m", "accelpact_slurm.cli.ckptd", config, "--run-dir",
                                 str(run_dir), "--node", "node1", "--drain-s", "60"], env=full, cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT, text=True)
    finally:
        if log_path:
            out.close()


def _settle(config, run_dir):
    """Restart the node's daemon: it cleans leftovers and re-verifies; stop it once every snapshot is final."""
    ndir = str(run_dir / "node-local" / "node1")
    log_path = run_dir / "settle-ckptd.log"
    d = _start_daemon(config, run_dir, log_path=log_path)
    try:
        # the killed daemon's socket file may still be there: wait for the new daemon's own word
        wait_for(lambda: "accelpact-ckptd: serving" in log_path.read_text() or d.poll() is not None, 60,
                 "the daemon to serve")
        wait_for(lambda: all(r.state != "committed" for r in scan(ndir)), 120, "verification")
    finally:
        d.send_signal(signal.SIGTERM)
        d.wait(timeout=90)
    out = log_path.read_text()
    # It took over from the killed daemon (not "already serves", exit 2) and stopped cleanly on SIGTERM.
    assert d.returncode == 0, f"restarted daemon exited {d.returncode}: {out[-3000:]}"
    return ndir


def _proc_stat(pid):
    """(state, parent pid, exit status as waitpid reports it) of ``pid`` from /proc; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            s = fh.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    f = s[s.rindex(")") + 2:].split()  # field 3 (state) onwards; field 52 is the exit code
    return f[0], int(f[1]), int(f[49])


def _sigkill_and_read_status(pid, job):
    """SIGKILL ``pid`` (a daemon under ``job``) and return its wait status as its parent will see it.

    The daemon is the launcher's child, not ours, so the status is read from its zombie; the parent is held
    with SIGSTOP from just before the kill until then, so it cannot reap the daemon first.
    """
    st = _proc_stat(pid)
    assert st is not None and st[0] != "Z", f"the paused daemon {pid} is not running"
    parent, p = st[1], st[1]
    while p != job.pid:  # the daemon must belong to this job (and the pid must not have been reused)
        up = _proc_stat(p)
        assert p > 1 and up is not None, f"pid {pid} is not a process of the job {job.pid}"
        p = up[1]
    os.kill(parent, signal.SIGSTOP)
    try:
        os.kill(pid, signal.SIGKILL)
        dead = wait_for(lambda: (s := _proc_stat(pid)) is not None and s[0] == "Z" and s, 30, "the killed daemon")
    finally:
        os.kill(parent, signal.SIGCONT)
    return dead[2]


@pytest.mark.parametrize("phase", ["staging", "writing", "written", "renamed"])
def test_kill_daemon_at_each_phase(tmp_path, phase):
    cfg = write_config(tmp_path / "k.yaml", steps=4, nodes=1, every=2)
    rd = tmp_path / "run"
    ndir = rd / "node-local" / "node1"
    env = dict(os.environ, PYTHONPATH=REPO, ACCELPACT_CKPTD_PAUSE_AT=f"{phase}:4")
    job = subprocess.Popen([sys.executable, "-m", "accelpact_slurm.cli.run", cfg, "--run-dir", str(rd)], env=env,
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        marker = ndir / f".paused-{phase}"
        wait_for(lambda: marker.exists() and marker.read_text().strip(), 180, f"pause at {phase}")
        # The previous snapshot must exist before the kill (the writer works in step order; at the staging
        # pause it runs on in another thread).
        wait_for(lambda: any(r.step == 2 for r in scan(str(ndir))), 120, "step 2 committed")
        status = _sigkill_and_read_status(int(marker.read_text()), job)
        out, _ = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            job.kill()
    assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL, f"the daemon's wait status was {status}"
    # Training goes on without its daemon: the job completes, exit code 0, every update done.
    assert job.returncode == 0, f"job exited {job.returncode}: {out[-3000:]}"
    assert summary(rd)["final_step"] == 4, out[-3000:]
    listed = {r.step: r.state for r in scan(str(ndir))}
    assert 2 in listed and (4 not in listed or phase == "renamed")
    for r in scan(str(ndir)):
        assert read_record(r.path).state != "rejected", r  # nothing partial is ever listed
    _settle(cfg, rd)
    after = {r.step: r.state for r in scan(str(ndir))}
    assert after[2] == "verified"
    assert after.get(4) == ("verified" if phase == "renamed" else None)
    assert not [n for n in os.listdir(ndir) if n.startswith((".tmp-", ".del-", ".paused-"))]


def test_kill_rank_after_staging_daemon_completes_the_snapshot(tmp_path):
    cfg = write_config(tmp_path / "k.yaml", steps=4, nodes=1, every=2)
    rd = tmp_path / "run"
    proc = run(cfg, rd, env={"ACCELPACT_CKPT_KILL_AFTER_STAGED": "2:1"}, expect=None)
    assert proc.returncode != 0
    recs = scan(str(rd / "node-local" / "node1"))
    assert [(r.step, r.state) for r in recs] == [(2, "verified")]


def test_second_daemon_refuses_and_other_users_cannot_talk(tmp_path):
    cfg = write_config(tmp_path / "k.yaml", nodes=1)
    rd = tmp_path / "run"
    ndir = str(rd / "node-local" / "node1")
    first = _start_daemon(cfg, rd)
    try:
        wait_for(lambda: os.path.exists(socket_path(ndir)), 60, "the first daemon's socket")
        second = _start_daemon(cfg, rd)
        out, _ = second.communicate(timeout=60)
        assert second.returncode == 2 and "already serves" in out and str(first.pid) in out
        if os.getuid() != 0:
            pytest.skip("setuid to nobody needs root")
        probe = (
            "import os, pwd, json, socket, sys\n"
            "nb = pwd.getpwnam('nobody'); os.setgid(nb.pw_gid); os.setuid(nb.pw_uid)\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            f"    s.connect({socket_path(ndir)!r})\n"
            "except PermissionError:\n"
            "    print('denied'); sys.exit(0)\n"
            "try:\n"
            "    s.sendall(b'{\"op\":\"status\"}\\n')\n"
            "except (BrokenPipeError, ConnectionResetError):\n"  # refused before we spoke: read the refusal
            "    pass\n"
            "print(s.recv(1000).decode())\n"
        )
        res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        assert res.stdout.strip() == "denied", res.stdout + res.stderr  # 0600 socket in a 0700 directory
        # Second layer: even with the file permissions opened, SO_PEERCRED refuses another uid.
        os.chmod(os.path.dirname(socket_path(ndir)), 0o755)
        os.chmod(socket_path(ndir), 0o666)
        res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        assert "refused" in res.stdout and "not the job's user" in res.stdout, res.stdout + res.stderr
    finally:
        os.chmod(os.path.dirname(socket_path(ndir)), 0o700)
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=60)


def test_a_storm_of_stop_signals_stops_the_daemon(tmp_path):
    """Stop signals arriving while the daemon waits (srun's SIGINTs at a job's end) stop it every time.

    A handler runs in the main thread between two bytecodes; one that took a lock the main thread's wait held
    (``threading.Event.set`` inside ``Event.wait``) blocked the daemon forever, serving with nobody to serve.
    """
    cfg = write_config(tmp_path / "k.yaml", nodes=1)
    rd = tmp_path / "run"
    daemons = [_start_daemon(cfg, rd / str(i)) for i in range(4)]
    try:
        for i, d in enumerate(daemons):
            wait_for(lambda: os.path.exists(socket_path(str(rd / str(i) / "node-local" / "node1")))
                     or d.poll() is not None, 60, "the daemon's socket")
        for _ in range(300):
            for d in daemons:
                if d.poll() is None:
                    d.send_signal(signal.SIGINT)
        codes = []
        for d in daemons:
            try:
                codes.append(d.wait(timeout=30))
            except subprocess.TimeoutExpired:
                codes.append("still serving")
    finally:
        for d in daemons:
            if d.poll() is None:
                d.kill()
                d.wait(timeout=30)
    assert codes == [0] * len(daemons), codes


def test_full_disk_training_goes_on(tmp_path):
    if os.getuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "nvme"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True, timeout=30)
    try:
        cfg = write_config(tmp_path / "k.yaml", steps=6, nodes=1, every=2, extra=f", local_dir: {mnt}")
        rd = tmp_path / "run"
        run(cfg, rd)
        assert summary(rd)["final_step"] == 6
        recs = scan(str(mnt / "node1"))
        assert [(r.step, r.state) for r in recs] == [(2, "verified")]
        failed = [e for e in ckpt_events(rd) if e["state"] == "failed"]
        assert failed and "No space left" in failed[0]["reason"], ckpt_events(rd)
        assert not [n for n in os.listdir(mnt / "node1") if n.startswith(".tmp-")]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], timeout=30)


def test_lost_node_storage_restores_from_the_shared_tier(runs, tmp_path):
    """Milestone 4 reaches the shared tier; both nodes lose their NVMe; the resume loads the shared copy and
    ends exactly where the uninterrupted run does."""
    cfg = write_config(tmp_path / "m.yaml", extra=", milestone_every: 4")
    run(cfg, tmp_path / "c", env={"ACCELPACT_CKPT_EXIT_AFTER_VERIFIED": "4"}, expect=75)
    shared = tmp_path / "c" / "shared-ckpt"
    assert (shared / "step-0000000004" / "manifest.json").is_file(), sorted(os.listdir(shared))
    shutil.rmtree(tmp_path / "c" / "node-local")  # the NVMe of both nodes is gone
    run(cfg, tmp_path / "c")
    assert summary(tmp_path / "c")["final_state_digest"] == summary(runs["a"])["final_state_digest"]
    loads = [json.loads(ln) for ln in open(tmp_path / "c" / "events.jsonl") if '"restart_load"' in ln]
    assert loads[-1]["step"] == 4 and "/shared-ckpt/" in loads[-1]["path"], loads[-1]


def test_a_wrong_capture_is_refused_by_the_capture_proof(tmp_path):
    """Rank 0 stages a changed weight at step 4: its staged fingerprints differ from the framework's own state
    dict, so step 4 is never written; the next snapshot is proved again (nothing was proved yet) and commits.
    Negative control: without the proof a wrong capture would be written and pass its checksums and coverage
    (both compare the snapshot with itself)."""
    cfg = write_config(tmp_path / "c.yaml")
    run(cfg, tmp_path / "r", env={"ACCELPACT_CKPT_CORRUPT_CAPTURE": "4:0"})
    evs = [(e["step"], e["state"], e.get("reason") or "") for e in ckpt_events(tmp_path / "r") if e["node"] == 0]
    failed = [e for e in evs if e[0] == 4]
    assert failed and failed[0][1] == "failed" and "does not match the live state" in failed[0][2], evs
    assert not os.path.exists(tmp_path / "r" / "node-local" / "node1" / "step-0000000004")
    assert (8, "verified", "") in evs, evs
    with open(tmp_path / "r" / "node-local" / "node1" / "step-0000000008" / "manifest.json") as fh:
        assert json.load(fh)["capture"]["ok"] is True


def test_service_and_verification_run_without_the_models_code(tmp_path):
    """The job runs a copy of the decoder example whose modules leave a marker (the importing pid) when imported.
    The daemons write, verify and retain every snapshot; then the copy is deleted and accelpact-ckpt verify
    re-verifies every snapshot: no process but the ranks ever imported the model's code."""
    src = tmp_path / "dec"
    shutil.copytree(os.path.join(REPO, "examples", "decoder"), src)
    marks = tmp_path / "marks"
    marks.mkdir()
    for name in ("decoder_model.py", "train_decoder.py"):
        f = src / name
        f.write_text(f.read_text() + f"\nimport os as _os\n"
                     f"open(_os.path.join({str(marks)!r}, str(_os.getpid())), 'w').close()\n")
    cfg = write_config(tmp_path / "c.yaml", entry=f"{src / 'train_decoder.py'}:main")
    run(cfg, tmp_path / "r")
    rank_pids = {e["pid"] for e in map(json.loads, open(tmp_path / "r" / "events.jsonl")) if e["event"] == "membership"}
    assert {int(n) for n in os.listdir(marks)} == rank_pids  # imported by the 4 ranks and nobody else
    states = {(e["hostname"], e["step"]): e["state"] for e in ckpt_events(tmp_path / "r")}
    assert states == {(n, s): "verified" for n in ("node1", "node2") for s in (4, 8)}, states
    shutil.rmtree(src)
    proc = run_cli(["accelpact_slurm.cli.ckpt", "verify", str(tmp_path / "r")], timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("verified  ") == 4, proc.stdout + proc.stderr


def test_a_daemon_that_cannot_start_says_so_once_and_the_ranks_go_on_without_it(tmp_path):
    """Node1's directory is blocked by a file: its daemon prints one line and leaves word in the run directory;
    node1's ranks stop waiting at once and train on without snapshots there, node2 keeps snapshotting.
    Negative control: without that word every snapshot would wait out startup_s (60 s) on node1's ranks, and
    the run would miss this test's deadline."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    (nvme / "node1").write_text("a file where the node directory should be\n")
    cfg = write_config(tmp_path / "c.yaml", every=2, extra=f", local_dir: {nvme}")  # startup_s is 60 here
    proc = run_cli(["accelpact_slurm.cli.run", cfg, "--run-dir", str(tmp_path / "r")], timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "r" / "logs" / "ckptd-node1.log").read_text()
    errors = [ln for ln in log.splitlines() if ln.startswith("accelpact-ckptd: error:")]
    assert len(errors) == 1 and "Traceback" not in log and "cannot serve the node directory" in errors[0], log
    events = list(map(json.loads, open(tmp_path / "r" / "events.jsonl")))
    warnings = [e for e in events if e["event"] == "warning" and "no checkpoint daemon on node1" in e["reason"]]
    assert len(warnings) == 1, warnings  # said once, by node1's first rank
    assert [r.step for r in scan(str(nvme / "node2")) if r.state == "verified"][-2:] == [6, 8]
    # node1's ranks staged every snapshot before they learnt there was no daemon: nothing of it stays in /dev/shm
    # (control: without the drop for a node directory no daemon could serve, the staging root stayed)
    assert not os.path.exists(staging_root(str(nvme / "node1")))
