"""Text that names code stays true: docstring paths exist, and every event kind emitted is in EVENT_KINDS.  Pure."""

from __future__ import annotations

import ast
import glob
import os
import re
import shutil
from pathlib import Path

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


def readme_layout(root: Path) -> list[str]:
    """The paths README's layout block names, one entry a line (``runtime/`` then ``  job/`` then ``    api.py``:
    two spaces a level); continuation lines, indented past the names, name nothing."""
    block = (root / "README.md").read_text().split("## Layout", 1)[1].split("```", 2)[1]
    entries, stack = [], []
    for line in block.splitlines():
        m = re.match(r"^((?:  ){0,3})([\w.-]+/?)(?:\s|$)", line)
        if not m:
            continue
        depth = len(m.group(1)) // 2
        stack = stack[:depth] + [m.group(2).rstrip("/")]
        entries.append("/".join(stack) + ("/" if m.group(2).endswith("/") else ""))
    return entries


def layout_misses(root: Path) -> tuple[list[str], list[str]]:
    """``(named but absent, present but not named)``: every package and module of ``accelpact_slurm`` and
    ``ckpt_service`` (a package's own ``__init__.py`` is named by its package, the top one's public names aside)."""
    named = readme_layout(root)
    absent = [e for e in named if not (root / e).exists()]
    present = []
    for pkg in ("accelpact_slurm", "ckpt_service"):
        for p in sorted((root / pkg).rglob("*.py")):
            rel = p.relative_to(root)
            own = p.name == "__init__.py" and str(rel) != "accelpact_slurm/__init__.py"
            present.append(f"{rel.parent}/" if own else str(rel))
    return absent, [e for e in present if e not in named]


def test_the_readmes_layout_names_every_module_and_nothing_else():
    """README's layout names each package and module of both packages with one line, so it stays the map a newcomer
    reads (where the detector, the store, the guard, the writer and the capture live)."""
    root = Path(REPO)
    assert layout_misses(root) == ([], [])
    named = readme_layout(root)
    for where in ("accelpact_slurm/runtime/detection/collectives.py", "accelpact_slurm/runtime/transport/store.py",
                  "accelpact_slurm/runtime/job/guard.py", "ckpt_service/dcp_write.py", "ckpt_service/capture.py",
                  "scripts/", "benchmarks/", "tests/"):
        assert where in named


def test_negative_control_a_module_missing_from_the_layout_is_found(tmp_path):
    for pkg in ("accelpact_slurm", "ckpt_service"):
        shutil.copytree(os.path.join(REPO, pkg), tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(REPO, "README.md"), tmp_path / "README.md")
    for other in ("examples", "sbatch_templates", "scripts", "benchmarks", "tests"):
        (tmp_path / other).mkdir()
    (tmp_path / "ckpt_service" / "stage_copy.py").write_text('"""A new module."""\n')
    (tmp_path / "accelpact_slurm" / "runtime" / "state" / "sampler.py").unlink()
    assert layout_misses(tmp_path) == (["accelpact_slurm/runtime/state/sampler.py"], ["ckpt_service/stage_copy.py"])


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
