"""Text that names code stays true: docstring paths exist, and every event kind emitted is in EVENT_KINDS.  Pure."""

from __future__ import annotations

import ast
import glob
import os
import re

from accelpact_slurm.core.events import EVENT_KINDS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = sorted(p for pkg in ("accelpact_slurm", "ckpt_service", "tests")
                 for p in glob.glob(os.path.join(REPO, pkg, "**", "*.py"), recursive=True))
_PATH = re.compile(r"(?<![\w/.])((?:tests|accelpact_slurm|ckpt_service|scripts|examples)/[\w/]+\.py)")
_MODULE = re.compile(r"(?<![\w.])((?:accelpact_slurm|ckpt_service)(?:\.\w+)+)")
_EMIT = re.compile(r"\bevents\.emit\(\s*\"(\w+)\"")


def _docstrings(path: str) -> list[str]:
    tree = ast.parse(open(path, encoding="utf-8").read())
    nodes = (n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))
    return [d for d in (ast.get_docstring(n) for n in nodes) if d]


def _module_exists(dotted: str) -> bool:
    """A dotted name names a module or package when its longest prefix on disk has two parts or more
    (``accelpact_slurm.slurm.env.emulated_environ``: the module ``accelpact_slurm/slurm/env.py``, then a name)."""
    parts = dotted.split(".")
    for i in range(len(parts), 1, -1):
        base = os.path.join(REPO, *parts[:i])
        if os.path.exists(base + ".py") or os.path.isdir(base):
            return True
    return False


def test_paths_and_modules_named_in_docstrings_exist():
    missing = []
    for path in SOURCES:
        rel = os.path.relpath(path, REPO)
        for doc in _docstrings(path):
            missing += [f"{rel}: {p}" for p in _PATH.findall(doc) if not os.path.exists(os.path.join(REPO, p))]
            missing += [f"{rel}: {m}" for m in _MODULE.findall(doc) if not _module_exists(m)]
    assert missing == []


def test_every_emitted_event_kind_is_in_event_kinds():
    emitted: dict[str, str] = {}
    for path in SOURCES:
        if f"{os.sep}tests{os.sep}" in path:
            continue
        for kind in _EMIT.findall(open(path, encoding="utf-8").read()):
            emitted.setdefault(kind, os.path.relpath(path, REPO))
    assert {"step", "repair", "checkpoint_copy", "repair_rank"} <= set(emitted)  # the scan finds them
    assert {k: p for k, p in emitted.items() if k not in EVENT_KINDS} == {}


def test_the_readmes_layout_names_modules_that_exist():
    """The README's layout block: every package it lists exists, and every module it names in parentheses
    (``(buffers)``, ``(qualify)``) is a module of the package on that line's entry."""
    import re

    from pathlib import Path

    root = Path(REPO)
    block = (root / "README.md").read_text().split("## Layout", 1)[1].split("```", 2)[1]
    pkg, seen = None, 0
    for line in block.splitlines():
        head = re.match(r"^  (\w+)/\s", line) or re.match(r"^(\w+)/\s", line)
        if head:
            pkg = (root / "accelpact_slurm" / head.group(1)) if line.startswith("  ") else root / head.group(1)
            assert pkg.is_dir(), f"README layout lists {pkg.relative_to(root)}, which is not in the tree"
        for name in re.findall(r"\((\w+)(?::[^)]*)?\)", line):
            if pkg is not None and pkg.name != "data" and not name.isupper():
                assert (pkg / f"{name}.py").exists() or (pkg / name).is_dir(), \
                    f"README layout names {name} under {pkg.relative_to(root)}, which has no such module"
                seen += 1
    assert seen >= 8  # the check ran over the block


_TEST_ID = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def test_every_test_the_launch_matrix_names_exists():
    """``docs/launch.md``'s table of each way a job ends on each launcher names real tests."""
    text = open(os.path.join(REPO, "docs", "launch.md"), encoding="utf-8").read()
    named = _TEST_ID.findall(text)
    assert len(named) >= 20, named
    missing = []
    for path, name in named:
        full = os.path.join(REPO, path)
        if not os.path.exists(full) or not re.search(rf"^def {name}\(", open(full, encoding="utf-8").read(), re.M):
            missing.append(f"{path}::{name}")
    assert missing == [], missing
