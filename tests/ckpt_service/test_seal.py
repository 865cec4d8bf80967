"""The daemon's verification sealed to the inodes it hashed: a reload of them unchanged hashes nothing again,
a file changed through the file system after the seal (in place, its mtime put back; replaced; a copy elsewhere)
is hashed again and a wrong byte refused, and a seal the run's key did not make is no seal.

A real daemon in this process writes and verifies a snapshot from real shared-memory slots; ``drain_and_close``
joins its threads, so the assertions read a settled state: no sleeps.  Hashing is counted at
``ckpt_service.verified._hash_fd``, the one place a data file is hashed.
"""

from __future__ import annotations

import os
import shutil

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # no_dist DCP save

from ckpt_service import seal, staging, verified  # noqa: E402
from ckpt_service.auth import load_key  # noqa: E402
from ckpt_service.daemon import Daemon, DaemonOptions  # noqa: E402
from tests.conftest import stage_half  # noqa: E402
from ckpt_service.index import record_state, scan  # noqa: E402
from ckpt_service.layout import step_dirname  # noqa: E402
from ckpt_service.verify import check_checksums  # noqa: E402

DEADLINE_S = 60.0
STEP = 6


def _stage(daemon: Daemon, slot: staging.Slot, local_rank: int) -> dict:
    """Stage local rank ``local_rank``'s half of a [8, 8] weight for :data:`STEP` and hand it over."""
    return stage_half(daemon, slot, STEP, local_rank, torch.arange(32, dtype=torch.float32).reshape(4, 8) +
                      100 * local_rank)


@pytest.fixture(scope="module")
def verified_snapshot(tmp_path_factory):
    """``(run_dir, step_dir)``: snapshot 6 of node1, written and verified by a real daemon (left untouched: each test
    works on a copy)."""
    tmp = tmp_path_factory.mktemp("seal")
    run_dir = str(tmp / "run")
    d = Daemon(DaemonOptions(node="node1", node_dir=str(tmp / "run" / "node-local" / "node1"), run_dir=run_dir,
                             node_index=0, num_nodes=1, job_id="t", drain_s=DEADLINE_S))
    d.start()
    try:
        slots = [staging.Slot(staging.slot_path(d.stage_root, lr, 0)) for lr in range(2)]
        _stage(d, slots[0], 0)
        assert _stage(d, slots[1], 1)["complete"] is True
        assert d.handle({"op": "wait", "step": STEP, "timeout": DEADLINE_S})["state"] == "verified"
    finally:
        assert d.drain_and_close()
    assert {r.step: r.state for r in scan(d.ndir)} == {STEP: "verified"}
    return run_dir, os.path.join(d.ndir, step_dirname(STEP))


@pytest.fixture()
def hashes(monkeypatch):
    """The names of the files hashed through ``_hash_fd`` (every data file a check or a load hashes)."""
    seen: list[str] = []
    real = verified._hash_fd

    def counting(fd, drop, algorithm):
        seen.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd, drop, algorithm)

    monkeypatch.setattr(verified, "_hash_fd", counting)
    return seen


def _data_files(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".distcp"))


def _load_w(path: str, key: bytes, sealed=None) -> torch.Tensor:
    """The weight read back through the verified reader, as a reload reads it."""
    import torch.distributed.checkpoint as dcp

    sd = {"model": {"w": torch.zeros(8, 8)}}
    dcp.load(sd, storage_reader=verified.VerifiedReader(path, key, None, sealed), no_dist=True)
    return sd["model"]["w"]


def _sealed(path: str, key: bytes) -> dict:
    manifest, _why = verified.read_manifest(path, key)
    return seal.read(path, key, manifest)


def test_the_daemon_seals_every_file_it_verified_and_a_reload_hashes_none_of_them_again(verified_snapshot, hashes):
    run_dir, path = verified_snapshot
    key = load_key(run_dir)
    manifest, _why = verified.read_manifest(path, key)
    sealed = _sealed(path, key)
    assert set(sealed) == set(manifest["files"]) and _data_files(path)
    for name, ident in sealed.items():
        assert ident == seal.identity(os.stat(os.path.join(path, name)))
    ok, why = check_checksums(path, key, trust_seal=True)
    assert ok and "still the files the daemon hashed" in why, why
    assert hashes == []
    want = torch.cat([torch.arange(32, dtype=torch.float32).reshape(4, 8) + 100 * r for r in range(2)])
    assert torch.equal(_load_w(path, key, sealed), want) and hashes == []
    # negative control: without the seal every file is hashed, by the check and by the load
    assert check_checksums(path, key)[0] and sorted(hashes) == sorted(manifest["files"])
    hashes.clear()
    assert torch.equal(_load_w(path, key), want) and hashes == _data_files(path)


