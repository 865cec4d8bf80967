"""The manifest's file digests (ckpt_service/digest.py): BLAKE3 written now, SHA-256 manifests still read, nothing
else accepted, and a planted snapshot refused under the new digest as under the old one."""

from __future__ import annotations

import hashlib
import json
import os

import blake3
import pytest

from ckpt_service import digest
from ckpt_service.auth import sign
from ckpt_service.verify import verify_snapshot

KEY = b"k" * 32


def _written(tmp_path):
    torch = pytest.importorskip("torch")
    from ckpt_service import dcp_write
    from tests.ckpt_service.test_write_path import _descs

    t, descs = _descs(tmp_path, torch)
    path, _ = dcp_write.write_snapshot(str(tmp_path / "node"), 7, descs, node="n", key=KEY)
    return torch, t, path


def _manifest(path):
    with open(os.path.join(path, "manifest.json")) as fh:
        return json.load(fh)


def _resign(path, manifest, key=KEY):
    body = {k: v for k, v in manifest.items() if k != "hmac"}
    with open(os.path.join(path, "manifest.json"), "w") as fh:
        json.dump(sign(body, key), fh)


def test_a_new_snapshot_names_blake3_and_every_file_is_hashed_with_it(tmp_path):
    _torch, _t, path = _written(tmp_path)
    m = _manifest(path)
    assert m["format"] == 3 and m["digest"] == "blake3"
    for name, want in m["files"].items():
        with open(os.path.join(path, name), "rb") as fh:
            assert want["blake3"] == blake3.blake3(fh.read()).hexdigest() and "sha256" not in want
    ok, why = verify_snapshot(path, KEY)
    assert ok, why


def test_an_old_sha256_manifest_still_verifies_and_loads(tmp_path):
    """A format-2 manifest (no ``digest``, SHA-256 entries), signed by the run's key, as the daemon wrote before."""
    torch, t, path = _written(tmp_path)
    m = _manifest(path)
    old = {k: v for k, v in m.items() if k != "digest"}
    old["format"] = 2
    for name, want in old["files"].items():
        with open(os.path.join(path, name), "rb") as fh:
            old["files"][name] = {"size": want["size"], "sha256": hashlib.sha256(fh.read()).hexdigest()}
    _resign(path, old)
    ok, why = verify_snapshot(path, KEY)
    assert ok, why
    import torch.distributed.checkpoint as dcp

    from ckpt_service.verified import VerifiedReader  # the reload's reader: every file checked on its handle

    back = {"model": {"w": torch.zeros_like(t)}, "lr": 0, "extra": {"json": ""}}
    dcp.load(back, storage_reader=VerifiedReader(path, KEY), no_dist=True)
    assert torch.equal(back["model"]["w"], t)


def test_a_planted_snapshot_is_refused_under_the_new_digest(tmp_path):
    """A data file replaced, its BLAKE3 and size recomputed, the manifest consistent, signed with another key:
    refused.  Negative control: the very same manifest signed with the run's key passes (the refusal is the
    authentication's; the digest alone cannot stop whoever rewrites the manifest)."""
    _torch, _t, path = _written(tmp_path)
    m = _manifest(path)
    victim = next(n for n in m["files"] if n.endswith(".distcp"))
    with open(os.path.join(path, victim), "r+b") as fh:
        data = bytearray(fh.read())
        data[len(data) // 2] ^= 0xFF
        fh.seek(0)
        fh.write(data)
    m["files"][victim] = {"size": len(data), "blake3": blake3.blake3(bytes(data)).hexdigest()}
    _resign(path, m, key=b"x" * 32)
    ok, why = verify_snapshot(path, KEY)
    assert not ok and "fails its BLAKE3" not in why, why
    _resign(path, m, key=KEY)  # the control
    assert verify_snapshot(path, KEY)[0]


def test_a_changed_byte_fails_its_blake3_checksum(tmp_path):
    _torch, _t, path = _written(tmp_path)
    victim = next(n for n in _manifest(path)["files"] if n.endswith(".distcp"))
    with open(os.path.join(path, victim), "r+b") as fh:
        fh.seek(100)
        b = fh.read(1)
        fh.seek(100)
        fh.write(bytes([b[0] ^ 1]))
    ok, why = verify_snapshot(path, KEY)
    assert not ok and f"{victim} fails its BLAKE3 checksum" in why, why


@pytest.mark.parametrize("change, words", [
    (lambda m: m.update(digest="crc32"), "names the digest 'crc32'"),
    (lambda m: [w.update(sha256="0" * 64) for w in m["files"].values()], "carries a sha256 digest beside"),
    (lambda m: [w.pop("blake3") for w in m["files"].values()], "with a size and a blake3 digest"),
    (lambda m: m.update(digest="sha256"), "with a size and a sha256 digest"),  # entries of another algorithm
])
def test_a_manifest_whose_digests_disagree_with_its_algorithm_is_refused(tmp_path, change, words):
    """Signed with the run's key, so only the digest rules refuse it."""
    _torch, _t, path = _written(tmp_path)
    m = _manifest(path)
    change(m)
    _resign(path, m)
    ok, why = verify_snapshot(path, KEY)
    assert not ok and words in why, why


def test_the_digest_module_knows_only_collision_resistant_algorithms():
    assert set(digest.ALGORITHMS) == {"blake3", "sha256"} and digest.WRITE == "blake3"
    assert digest.of_bytes(b"abc", "sha256") == hashlib.sha256(b"abc").hexdigest()
    with pytest.raises(KeyError, match="unknown digest 'md5'"):
        digest.new("md5")
