"""The safetensors file this project writes itself, read back by stock ``safetensors``; the export of a real DCP
snapshot (bf16 among its dtypes) from a verified snapshot only.

The snapshots here are written by stock ``dcp.save`` in one process and signed under a run's key the way the
daemon signs its own (a manifest of every file's size and SHA-256): no job runs.  The export of both examples'
snapshots from real jobs is in ``tests/e2e/test_examples.py``; a planted snapshot is refused in
``tests/ckpt_service/test_auth.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import warnings

import pytest

import torch
from safetensors import safe_open  # the test extra's stock reader
from safetensors.torch import load_file

from accelpact_slurm.core.errors import CheckpointError
from ckpt_service import safetensors_file
from ckpt_service.auth import load_or_create_key, sign
from ckpt_service.export import export_snapshot, format_for
from ckpt_service.index import record_state
from tests.conftest import run_cli


def _bits(t):
    """A tensor's bytes: equal bits, not merely equal values (-0.0, NaN payloads)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _tensors():
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(5, 7, generator=gen)
    return {
        "emb.weight": base,
        "layers.0.proj.weight": base.to(torch.bfloat16),
        "layers.0.proj.bias": torch.tensor([-0.0, float("nan"), float("inf"), 1e-40]).to(torch.bfloat16),
        "half": base[:2].to(torch.float16),
        "double": base[:1].double(),
        "transposed": base.t(),  # not contiguous: written in C order of its shape
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "steps": torch.tensor([1, -2, 3], dtype=torch.int64),
        "small": torch.tensor([1, -2], dtype=torch.int8),
        "bytes": torch.tensor([0, 255], dtype=torch.uint8),
        "mask": torch.tensor([True, False, True]),
    }


def test_stock_safetensors_loads_every_dtype_bitwise_bf16_included(tmp_path):
    tensors = _tensors()
    out = str(tmp_path / "m.safetensors")
    size = safetensors_file.write(out, tensors, {"format": "pt", "step": "7"})
    assert size == os.path.getsize(out)
    got = load_file(out)
    assert sorted(got) == sorted(tensors)
    assert [n for n in tensors if not _same(got[n], tensors[n])] == []
    with safe_open(out, framework="pt") as fh:
        assert fh.metadata() == {"format": "pt", "step": "7"}
        assert _same(fh.get_tensor("layers.0.proj.weight"), tensors["layers.0.proj.weight"])


def test_the_layout_is_the_format_length_header_then_contiguous_sorted_little_endian_bytes(tmp_path):
    tensors = {"b": torch.tensor([1.0, 2.0]), "a": torch.tensor([3], dtype=torch.int32),
               "c": torch.tensor([1.5], dtype=torch.bfloat16)}
    out = tmp_path / "m.safetensors"
    safetensors_file.write(str(out), tensors)
    raw = out.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % safetensors_file.ALIGN == 0  # the byte buffer starts aligned
    head = json.loads(raw[8:8 + n].decode())
    assert "__metadata__" not in head
    assert head["a"] == {"dtype": "I32", "shape": [1], "data_offsets": [0, 4]}
    assert head["b"] == {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}
    assert head["c"] == {"dtype": "BF16", "shape": [1], "data_offsets": [12, 14]}
    data = raw[8 + n:]
    assert len(data) == 14
    assert data[0:4] == (3).to_bytes(4, "little") and data[4:12] == struct.pack("<2f", 1.0, 2.0)
    assert data[12:14] == struct.pack("<f", 1.5)[2:]  # bf16: the upper half of the float32