def _own_sealed_copy(src: str, dst: str, key: bytes) -> str:
    """A copy of ``src`` (other inodes) with a seal of its own inodes, as its own daemon would have sealed it."""
    shutil.copytree(src, dst)
    manifest, _why = verified.read_manifest(dst, key)
    ids = {n: seal.identity(os.stat(os.path.join(dst, n))) for n in manifest["files"]}
    record_state(dst, "verified", None, **{seal.KEY: seal.make(key, manifest, ids)})
    return dst


def test_a_file_written_in_place_after_the_seal_is_hashed_again_and_refused(verified_snapshot, tmp_path, hashes):
    """A write through the file system moves the inode's ctime, which no user can set back (its mtime put back)."""
    run_dir, src = verified_snapshot
    key = load_key(run_dir)
    path = _own_sealed_copy(src, str(tmp_path / step_dirname(STEP)), key)
    assert check_checksums(path, key, trust_seal=True)[0] and hashes == []
    data = os.path.join(path, _data_files(path)[0])
    st = os.stat(data)
    with open(data, "r+b") as fh:
        fh.seek(st.st_size - 1)
        last = fh.read(1)
        fh.seek(st.st_size - 1)
        fh.write(bytes([last[0] ^ 0xFF]))
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(data).st_mtime_ns == st.st_mtime_ns and os.stat(data).st_ctime_ns != st.st_ctime_ns
    ok, why = check_checksums(path, key, trust_seal=True)
    assert not ok and "checksum" in why and hashes == [os.path.basename(data)], (why, hashes)
    with pytest.raises(BaseException, match="checksum"):  # DCP's CheckpointException around the reader's error
        _load_w(path, key, _sealed(path, key))


def test_a_copy_in_another_place_is_other_inodes_and_is_hashed(verified_snapshot, tmp_path, hashes):
    """The shared tier's copy (or any copy) carries the node's ``state.json``, seal and all: its files are
    hashed all the same; so is a sealed inode linked under another directory (the link moves its ctime)."""
    run_dir, src = verified_snapshot
    key = load_key(run_dir)
    copy = str(tmp_path / "shared" / step_dirname(STEP))
    shutil.copytree(src, copy)  # copy2: the same sizes and mtimes, other inodes
    assert _sealed(copy, key)  # the seal travelled, valid under the run's key ...
    ok, why = check_checksums(copy, key, trust_seal=True)
    assert ok and sorted(hashes) == sorted(_sealed(copy, key)), (why, hashes)  # ... and holds for none of its files
    hashes.clear()
    path = _own_sealed_copy(src, str(tmp_path / "own" / step_dirname(STEP)), key)
    linked = str(tmp_path / "linked" / step_dirname(STEP))
    shutil.copytree(path, linked, copy_function=os.link)
    assert check_checksums(path, key, trust_seal=True)[0] and len(hashes) == len(_sealed(path, key))


def test_a_seal_the_runs_key_did_not_make_is_no_seal(verified_snapshot, tmp_path):
    run_dir, src = verified_snapshot
    key = load_key(run_dir)
    path = _own_sealed_copy(src, str(tmp_path / step_dirname(STEP)), key)
    manifest, _why = verified.read_manifest(path, key)
    good = _sealed(path, key)
    assert good and seal.read(path, b"another run's key", manifest) == {} and seal.read(path, None, manifest) == {}
    other = dict(manifest, hmac="0" * 64)  # the seal names its manifest: it does not hold for another one
    assert seal.read(path, key, other) == {}
    record_state(path, "verified", None, **{seal.KEY: seal.make(b"another run's key", manifest, good)})
    assert seal.read(path, key, manifest) == {}
    record_state(path, "rejected", "test", **{seal.KEY: seal.make(key, manifest, good)})
    assert seal.read(path, key, manifest) == {}  # beside another state than verified, a seal is none
    record_state(path, "verified", None, **{seal.KEY: seal.make(key, manifest, good)})
    assert seal.read(path, key, manifest) == good  # the control: the same seal, verified, under the run's key
