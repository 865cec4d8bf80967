"""``ckpt_service.compat`` is the one place ``ckpt_service`` touches a private torch or DCP name, and every one of
its entry points resolves and behaves on the installed torch (``make test-releases`` runs this file on every
supported release).

The scan reads the package's source (ast, nothing imported) and refuses, outside ``compat.py``:

- an import of a private torch module or name (``from torch.distributed._shard import ...``,
  ``from torch.distributed.checkpoint.filesystem import _write_item``);
- a private attribute of a name bound to a torch import (``filesystem._write_item``, ``ser._get_storage_alignment``);
- ``super()._hook`` and a private method defined on a subclass of a torch class (overriding DCP's ``_write_data``);
- a private attribute, or a ``getattr``/``hasattr`` of a private name, that the package does not define itself
  (``flat_param._params``, ``module._buffers``, ``getattr(unit, "_handle")``);
- a private keyword argument the package's own functions do not take (``FileSystemWriter(_extensions=...)``).

Dunder names (DCP's ``__create_write_items__`` protocol) are public by convention and never refused.
"""

from __future__ import annotations

import ast
import glob
import io
import os
import warnings

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "ckpt_service")
COMPAT = "compat.py"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_module(name: str | None) -> bool:
    return bool(name) and (name == "torch" or name.startswith("torch."))  # type: ignore[union-attr]


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _own_names(trees: dict[str, ast.AST]) -> set[str]:
    """Private names the package defines itself: functions, classes, assigned names and attributes, parameters."""
    own: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
    return {n for n in own if _private(n)}


def private_torch_names(sources: dict[str, str]) -> list[str]:
    """``"<file>:<line>: <what>"`` for every private torch name used in ``sources`` (file name -> text) outside
    ``compat.py``."""
    trees = {name: ast.parse(text, filename=name) for name, text in sources.items()}
    own = _own_names({n: t for n, t in trees.items() if n != COMPAT})
    found: list[str] = []
    for name, tree in sorted(trees.items()):
        if name == COMPAT:
            continue

        def hit(node: ast.AST, what: str) -> None:
            found.append(f"{name}:{getattr(node, 'lineno', 0)}: {what}")

        torch_names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if _torch_module(a.name):
                        torch_names.add(a.asname or a.name.split(".")[0])
                        if any(_private(p) for p in a.name.split(".")):
                            hit(node, f"import {a.name}")
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and _torch_module(node.module):
                for a in node.names:
                    torch_names.add(a.asname or a.name)
                    if any(_private(p) for p in (node.module or "").split(".")) or _private(a.name):
                        hit(node, f"from {node.module} import {a.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                base = node.value
                if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                    hit(node, f"super().{node.attr}")
                elif _root(base) in torch_names:
                    hit(node, f"{ast.unparse(node)}")
                elif node.attr not in own:
                    hit(node, f"{ast.unparse(node)} (not defined in ckpt_service)")
            elif isinstance(node, ast.Call):
                fn = node.func
                if (isinstance(fn, ast.Name) and fn.id in ("getattr", "hasattr", "setattr", "delattr")
                        and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                        and isinstance(node.args[1].value, str) and _private(node.args[1].value)
                        and node.args[1].value not in own):
                    hit(node, f"{fn.id}(..., {node.args[1].value!r})")
                for kw in node.keywords:
                    if kw.arg is not None and _private(kw.arg) and kw.arg not in own:
                        hit(node, f"keyword {kw.arg}=")
            elif isinstance(node, ast.ClassDef) and any(_root(b) in torch_names for b in node.bases):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name):
                        hit(item, f"{node.name}.{item.name} overrides a private hook of "
                                  f"{', '.join(ast.unparse(b) for b in node.bases)}")
    return found


def _package_sources() -> dict[str, str]:
    return {os.path.basename(p): open(p, encoding="utf-8").read()
            for p in sorted(glob.glob(os.path.join(PACKAGE, "*.py")))}


def test_no_private_torch_name_outside_the_compat_module():
    """Negative control: putting ``getattr(fp, "_params", None)`` back into ``capture.fsdp1_plan`` (as it was
    before the shim took it) fails this test, naming ``capture.py`` and the line."""
    sources = _package_sources()
    assert {"compat.py", "dcp_write.py", "sink.py", "writecheck.py", "capture.py"} <= set(sources)
    assert private_torch_names(sources) == []


