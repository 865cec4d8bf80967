"""The import layering in setup.cfg ([importlinter]) holds, and the linter does catch a break.

(a) runs import-linter on the real tree; (b) breaks each contract on purpose in a copy of the
packages and checks that the linter names the broken contract and the offending import, so a
contract that silently matches nothing (a typo in a module name, a layer that cannot fail)
shows up here rather than in review.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

PACKAGES = ("accelpact_slurm", "ckpt_service")

# import-linter's own console entry point, run by this interpreter (the venv's), whatever bin
# directory the `lint-imports` script was installed into.
_LINT = ("import sys; from importlinter.cli import lint_imports_command; "
         "sys.exit(lint_imports_command())")


def lint(root: str, *contracts: str) -> subprocess.CompletedProcess:
    """Run lint-imports on the packages under ``root`` with ``root``/setup.cfg."""
    env = dict(os.environ)
    env["PYTHONPATH"] = root  # the packages under root, not the editable install
    env.update(COLUMNS="250", NO_COLOR="1")  # no wrapped or coloured report lines to match against
    args = [sys.executable, "-c", _LINT, "--no-cache", "--no-logo", os.path.join(root, "setup.cfg")]
    for c in contracts:
        args += ["--contract", c]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=root, env=env)


def contract_names() -> dict[str, str]:
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "setup.cfg"))
    prefix = "importlinter:contract:"
    return {s[len(prefix):]: cfg[s]["name"] for s in cfg.sections() if s.startswith(prefix)}


def test_contracts_are_declared():
    names = contract_names()
    assert set(names) >= {"layers", "ckpt-service-core-only", "torch-free"}, names
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "setup.cfg"))
    assert cfg["importlinter"]["include_external_packages"].strip() == "True"
    assert cfg["importlinter"]["root_packages"].split() == list(PACKAGES)


def test_real_tree_keeps_every_contract():
    proc = lint(REPO)
    assert proc.returncode == 0, "import-linter reports broken contracts:\n" + proc.stdout + proc.stderr
    for name in contract_names().values():
        assert f"{name} KEPT" in proc.stdout, proc.stdout


@pytest.fixture
def copy_tree(tmp_path):
    for pkg in PACKAGES:
        shutil.copytree(os.path.join(REPO, pkg), tmp_path / pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(os.path.join(REPO, "setup.cfg"), tmp_path / "setup.cfg")
    return tmp_path


# (file in the copy, line appended, contract that must break, the import it must name)
BREAKS = [
    ("ckpt_service/layout.py", "import accelpact_slurm.runtime.guard",
     "ckpt-service-core-only", "ckpt_service.layout -> accelpact_slurm.runtime.guard"),
    ("accelpact_slurm/core/events.py", "import torch",
     "torch-free", "accelpact_slurm.core.events -> torch"),
    ("accelpact_slurm/runtime/envelope.py", "from accelpact_slurm.cli import run",
     "layers", "accelpact_slurm.runtime.envelope -> accelpact_slurm.cli.run"),
]


@pytest.mark.parametrize("path,line,contract,chain", BREAKS, ids=[b[2] for b in BREAKS])
def test_linter_catches_a_forbidden_import(copy_tree, path, line, contract, chain):
    target = copy_tree / path
    with open(target, "a") as f:
        f.write(f"\n{line}  # deliberate layering break (tests/test_layers.py)\n")
    name = contract_names()[contract]

    proc = lint(str(copy_tree), contract)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert f"{name} BROKEN" in out, out
    # The linter points at the line we added (so it read the copy, not the installed tree).
    assert chain in out, out
    # Only the contract asked for was checked.
    for other_id, other in contract_names().items():
        if other_id != contract:
            assert other not in out.replace(name, ""), out


# --------------------------------------------------------------------------- no library module imports an example


def example_modules(repo: str = REPO) -> set[str]:
    """Every module name an example defines (examples are not packages: they run from their own directory)."""
    out = set()
    for d, _dirs, files in os.walk(os.path.join(repo, "examples")):
        out |= {f[:-3] for f in files if f.endswith(".py")}
    return out


def library_imports_of_examples(root: str, names: set[str]) -> list[str]:
    """``file: module`` for every import of an example module in the library packages under ``root`` (AST walk)."""
    import ast

    found = []
    for pkg in PACKAGES:
        for d, _dirs, files in os.walk(os.path.join(root, pkg)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(d, f)
                tree = ast.parse(open(path, encoding="utf-8").read(), path)
                for node in ast.walk(tree):
                    mods = []
                    if isinstance(node, ast.Import):
                        mods = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                        mods = [node.module]
                    for m in mods:
                        if m.split(".")[0] in names or m.startswith("examples"):
                            found.append(f"{os.path.relpath(path, root)}: {m}")
    return found


def test_no_library_module_imports_an_example():
    names = example_modules()
    assert {"decoder_model", "train_decoder", "vision_model", "train_vision"} <= names
    assert library_imports_of_examples(REPO, names) == []


def test_negative_control_an_added_example_import_is_found(tmp_path):
    for pkg in PACKAGES:
        shutil.copytree(os.path.join(REPO, pkg), tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "ckpt_service" / "writer.py", "a", encoding="utf-8") as fh:
        fh.write("\nfrom decoder_model import build_model  # noqa\n")
    assert library_imports_of_examples(str(tmp_path), example_modules()) == ["ckpt_service/writer.py: decoder_model"]