def test_what_safetensors_cannot_hold_is_refused_by_name(tmp_path):
    with pytest.raises(CheckpointError, match="dtype complex64 has no safetensors equivalent"):
        safetensors_file.write(str(tmp_path / "c.safetensors"), {"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(CheckpointError, match="'__metadata__' cannot be stored"):
        safetensors_file.header({"__metadata__": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="strings to strings"):
        safetensors_file.header({"a": torch.zeros(1)}, {"step": 3})
    assert not os.listdir(tmp_path)  # nothing half-written left behind


def test_the_format_follows_the_flag_else_the_suffix():
    assert format_for("m.safetensors", None) == "safetensors"
    assert format_for("m.pt", None) == "torch"
    assert format_for("m.bin", "safetensors") == "safetensors"
    with pytest.raises(CheckpointError, match="not one of torch, safetensors"):
        format_for("m.pt", "onnx")


# --------------------------------------------------------------------------- a snapshot in DCP's format


def _snapshot(run, step, model, state="verified", extra="{}", node="node1"):
    """A DCP directory ``{"model", "optim", "extra"}`` of stock ``dcp.save``, its manifest signed by the run."""
    import torch.distributed.checkpoint as dcp

    key = load_or_create_key(str(run))
    path = run / "node-local" / node / f"step-{step:010d}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model, "optim": {"state": {"0": {"exp_avg": torch.ones(3)}}},
                  "extra": {"json": extra}}, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    files = {}
    for name in sorted(os.listdir(path)):
        data = (path / name).read_bytes()
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(sign({"format": 1, "step": step, "files": files}, key)))
    record_state(str(path), state)
    return str(path), key


def test_a_dcp_snapshot_exports_the_model_only_under_its_own_names(tmp_path):
    model = {"tok.weight": torch.randn(6, 4).to(torch.bfloat16), "layers.0.qkv.weight": torch.randn(12, 4),
             "norm.running_mean": torch.randn(4), "norm.num_batches_tracked": torch.tensor(9)}
    path, key = _snapshot(tmp_path / "run", 12, model)
    out = str(tmp_path / "m.safetensors")
    line = export_snapshot(path, out, "safetensors", key)
    assert "safetensors, 4 tensors" in line
    got = load_file(out)
    assert sorted(got) == sorted(model)  # no "model." prefix, no optimizer state, no extra state
    assert [n for n in model if not _same(got[n], model[n])] == []
    with safe_open(out, framework="pt") as fh:
        meta = fh.metadata()
    assert {k: meta[k] for k in ("format", "step", "source", "buffers_rank")} == {
        "format": "pt", "step": "12", "source": "step-0000000012", "buffers_rank": "0"}, meta
    assert meta["buffers"].startswith("rank 0's") and meta["rank_buffers"] == "0"


def test_the_export_of_another_nodes_copy_holds_rank_0s_buffers_and_says_so(tmp_path):
    """A second node's snapshot holds its first rank's (rank 2's) batch-norm statistics in the model state and
    every rank's own in the extra state: both formats export rank 0's, and say so.  Negative control: the
    node's copy itself (what the export wrote before) differs from rank 0's."""
    from accelpact_slurm.runtime.state import appstate

    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(4, generator=gen)
    mine = {"norm.running_mean": torch.randn(4, generator=gen), "norm.num_batches_tracked": torch.tensor(7)}
    rank0 = {"norm.running_mean": torch.randn(4, generator=gen), "norm.num_batches_tracked": torch.tensor(7)}
    extra = json.dumps({"run": {}, "ranks": {"0": {"buffers": appstate.encode(rank0, "buffers")},
                                             "2": {"buffers": appstate.encode(mine, "buffers")}}})
    path, key = _snapshot(tmp_path / "run", 12, {"norm.weight": weight, **mine}, extra=extra, node="node2")
    line = export_snapshot(path, str(tmp_path / "m.safetensors"), "safetensors", key)
    assert "buffers rank 0's (2 of its own)" in line, line
    got = load_file(str(tmp_path / "m.safetensors"))
    assert _same(got["norm.weight"], weight) and not _same(mine["norm.running_mean"], rank0["norm.running_mean"])
    assert all(_same(got[k], rank0[k]) for k in rank0), got
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as fh:
        assert fh.metadata()["buffers_rank"] == "0" and fh.metadata()["world_size"] == "2"
    line = export_snapshot(path, str(tmp_path / "m.pt"), "torch", key)
    whole = torch.load(str(tmp_path / "m.pt"))
    assert sorted(whole["model"]) == sorted(got) and all(_same(whole["model"][k], got[k]) for k in got)
    assert whole["export"]["buffers_rank"] == "0" and "optim" in whole and "extra" in whole, sorted(whole)
    # a snapshot whose model state holds no buffer (FSDP1's capture before it saved them): rank 0's own are added
    path, key = _snapshot(tmp_path / "run", 14, {"norm.weight": weight}, extra=extra)
    export_snapshot(path, str(tmp_path / "old.safetensors"), "safetensors", key)
    old = load_file(str(tmp_path / "old.safetensors"))
    assert sorted(old) == sorted(got) and all(_same(old[k], got[k]) for k in got)
    # a buffer of rank 0 whose shape differs from the model state's: the snapshot is inconsistent, nothing written
    bad = json.dumps({"run": {}, "ranks": {"0": {"buffers": appstate.encode({"norm.running_mean": torch.ones(2)},
                                                                            "buffers")}}})
    path, key = _snapshot(tmp_path / "run", 13, {"norm.weight": weight, **mine}, extra=bad)
    with pytest.raises(CheckpointError, match="rank 0's buffer 'norm.running_mean' is \\(2,\\) torch.float32"):
        export_snapshot(path, str(tmp_path / "bad.safetensors"), "safetensors", key)
    assert not (tmp_path / "bad.safetensors").exists()


@pytest.mark.parametrize("state", ["committed", "rejected"])
def test_an_unverified_snapshot_is_refused_and_the_same_one_verified_exports(tmp_path, state):
    w = torch.randn(3)
    path, key = _snapshot(tmp_path / "run", 4, {"w": w}, state=state)
    out = tmp_path / "m.safetensors"
    with pytest.raises(CheckpointError, match=f"it is {state}.*not verified: only a verified snapshot is exported"):
        export_snapshot(path, str(out), "safetensors", key)
    assert not out.exists()
    # negative control: the very same files, recorded verified, export; the state alone refused them
    record_state(path, "verified")
    export_snapshot(path, str(out), "safetensors", key)
    assert _same(load_file(str(out))["w"], w)


def test_a_changed_file_is_refused_though_recorded_verified(tmp_path):
    path, key = _snapshot(tmp_path / "run", 4, {"w": torch.randn(64)})
    shard = next(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".distcp"))
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(shard, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="fails its SHA-256 checksum"):
        export_snapshot(path, str(tmp_path / "m.safetensors"), "safetensors", key)
    assert not (tmp_path / "m.safetensors").exists()


def test_the_cli_refuses_an_unverified_snapshot_in_one_line_exit_1(tmp_path):
    path, _ = _snapshot(tmp_path / "run", 4, {"w": torch.randn(3)}, state="committed")
    out = tmp_path / "m.safetensors"
    proc = run_cli(["accelpact_slurm.cli.ckpt", "export", path, str(out)], timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"accelpact-ckpt: refusing to export {path}: it is committed") and "verify" in line, line
    assert not out.exists()
    proc = run_cli(["accelpact_slurm.cli.ckpt", "export", "--help"], timeout=60)
    assert proc.returncode == 0 and "safetensors" in proc.stdout and "torch" in proc.stdout
    assert "only a snapshot recorded verified" in " ".join(proc.stdout.split()).lower()