@pytest.mark.parametrize("snippet, expect", [
    ("from torch.distributed.checkpoint.filesystem import _write_item\n", "import _write_item"),
    ("import torch.distributed._shard.sharded_tensor as st\n", "import torch.distributed._shard"),
    ("def f():\n    import torch.serialization as ser\n    return ser._get_storage_alignment\n",
     "ser._get_storage_alignment"),
    ("def f(fp):\n    return fp._shard_param_infos\n", "fp._shard_param_infos (not defined"),
    ("def f(unit):\n    return getattr(unit, '_handle', None)\n", "getattr(..., '_handle')"),
    ("def f(W):\n    return W('p', _extensions=[])\n", "keyword _extensions="),
    ("from torch.distributed.checkpoint import FileSystemWriter\n"
     "class W(FileSystemWriter):\n    def _write_data(self, planner, q):\n        return super()._write_data(planner, q)\n",
     "W._write_data overrides"),
])
def test_negative_control_a_private_torch_name_added_to_the_package_is_refused(snippet, expect):
    """Each form the scan knows, added to a copy of the package's sources, is named (and the clean package is not:
    the test above)."""
    sources = _package_sources()
    sources["added.py"] = snippet
    found = private_torch_names(sources)
    assert len(found) >= 1 and all(f.startswith("added.py:") for f in found), found
    assert any(expect in f for f in found), found
    sources["compat.py"] += "\n" + snippet  # the same in the compat module is allowed
    del sources["added.py"]
    assert private_torch_names(sources) == []


# ------------------------------------------------------------------ the entry points against the installed torch


def _state(torch):
    return {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}, "step": 3, "extra": {"s": "x"}}


def _loaded(torch, path):
    import torch.distributed.checkpoint as dcp

    from ckpt_service.compat import load_everything

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is ... uninitialized": by design
        return load_everything(dcp.FileSystemReader(path))


def _check(torch, got):
    want = _state(torch)
    assert set(got) == set(want)
    assert torch.equal(got["model"]["w"], want["model"]["w"]) and torch.equal(got["model"]["b"], want["model"]["b"])
    assert got["step"] == 3 and got["extra"] == {"s": "x"}


@pytest.mark.parametrize("compress", [False, True])
def test_writer_hooks_resolve_and_write_what_stock_dcp_reads(tmp_path, compress):
    """``filesystem_writer_class``: its ``write_files`` hook is reached through DCP's private ``_write_data`` (a torch
    that renamed it would never call the hook), and a writer that writes its files itself through
    :func:`compat.write_item` (``sink.write_files``, every large tensor on a page) gives a checkpoint that
    ``load_everything`` reads back whole; ``compress=True`` writes DCP's zstd extension.  Negative control: the
    compat writer's ``_write_data`` renamed (as a torch that moved the hook would leave it) fails both cases."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from ckpt_service import compat, sink

    assert compat.can_place_items()  # the supported releases all have _write_item and the storage alignment
    assert compat.filesystem_writer_class() is compat.filesystem_writer_class()  # built once
    assert len(compat.zstd_extensions(True)) == 1 and compat.zstd_extensions(False) == []
    calls: list[int] = []

    class Writer(compat.filesystem_writer_class()):  # type: ignore[misc]
        def write_files(self, planner, file_queue):
            calls.append(file_queue.qsize())
            return None if compress else sink.write_files(self, planner, file_queue)

    path = str(tmp_path / "ck")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(_state(torch), storage_writer=Writer(path, compress=compress, thread_count=2), no_dist=True)
    assert calls and calls[0] >= 1  # the hook ran, with DCP's queue of files
    meta = dcp.FileSystemReader(path).read_metadata()
    transforms = [d.transform_descriptors for d in meta.storage_data.values()]
    assert all(bool(t) == compress for t in transforms), transforms  # zstd exactly when asked for
    _check(torch, _loaded(torch, path))


def test_write_item_serialises_one_item_as_dcp_does(tmp_path):
    """``write_item`` into a plain stream: the result names the item's offset and length in it."""
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ckpt_service import compat

    w = compat.filesystem_writer_class()(str(tmp_path / "ck"))
    planner = DefaultSavePlanner()
    planner.set_up_planner({"t": torch.arange(6.0)}, is_coordinator=True)
    (item,) = planner.create_local_plan().items
    stream = io.BytesIO(b"x" * 10)
    stream.seek(10)
    result = compat.write_item(w.transforms, stream, planner.resolve_data(item), item, "f", w.serialization_format)
    assert result.index == item.index and result.storage_data.offset == 10
    assert result.storage_data.length == len(stream.getvalue()) - 10 > 0


