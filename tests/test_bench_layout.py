"""The benchmarks are a project of their own that uses the product only through its public names.

Every file under ``benchmarks/`` is parsed; a reference to a name of the product (``accelpact_slurm``,
``ckpt_service``) that starts with ``_`` fails: an import of a private module or name, an attribute ``x._name`` on
anything that is not the benchmark's own object (``self``, ``cls``, ``super()``) or a module of another project
(``os``, ``torch``: names bound by an import that is not the product's), and ``getattr``/``setattr``/``hasattr``
with such a literal name.  What a benchmark times comes through the product's events or its public
instrumentation hooks instead.  Pure: nothing runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
PRODUCT = {"accelpact_slurm", "ckpt_service"}
SCRIPTS_KEPT = {"campaign.py", "campaign_kinds.py", "dev-cluster.sh", "earn_envelope.py", "gpu-check.sh",
                "gpu_check.py", "torch_venv.py"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _foreign_names(tree: ast.AST) -> set[str]:
    """Names bound by imports of modules that are not the product's (their private names are theirs to judge)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] not in PRODUCT:
                    out.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] not in PRODUCT | {"benchmarks"}:
            out.update(a.asname or a.name for a in node.names)
    return out


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def private_references(source: str, path: str = "<source>") -> list[str]:
    """Each reference to a private product name in ``source``, as ``path:line: what``."""
    tree = ast.parse(source, path)
    foreign = _foreign_names(tree)
    out = []
    for node in ast.walk(tree):
        where = f"{path}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            out += [f"{where}: import {a.name}" for a in node.names
                    if a.name.split(".")[0] in PRODUCT and any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PRODUCT:
            if any(map(_private, node.module.split("."))):
                out.append(f"{where}: from {node.module} import ...")
            out += [f"{where}: from {node.module} import {a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = _root(node.value)
            if isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in foreign):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            out.append(f"{where}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and _private(node.args[1].value) \
                and not (isinstance(node.args[0], ast.Name) and node.args[0].id in foreign):
            out.append(f"{where}: {ast.unparse(node)}")
    return out


def test_no_benchmark_references_a_private_product_name():
    # the parts and the harness; not what a run installs beside them (benchmarks/.venvs: other projects' packages)
    files = sorted(f for f in BENCH.rglob("*.py") if not any(p.startswith(".") for p in f.relative_to(BENCH).parts))
    assert len(files) > 20  # the scan ran over the parts
    found = [hit for f in files for hit in private_references(f.read_text(), str(f.relative_to(REPO)))]
    assert found == [], "benchmarks reach into private product state:\n" + "\n".join(found)


def test_a_private_reference_is_found():
    """Negative control: each kind of private reference the rule names is found; a foreign module's is not."""
    src = "\n".join([
        "import os",
        "from torch.distributed import checkpoint as dcp",
        "from accelpact_slurm.runtime import _hidden",
        "from accelpact_slurm.runtime._internal import thing",
        "import accelpact_slurm._private",
        "def main(job, run):",
        "    guard = run._guard",
        "    job._rt.control.barrier()",
        "    getattr(run, '_snapshots')",
        "    os._exit(0)",
        "    dcp._storage_setup",
        "    self_ = super()._prepare()",
    ])
    hits = sorted(h.split(": ", 1)[1] for h in private_references(src))
    assert hits == sorted([
        "from accelpact_slurm.runtime import _hidden", "from accelpact_slurm.runtime._internal import ...",
        "import accelpact_slurm._private", "run._guard", "job._rt", "getattr(run, '_snapshots')"]), hits


def test_scripts_keeps_only_tools_a_user_or_developer_runs():
    """``scripts/`` holds the tools (the campaign, the envelope's trials, the GPU check, release venvs, the dev
    cluster); the benchmarks live in ``benchmarks/``."""
    assert {p.name for p in (REPO / "scripts").iterdir() if p.name != "__pycache__"} <= SCRIPTS_KEPT
