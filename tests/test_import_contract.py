"""The import contract: which of runtime's packages may import which, and no import cycle anywhere.

``runtime/`` is cut by concern into four packages (README's layout): the job API and the guard (``job``), the
job's store and the control plane (``transport``), fault detection (``detection``) and the training state
(``state``).  :data:`RUNTIME_ALLOWED` is the direction between them, written down once; README's layering
paragraph states the same sentence (checked here).  Every import counts, the ones inside a function too (a
function-local import closes a cycle as surely as one at the top, it only defers it); an import under
``if TYPE_CHECKING:`` does not (it never runs).

A cycle among the modules of ``accelpact_slurm`` or of ``ckpt_service`` fails the test with its chain of imports
(file and line of each), so the report says which import to move.  Each check is also run on a copy of the tree
with a back-import planted, and must fail there.
"""

from __future__ import annotations

import ast
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_layers import PACKAGES, ImportGraph

RUNTIME = "accelpact_slurm.runtime"

#: What each package of ``runtime`` may import of the others.  A module of ``runtime`` outside these packages, or
#: a package not named here, fails :func:`test_every_runtime_module_sits_in_a_named_package`.
RUNTIME_ALLOWED: dict[str, set[str]] = {
    "job": {"transport", "detection", "state"},
    "transport": {"detection"},
    "detection": set(),
    "state": set(),
}


