"""What someone who can write the shared tier can no longer do with a snapshot directory's files.

- swap ``.metadata`` between its authentication and DCP's unpickling (the second ``open()`` ran her pickle as
  the job's user): the load now unpickles the verified bytes, and a data file swapped after the re-check
  fails the load cleanly;
- rename an authentic older snapshot to a newer step (it was loaded): the manifest's signed step must be the
  directory's;
- plant a FIFO as ``manifest.json`` (every start hung in ``open()``), a link to ``/dev/zero`` as ``state.json``
  (a read without end), a link to ``/usr`` inside a snapshot (walked and copied on every restore).

Each test fails on the code before its fix.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest

torch = pytest.importorskip("torch")

from accelpact_slurm.core.errors import CheckpointError  # noqa: E402
from accelpact_slurm.runtime.state import appstate  # noqa: E402
from accelpact_slurm.runtime.state.restore import StateIO, make_offer  # noqa: E402
from ckpt_service import verified  # noqa: E402
from ckpt_service.auth import load_or_create_key, sign  # noqa: E402
from ckpt_service.index import dir_size, read_record, record_state, scan  # noqa: E402
from ckpt_service.layout import step_dirname  # noqa: E402
from ckpt_service.tiers import copy_to_shared  # noqa: E402
from ckpt_service.verify import check_checksums, verify_snapshot  # noqa: E402

ROOT_ONLY = pytest.mark.skipif(os.getuid() != 0, reason="a second user (nobody) needs root to set up")
DEADLINE_S = 10.0


class _Marker:
    """Unpickling this creates ``path``: what a planted ``.metadata`` could do instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _model():
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def _snapshot(run_dir, where, step, *, weight=1.0, signed_step=None) -> str:
    """A real DCP snapshot of a small model under ``run_dir/where/step-N``, its manifest signed with the run's key."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    key = load_or_create_key(str(run_dir))
    m, opt = _model()
    with torch.no_grad():
        m.weight.fill_(weight)
    msd, osd = get_state_dict(m, opt)
    d = run_dir / where / step_dirname(step)
    d.mkdir(parents=True)
    doc = {"run": {"step": step, "epoch": 0, "losses": []}, "ranks": {}}
    dcp.save({"model": msd, "optim": osd, "extra": {"json": json.dumps(doc)}},
             storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)
    files = {}
    for n in sorted(os.listdir(d)):
        raw = (d / n).read_bytes()
        files[n] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    manifest = {"format": 1, "step": step if signed_step is None else signed_step, "created": 1.0, "files": files}
    (d / "manifest.json").write_text(json.dumps(sign(manifest, key)))
    record_state(str(d), "verified")
    return str(d)


def _in_thread(fn, *args):
    """Run ``fn`` with a deadline: a call that blocks (a FIFO) fails the test instead of hanging it."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # reported below
            out["error"] = exc

    t = threading.Thread(target=body, name="untrusted-read", daemon=True)
    t.start()
    t.join(DEADLINE_S)
    assert not t.is_alive(), f"{fn.__name__} still blocked after {DEADLINE_S} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


# --------------------------------------------------------------------------- finding 4: no window between check and use


def test_the_load_reads_the_verified_snapshot(tmp_path):
    path = _snapshot(tmp_path / "run", "shared-ckpt", 5, weight=2.0)
    key = load_or_create_key(str(tmp_path / "run"))
    m, opt = _model()
    doc = appstate.load(m, opt, path, key)
    assert doc["run"]["step"] == 5 and torch.all(m.weight == 2.0)


def test_a_metadata_swapped_while_it_is_verified_is_not_what_gets_unpickled(tmp_path, monkeypatch):
    """The swap lands right after the bytes were read and checked: the reader unpickles those bytes."""
    path = _snapshot(tmp_path / "run", "shared-ckpt", 5, weight=2.0)
    key = load_or_create_key(str(tmp_path / "run"))
    marker = tmp_path / "pickle-ran"
    evil = tmp_path / "evil"
    evil.write_bytes(pickle.dumps(_Marker(str(marker))))
    real_read = verified.read_fd

    def read_then_swap(fd, size, p=""):
        data = real_read(fd, size, p)
        if p.endswith(".metadata"):
            os.replace(evil, p)  # her rename over .metadata, right after the verified read
        return data

    monkeypatch.setattr(verified, "read_fd", read_then_swap)
    m, opt = _model()
    doc = appstate.load(m, opt, path, key)
    assert not evil.exists(), "the swap did not happen"
    assert not marker.exists() and doc["run"]["step"] == 5 and torch.all(m.weight == 2.0)


def _swap_as_nobody(src: str, dst: str) -> None:
    """Another local user renames her file over ``dst`` (in a directory she may write)."""
    script = textwrap.dedent(f'''
        import os, pwd
        nb = pwd.getpwnam("nobody"); os.setgid(nb.pw_gid); os.setuid(nb.pw_uid)
        os.rename({src!r}, {dst!r})
    ''')
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30)


