"""Who may load what: manifests are authenticated under the run's key before anything else of a snapshot is read.

The planted snapshot below has a consistent manifest (sizes and SHA-256 match), a ``verified`` state record
and a ``.metadata`` whose unpickling would create a marker file.  Negative control: without the
authentication (``key=None``, the code before this fix) verification unpickles it and the marker appears.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle

import pytest

from accelpact_slurm.core.errors import CheckpointError
from ckpt_service.auth import authenticate, key_path, load_key, load_or_create_key, sign
from ckpt_service.index import record_state
from ckpt_service.verify import verify_snapshot
from tests.conftest import run_cli


class _Marker:
    """Unpickling this creates ``path``: what a planted ``.metadata`` could do instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _plant(step_dir, marker, key: bytes | None = None) -> None:
    step_dir.mkdir(parents=True)
    (step_dir / ".metadata").write_bytes(pickle.dumps(_Marker(str(marker))))
    data = (step_dir / ".metadata").read_bytes()
    manifest = {"format": 1, "step": 9, "files": {".metadata": {"size": len(data),
                                                                "sha256": hashlib.sha256(data).hexdigest()}}}
    (step_dir / "manifest.json").write_text(json.dumps(sign(manifest, key) if key else manifest))
    record_state(str(step_dir), "verified")


def test_sign_and_authenticate_round_trip_and_tampering():
    key, other = b"k" * 32, b"o" * 32
    m = sign({"step": 3, "files": {"a": {"size": 1, "sha256": "x"}}}, key)
    assert authenticate(m, key) == (True, "manifest written by this run")
    assert not authenticate(m, other)[0]
    assert not authenticate({**m, "step": 4}, key)[0]
    assert "no HMAC" in authenticate({k: v for k, v in m.items() if k != "hmac"}, key)[1]


def test_the_key_is_created_once_0600_and_a_loose_one_is_refused(tmp_path):
    k1 = load_or_create_key(str(tmp_path))
    assert load_or_create_key(str(tmp_path)) == k1 and len(k1) == 32
    assert os.stat(key_path(str(tmp_path))).st_mode & 0o777 == 0o600
    os.chmod(key_path(str(tmp_path)), 0o644)
    with pytest.raises(CheckpointError, match="mode 0600"):
        load_key(str(tmp_path))


@pytest.mark.parametrize("signer", ["none", "another run"])
def test_a_planted_snapshot_is_rejected_unread(tmp_path, signer):
    key = load_or_create_key(str(tmp_path / "run"))
    marker = tmp_path / "pickle-ran"
    _plant(tmp_path / "run" / "shared-ckpt" / "step-0000000009", marker, None if signer == "none" else b"x" * 32)
    ok, why = verify_snapshot(str(tmp_path / "run" / "shared-ckpt" / "step-0000000009"), key)
    assert not ok and "not written by this run" in why
    assert not marker.exists()


def test_negative_control_without_authentication_the_planted_pickle_runs(tmp_path):
    marker = tmp_path / "pickle-ran"
    _plant(tmp_path / "s" / "step-0000000009", marker)
    try:
        verify_snapshot(str(tmp_path / "s" / "step-0000000009"), None)
    except Exception:  # what the unpickled object does next does not matter: it already ran
        pass
    assert marker.exists()


def test_the_reload_check_rejects_a_planted_copy(tmp_path):
    from accelpact_slurm.runtime.state.restore import StateIO

    run = tmp_path / "run"
    load_or_create_key(str(run))
    marker = tmp_path / "pickle-ran"
    _plant(run / "shared-ckpt" / "step-0000000009", marker)
    io = StateIO(lambda p: None, str(run), str(run / "node-local" / "node1"), "node1", 0)
    ok, why = io.check(str(run / "shared-ckpt" / "step-0000000009"))
    assert not ok and "no HMAC" in why and not marker.exists()


@pytest.mark.slow
def test_accelpact_ckpt_verify_and_export_refuse_it(tmp_path):
    run = tmp_path / "run"
    load_or_create_key(str(run))
    marker = tmp_path / "pickle-ran"
    snap = run / "shared-ckpt" / "step-0000000009"
    _plant(snap, marker)
    proc = run_cli(["accelpact_slurm.cli.ckpt", "verify", str(snap)], timeout=120)
    assert proc.returncode == 1 and "REJECTED" in proc.stdout and "no HMAC" in proc.stdout, proc.stdout + proc.stderr
    proc = run_cli(["accelpact_slurm.cli.ckpt", "export", str(snap), str(tmp_path / "out.pt")], timeout=120)
    assert proc.returncode == 1 and "refusing to export" in proc.stderr, proc.stdout + proc.stderr
    assert not marker.exists() and not (tmp_path / "out.pt").exists()
    out = tmp_path / "model.safetensors"
    proc = run_cli(["accelpact_slurm.cli.ckpt", "export", str(snap), str(out), "--format", "safetensors"], timeout=120)
    assert proc.returncode == 1 and "refusing to export" in proc.stderr and "not written by this run" in proc.stderr, \
        proc.stdout + proc.stderr
    assert not marker.exists() and not out.exists()


def test_negative_control_an_export_without_authentication_runs_the_planted_pickle(tmp_path):
    """What the export's authentication prevents: the planted snapshot is recorded ``verified`` and its manifest
    matches its files, so only the run's key tells it apart."""
    from ckpt_service.export import export_snapshot

    marker = tmp_path / "pickle-ran"
    snap = tmp_path / "run" / "shared-ckpt" / "step-0000000009"
    _plant(snap, marker)
    try:
        export_snapshot(str(snap), str(tmp_path / "model.safetensors"), "safetensors", None)
    except Exception:  # what the unpickled object does next does not matter: it already ran
        pass
    assert marker.exists()


def test_a_key_being_written_by_a_concurrent_first_caller_is_waited_for(tmp_path, monkeypatch):
    """Ranks of one start race to create the key: a reader that opened the file while it was still empty and read
    after the writer's write sees it "grew past the 0 bytes it had when opened" (seen once in 325 trials of a
    release's envelope run: rank 0 exited 2 with that line).  That is a key being written, waited for within the
    same deadline as an empty file, not a planted one.  The interleaving is forced here: the first read raises
    exactly what the real one raised then.  Negative control: without the retry on EFBIG/EIO in ``load_key`` the
    reader raises CheckpointError at once."""
    import errno

    from accelpact_slurm.core.safeopen import NotRegular
    from ckpt_service import auth

    key = load_or_create_key(str(tmp_path))
    real, calls = auth.read_regular, []

    def racing(path, limit, **kw):
        calls.append(path)
        if len(calls) == 1:
            raise NotRegular(errno.EFBIG, path, "grew past the 0 bytes it had when opened: not read")
        return real(path, limit, **kw)

    monkeypatch.setattr(auth, "read_regular", racing)
    assert load_key(str(tmp_path)) == key and len(calls) == 2
    calls.clear()

    def planted(path, limit, **kw):  # not a write in progress: still refused at once
        calls.append(path)
        raise NotRegular(errno.ELOOP, path, "is a symbolic link: not followed")

    monkeypatch.setattr(auth, "read_regular", planted)
    with pytest.raises(CheckpointError, match="symbolic link"):
        load_key(str(tmp_path))
    assert len(calls) == 1