def import_edges(root: str) -> dict[str, dict[str, int]]:
    """``{module: {imported module of the two packages: line}}`` for every module under ``root``: the modules an
    import statement names (``from a import b`` names ``a`` and, when it is a module, ``a.b``), wherever the
    statement sits, except under ``if TYPE_CHECKING:``."""
    graph = ImportGraph(root)
    edges: dict[str, dict[str, int]] = {}
    for mod, tree in graph.trees.items():
        typing_only = {id(n) for branch in ast.walk(tree) if isinstance(branch, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(branch.test) for n in ast.walk(branch)}
        out: dict[str, int] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in typing_only:
                for target in graph.targets(mod, node):
                    if target in graph.files and target != mod:
                        out.setdefault(target, node.lineno)
        edges[mod] = out
    return edges


def _rel(root: str, mod: str) -> str:
    parts = mod.split(".")
    path = Path(root, *parts).with_suffix(".py")
    return str((path if path.exists() else Path(root, *parts, "__init__.py")).relative_to(root))


def import_cycles(root: str) -> list[str]:
    """One cycle of each strongly connected group of modules, as ``a -> b (a.py:3) -> a (b.py:9)``; empty when
    the imports of both packages form no cycle."""
    edges = import_edges(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(edges):
        if v not in index:
            connect(v)
    cycles = []
    for group in groups:
        start = min(group)
        paths = {start: [start]}
        frontier = [start]
        cycle = None
        while frontier and cycle is None:  # the shortest way from start back to it, inside the group
            nxt = []
            for v in frontier:
                for w in sorted(edges[v]):
                    if w == start:
                        cycle = paths[v] + [start]
                        break
                    if w in group and w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                if cycle:
                    break
            frontier = nxt
        assert cycle is not None
        cycles.append(cycle[0] + "".join(f" -> {b} ({_rel(root, a)}:{edges[a][b]})" for a, b in zip(cycle, cycle[1:])))
    return sorted(cycles)


def _runtime_package(mod: str) -> str | None:
    """``accelpact_slurm.runtime.job.guard`` -> ``job``; None outside runtime's packages."""
    parts = mod.split(".")
    return parts[2] if mod.startswith(RUNTIME + ".") and len(parts) > 3 else None


def runtime_breaches(root: str) -> list[str]:
    """Every import between two packages of ``runtime`` that :data:`RUNTIME_ALLOWED` does not allow."""
    bad = []
    for mod, targets in import_edges(root).items():
        src = _runtime_package(mod)
        for target, line in targets.items():
            dst = _runtime_package(target)
            if src and dst and dst != src and dst not in RUNTIME_ALLOWED.get(src, set()):
                bad.append(f"{src} -> {dst}: {_rel(root, mod)}:{line} imports {target}")
    return sorted(bad)


def allowed_sentence() -> str:
    """README's statement of :data:`RUNTIME_ALLOWED`, built from it."""
    clauses = []
    for pkg, allowed in RUNTIME_ALLOWED.items():
        if allowed:
            clauses.append(f"`runtime.{pkg}` may import " + ", ".join(f"`runtime.{a}`" for a in sorted(allowed)))
    none = [f"`runtime.{p}`" for p, a in RUNTIME_ALLOWED.items() if not a]
    return "; ".join(clauses) + "; " + " and ".join(none) + " import none of the others"


@pytest.fixture
def tree(tmp_path):
    for pkg in PACKAGES:
        shutil.copytree(os.path.join(REPO, pkg), tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _plant(path: Path, statement: str) -> int:
    """Append a function holding ``statement`` to ``path``; returns the statement's line."""
    text = path.read_text()
    path.write_text(text + f"\n\ndef _planted():  # deliberate back-import (tests/test_import_contract.py)\n"
                           f"    {statement}\n")
    return len(text.splitlines()) + 4  # after the blank lines and the def (the text ends in a newline)


# --------------------------------------------------------------------------- the real tree


def test_no_import_cycle_in_either_package():
    assert import_cycles(REPO) == []


def test_runtime_packages_import_only_downwards():
    assert runtime_breaches(REPO) == []


def runtime_misfits(root: str) -> list[str]:
    """Modules flat in ``runtime/`` and packages of it the contract does not name (or names but lacks)."""
    base = Path(root, *RUNTIME.split("."))
    flat = [f"flat module {p.name}" for p in sorted(base.glob("*.py")) if p.name != "__init__.py"]
    packages = {p.name for p in base.iterdir() if (p / "__init__.py").exists()}
    return flat + [f"package {p} not in RUNTIME_ALLOWED" for p in sorted(packages - set(RUNTIME_ALLOWED))] + \
        [f"RUNTIME_ALLOWED names {p}, which is not a package" for p in sorted(set(RUNTIME_ALLOWED) - packages)]


def test_every_runtime_module_sits_in_a_named_package():
    """No module lands flat in ``runtime/`` again, and no package of it escapes the contract."""
    assert runtime_misfits(REPO) == []


def test_readme_states_the_same_direction():
    text = " ".join(Path(REPO, "README.md").read_text().split())
    assert allowed_sentence() in text, allowed_sentence()


def test_the_scan_sees_function_local_imports_and_skips_type_checking_ones():
    """Positive controls of the scan on the real tree: run_rank's function-local import of the API is an edge;
    the detector wiring's ``TYPE_CHECKING`` import of the runtime class is not."""
    edges = import_edges(REPO)
    assert f"{RUNTIME}.job.api" in edges[f"{RUNTIME}.job.entry"]
    assert f"{RUNTIME}.job.topology" not in edges[f"{RUNTIME}.detection.wiring"]
    assert f"{RUNTIME}.detection.liveness" in edges[f"{RUNTIME}.detection.collectives"]


# --------------------------------------------------------------------------- negative controls


def test_negative_control_a_back_import_inside_runtime_is_found(tree):
    """Negative control: the detector's liveness module imports the job API (inside a function, as a cycle's
    workaround would): both the direction and the cycle check name it."""
    line = _plant(tree / "accelpact_slurm/runtime/detection/liveness.py",
                  "from accelpact_slurm.runtime.job import api")
    assert runtime_breaches(str(tree)) == [
        f"detection -> job: accelpact_slurm/runtime/detection/liveness.py:{line} imports {RUNTIME}.job.api"]
    cycles = import_cycles(str(tree))
    assert len(cycles) == 1 and f"-> {RUNTIME}.job.api (accelpact_slurm/runtime/detection/liveness.py:{line})" \
        in cycles[0], cycles


def test_negative_control_a_cycle_in_ckpt_service_is_found(tree):
    """Negative control: an import of ckpt_service turned back on itself (the importer imported by the module it
    imports, inside a function) is a cycle.  The pair is taken from the tree as it is, so the control does not
    depend on which modules ckpt_service has."""
    edges = import_edges(REPO)
    a, b = min((m, t) for m, ts in edges.items() if m.startswith("ckpt_service.") for t in ts
               if t.startswith("ckpt_service.") and t != "ckpt_service")
    line = _plant(tree / _rel(REPO, b), f"import {a}")
    cycles = import_cycles(str(tree))
    assert len(cycles) == 1, cycles
    assert f"-> {a} ({_rel(REPO, b)}:{line})" in cycles[0] and f"-> {b} ({_rel(REPO, a)}:{edges[a][b]})" in cycles[0]


def test_negative_control_a_type_checking_back_import_is_no_cycle(tree):
    """The exemption holds: the same back-import under ``if TYPE_CHECKING:`` runs never, so it closes no cycle."""
    path = tree / "accelpact_slurm/runtime/detection/liveness.py"
    path.write_text(path.read_text() + "\n\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                    "    from accelpact_slurm.runtime.job import api\n")
    assert runtime_breaches(str(tree)) == []
    assert import_cycles(str(tree)) == []


def test_negative_control_a_flat_runtime_module_is_found(tree):
    (tree / "accelpact_slurm/runtime/stray.py").write_text('"""A module outside runtime\'s packages."""\n')
    (tree / "accelpact_slurm/runtime/extra").mkdir()
    (tree / "accelpact_slurm/runtime/extra/__init__.py").write_text("")
    assert runtime_misfits(str(tree)) == ["flat module stray.py", "package extra not in RUNTIME_ALLOWED"]