@ROOT_ONLY
def test_another_user_renaming_her_pickle_over_metadata_after_the_recheck_runs_nothing(tmp_path):
    """The issue's attack: the re-check passes, she renames her pickle over ``.metadata``, the ranks load.
    Before the fix the load re-opened ``.metadata`` and unpickled hers (the marker appeared)."""
    base = tempfile.mkdtemp(prefix="accelpact-test-swap-")  # in /tmp: pytest's directories are closed to nobody
    try:
        os.chmod(base, 0o755)
        run = tmp_path.__class__(base) / "run"
        path = _snapshot(run, "shared-ckpt", 5, weight=2.0)
        os.chmod(os.path.dirname(path), 0o777)
        os.chmod(path, 0o777)  # a shared tier she may write into
        nobody = pwd.getpwnam("nobody")
        marker = os.path.join(base, "pickle-ran")
        os.chmod(base, 0o777)
        evil = os.path.join(base, "evil.pkl")
        with open(evil, "wb") as fh:
            fh.write(pickle.dumps(_Marker(marker)))
        os.chown(evil, nobody.pw_uid, nobody.pw_gid)
        io = StateIO(None, str(run), str(run / "node-local" / "n1"), "n1", 0)
        assert io.check(path)[0]
        _swap_as_nobody(evil, os.path.join(path, ".metadata"))
        m, opt = _model()
        with pytest.raises(CheckpointError, match=r"\.metadata belongs to uid|SHA-256"):
            appstate.load(m, opt, path, load_or_create_key(str(run)))
        assert not os.path.exists(marker)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_data_file_replaced_after_the_recheck_fails_the_load(tmp_path):
    path = _snapshot(tmp_path / "run", "shared-ckpt", 5, weight=2.0)
    key = load_or_create_key(str(tmp_path / "run"))
    data = next(n for n in os.listdir(path) if n.endswith(".distcp"))
    raw = bytearray(open(os.path.join(path, data), "rb").read())
    raw[-1] ^= 0xFF
    tmp = os.path.join(path, "x")
    with open(tmp, "wb") as fh:
        fh.write(bytes(raw))
    os.replace(tmp, os.path.join(path, data))
    m, opt = _model()
    with pytest.raises(Exception, match="SHA-256"):
        appstate.load(m, opt, path, key)


# --------------------------------------------------------------------------- finding 6: the step name is signed


def test_an_older_snapshot_renamed_to_a_newer_step_is_refused(tmp_path):
    run = tmp_path / "run"
    old = _snapshot(run, "shared-ckpt", 10)
    forged = os.path.join(os.path.dirname(old), step_dirname(100))
    shutil.copytree(old, forged)  # authentic bytes, signed for step 10, under the name of step 100
    key = load_or_create_key(str(run))
    ok, why = check_checksums(forged, key)
    assert not ok and "signed for step 10, the directory is named step 100" in why
    assert not verify_snapshot(forged, key)[0]
    m, opt = _model()
    with pytest.raises(CheckpointError, match="signed for step 10"):
        appstate.load(m, opt, forged, key)
    assert check_checksums(old, key)[0]


# --------------------------------------------------------------------------- finding 7: planted files


def test_a_fifo_as_manifest_is_rejected_at_once(tmp_path):
    run = tmp_path / "run"
    path = _snapshot(run, "shared-ckpt", 5)
    os.unlink(os.path.join(path, "manifest.json"))
    os.mkfifo(os.path.join(path, "manifest.json"))
    key = load_or_create_key(str(run))
    ok, why = _in_thread(check_checksums, path, key)
    assert not ok and "a FIFO" in why
    rec = _in_thread(read_record, path)
    assert rec.state == "rejected" and "a FIFO" in rec.reason
    assert _in_thread(make_offer, "n1", str(run / "node-local" / "n1"), str(run / "shared-ckpt"))["verified"] == []


def test_a_link_to_dev_zero_as_state_is_not_read(tmp_path):
    run = tmp_path / "run"
    path = _snapshot(run, "shared-ckpt", 5)
    os.unlink(os.path.join(path, "state.json"))
    os.symlink("/dev/zero", os.path.join(path, "state.json"))
    rec = _in_thread(read_record, path)
    assert rec.state == "committed"  # no state record: not offered as verified
    ok, why = _in_thread(check_checksums, path, load_or_create_key(str(run)))
    assert not ok and "state.json is a symbolic link" in why


def test_a_link_to_usr_inside_a_snapshot_is_refused_not_walked_or_copied(tmp_path, monkeypatch):
    run = tmp_path / "run"
    path = _snapshot(run, "node-local/n1", 5)
    os.symlink("/usr", os.path.join(path, "usr"))
    walked = []
    real_lstat = os.lstat

    def watch(p, *a, **kw):
        if str(p).startswith(os.path.join(path, "usr") + os.sep):
            walked.append(p)
        return real_lstat(p, *a, **kw)

    monkeypatch.setattr(os, "lstat", watch)
    assert dir_size(path) < 1 << 20 and not walked
    ok, why = check_checksums(path, load_or_create_key(str(run)))
    assert not ok and "usr is a symbolic link" in why
    with pytest.raises(OSError, match="usr is a symbolic link"):
        copy_to_shared(path, str(run / "shared-ckpt"), "n1")
    assert not os.path.exists(run / "shared-ckpt" / step_dirname(5))
    assert os.listdir(run / "shared-ckpt") == []  # the temporary copy is gone too


def test_a_step_name_that_is_a_link_out_of_the_tree_is_not_listed(tmp_path):
    run = tmp_path / "run"
    elsewhere = _snapshot(tmp_path / "other", "x", 7)  # an authentic-looking snapshot in another folder
    (run / "shared-ckpt").mkdir(parents=True)
    os.symlink(elsewhere, run / "shared-ckpt" / step_dirname(7))
    assert scan(str(run / "shared-ckpt")) == []