def test_capture_entry_points_on_a_real_fsdp1_model():
    """``fsdp1_flat_params``, ``flat_param_parts``, ``fsdp1_flat_layouts`` and ``canonical_fqn`` on FSDP1 (``use_orig_params=True``) in a
    one-rank Gloo world: every original parameter once, with its shape, its shard info covering its elements, and
    its wrapper-free name; ``persistent_buffers`` leaves out non-persistent and unset buffers."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from ckpt_service import compat

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 3)
            self.bn = torch.nn.BatchNorm1d(3)
            self.register_buffer("scratch", torch.zeros(2), persistent=False)
            self.register_buffer("unset", None)

    plain = Net()
    assert [n for n, _b in compat.persistent_buffers(plain.bn)] == ["running_mean", "running_var",
                                                                    "num_batches_tracked"]
    assert compat.persistent_buffers(plain) == []  # scratch is not persistent, unset is None; bn's are its own

    own = not dist.is_initialized()  # a world another in-process test left behind is used as it is (one rank)
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # FSDP at world size 1: NO_SHARD
            model = FSDP(Net(), use_orig_params=True, device_id=torch.device("cpu"))
        flats = compat.fsdp1_flat_params(model)
        assert len(flats) == 1
        parts = compat.flat_param_parts(flats[0])
        names = {id(p): n for n, p in model.named_parameters()}
        assert parts is not None and sorted(compat.canonical_fqn(model, names[id(p)]) for p, _i, _s in parts) == [
            "a.bias", "a.weight", "bn.bias", "bn.weight"]
        for p, info, shape in parts:
            assert list(shape) == list(dict(Net().named_parameters())[compat.canonical_fqn(model, names[id(p)])].shape)
            assert info.in_shard and info.intra_param_end_idx + 1 - info.intra_param_start_idx == p.numel()
        assert compat.fsdp1_flat_params(torch.nn.Linear(2, 2)) == []
        # the unflattening layout: each parameter's elements where FSDP's flat layout puts them (one rank: all)
        (fp, rank, layout), = compat.fsdp1_flat_layouts(model)
        assert fp is flats[0] and rank == 0 and layout is not None and len(layout) == 4
        assert sorted(start for _p, _s, start in layout) == [start for _p, _s, start in layout]
        for p, shape, start in layout:
            assert list(shape) == list(dict(Net().named_parameters())[compat.canonical_fqn(model, names[id(p)])].shape)
            assert fp.detach()[start:start + p.numel()].data_ptr() == p.detach().data_ptr()
        assert compat.fsdp1_flat_layouts(torch.nn.Linear(2, 2)) == []
    finally:
        if own:
            dist.destroy_process_group()


def test_a_module_that_writes_its_own_state_dict_is_planned_from_get_state_dict():
    """``writes_own_state_dict``: a class overriding ``_save_to_state_dict`` or a state-dict hook puts state into the
    state dict that FSDP1's plan (parameters and persistent buffers read directly) would not see, nor the capture
    proof; such a model is planned from ``get_state_dict``.  Negative control: the same model without the override
    takes the FSDP1 plan."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from ckpt_service import compat
    from ckpt_service.capture import fsdp1_plan

    class Observer(torch.nn.Linear):
        def _save_to_state_dict(self, destination, prefix, keep_vars):
            super()._save_to_state_dict(destination, prefix, keep_vars)
            destination[prefix + "scale"] = torch.ones(1)

    plain, own_sd, hooked = torch.nn.Linear(2, 2), Observer(2, 2), torch.nn.Linear(2, 2)
    hooked._register_state_dict_hook(lambda module, sd, prefix, local: sd)
    assert [compat.writes_own_state_dict(m) for m in (plain, own_sd, hooked, torch.nn.BatchNorm1d(2))] == [
        False, True, True, False]
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # FSDP at world size 1: NO_SHARD
            for inner, planned in ((torch.nn.Linear(2, 2), True), (Observer(2, 2), False)):
                model = FSDP(torch.nn.Sequential(inner, torch.nn.ReLU()), use_orig_params=True,
                             device_id=torch.device("cpu"))
                opt = torch.optim.AdamW(model.parameters(), lr=0.1)
                assert (fsdp1_plan(model, opt) is not None) == planned, type(inner).__name__
    finally:
        if own:
            dist.destroy_process_group()


def test_sharded_tensor_type_is_torchs_class():
    torch = pytest.importorskip("torch")
    from ckpt_service import compat

    cls = compat.sharded_tensor_type()
    assert cls.__name__ == "ShardedTensor" and issubclass(cls, torch.Tensor)
    assert not isinstance(torch.zeros(1), cls)
