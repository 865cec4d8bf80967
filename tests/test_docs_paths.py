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
    parents: list[Path] = []  # the package of each indentation level: root, accelpact_slurm/, runtime/
    for line in block.splitlines():
        head = re.match(r"^( *)(\w+)/(?:\s|$)", line)
        if head:
            depth = len(head.group(1)) // 2
            parents = parents[:depth] if depth else []
            base = parents[-1] if parents else (root / "accelpact_slurm" if depth else root)
            pkg = base / head.group(2)
            parents.append(pkg)
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


# --------------------------------------------------------------------------- docs references in --help

_DOC_REF = re.compile(r"(?<![\w/.-])docs/([\w.-]+\.md)(?:#([\w-]+))?")
_DOC_SECTION = re.compile(r"docs/([\w.-]+\.md),\s+\"([^\"]+)\"")


def _console_scripts() -> dict[str, str]:
    """``{command: module}`` of setup.cfg's console scripts, with every other ``accelpact_slurm.cli`` module that
    has a parser (the worker and node entries the launchers run)."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "setup.cfg"))
    scripts = {}
    for line in cfg["options.entry_points"]["console_scripts"].strip().splitlines():
        name, target = (part.strip() for part in line.split("=", 1))
        scripts[name] = target.split(":", 1)[0]
    for path in sorted(glob.glob(os.path.join(REPO, "accelpact_slurm", "cli", "*.py"))):
        module = "accelpact_slurm.cli." + os.path.basename(path)[:-3]
        if module not in scripts.values() and "def build_parser(" in open(path, encoding="utf-8").read():
            scripts[module] = module
    return scripts


def _help_texts(parser) -> list[str]:
    """A parser's ``--help`` and every sub-command's, as printed (argparse wraps at spaces, never inside a path)."""
    import argparse

    texts = [parser.format_help()]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                texts += _help_texts(sub)
    return texts


def heading_anchors(markdown: str) -> dict[str, str]:
    """``{anchor: heading}`` as GitHub renders them: lower case, punctuation but ``-`` and ``_`` dropped, spaces
    to ``-``; a repeated anchor gets ``-1``, ``-2``.  Headings inside code fences are none."""
    anchors: dict[str, str] = {}
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        base, n = slug, 0
        while slug in anchors:
            n += 1
            slug = f"{base}-{n}"
        anchors[slug] = m.group(1).strip()
    return anchors


def test_heading_anchors_follow_githubs_rule():
    text = "# Launching a job\n## `--json` schema `accelpact-status/1`\n```\n# not a heading\n```\n## A\n## A\n"
    assert list(heading_anchors(text)) == ["launching-a-job", "--json-schema-accelpact-status1", "a", "a-1"]


def test_every_docs_reference_in_every_help_exists():
    """Every ``docs/<name>.md``, ``docs/<name>.md#anchor`` and ``docs/<name>.md, "Section"`` that a ``--help`` of a console
    script (setup.cfg) or of a launcher's entry prints names a file that exists and, with an anchor or a
    section, a heading of that file.

    Negative control: ``accelpact-run --help``'s old pointer (``docs/api.md, "Launching a job"``: api.md has no
    such section) fails it, as does any anchor of a heading renamed or removed.
    """
    import importlib

    seen, missing = 0, []
    for command, module in _console_scripts().items():
        for text in _help_texts(importlib.import_module(module).build_parser()):
            flat = " ".join(text.split())
            refs = [(f, a or None, None) for f, a in _DOC_REF.findall(flat)]
            refs += [(f, None, section) for f, section in _DOC_SECTION.findall(flat)]
            for name, anchor, section in refs:
                seen += 1
                shown = f"docs/{name}" + (f"#{anchor}" if anchor else "") + (f', "{section}"' if section else "")
                path = os.path.join(REPO, "docs", name)
                if not os.path.isfile(path):
                    missing.append(f"{command}: {shown}: no such file")
                    continue
                anchors = heading_anchors(open(path, encoding="utf-8").read())
                if (anchor and anchor not in anchors) or (section and section not in anchors.values()):
                    missing.append(f"{command}: {shown}: no such heading in docs/{name}")
    assert missing == []
    assert seen >= 8  # every command's help points somewhere: the scan found the references
