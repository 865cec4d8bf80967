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
    ("ckpt_service/layout.py", "import accelpact_slurm.runtime.job.guard",
     "ckpt-service-core-only", "ckpt_service.layout -> accelpact_slurm.runtime.job.guard"),
    ("accelpact_slurm/core/events.py", "import torch",
     "torch-free", "accelpact_slurm.core.events -> torch"),
    ("accelpact_slurm/runtime/job/envelope.py", "from accelpact_slurm.cli import run",
     "layers", "accelpact_slurm.runtime.job.envelope -> accelpact_slurm.cli.run"),
    ("ckpt_service/sink.py", "import ckpt_service.dcp_write",
     "ckpt-writer", "ckpt_service.sink -> ckpt_service.dcp_write"),
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
    with open(tmp_path / "ckpt_service" / "dcp_write.py", "a", encoding="utf-8") as fh:
        fh.write("\nfrom decoder_model import build_model  # noqa\n")
    assert library_imports_of_examples(str(tmp_path), example_modules()) == ["ckpt_service/dcp_write.py: decoder_model"]


# --------------------------------------------------------------------------- what each part reads from a rank

# (file, the protocol through which it sees the rank): every rt.X / self.rt.X it reads must be a member.
RANK_READERS = [
    ("ckpt_service/client.py", "RankContext"),
    ("accelpact_slurm/runtime/state/restore.py", "RankContext"),
    ("accelpact_slurm/runtime/state/saving.py", "RankContext"),
    ("accelpact_slurm/runtime/job/guard.py", "GuardRank"),
    ("accelpact_slurm/runtime/job/recovery.py", "RecoveryRank"),
    ("accelpact_slurm/repair/engine.py", "RepairRank"),
]
_RANK_NAMES = {"rt"}  # a local name for the rank; self.rt and self._rt are the rank held by an object
_HELD = {"rt", "_rt"}


def _chain(node) -> list[str] | None:
    """``self.rt.ctx.hostname`` -> ``["ctx", "hostname"]`` (the attributes read of the rank); None when the
    expression does not start at the rank."""
    import ast

    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    attrs.reverse()
    if isinstance(node, ast.Name) and node.id in _RANK_NAMES:
        return attrs
    if isinstance(node, ast.Name) and node.id == "self" and attrs and attrs[0] in _HELD:
        return attrs[1:]
    return None


def rank_uses(source: str, path: str = "<source>") -> tuple[set[tuple[str, ...]], set[tuple[str, ...]]]:
    """``(reads, writes)``: every attribute path of the rank a module reads (``rt.layout.num_nodes``,
    ``getattr(self.rt, "device", None)``) and every one it assigns to (``rt.replicate_group = ...``)."""
    import ast

    tree = ast.parse(source, path)
    reads: set[tuple[str, ...]] = set()
    writes: set[tuple[str, ...]] = set()
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # only whole chains count
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _chain(node)
            if chain:
                (writes if isinstance(node.ctx, (ast.Store, ast.Del)) else reads).add(tuple(chain))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            chain = _chain(node.args[0])
            if chain is not None:
                (writes if node.func.id == "setattr" else reads).add((*chain, node.args[1].value))
    # a chain read only as the value of a longer one (rt.ctx of rt.ctx.hostname) is in the longer one already
    return reads, writes


def _nested(proto: type, name: str) -> type | None:
    """The protocol a member of ``proto`` is typed with (``RankContext.ctx`` -> ``JobIdentity``), if any."""
    import typing

    member = getattr(proto, name)
    fn = member.fget if isinstance(member, property) else None
    if fn is None:
        return None
    hint = typing.get_type_hints(fn).get("return")
    for t in (hint, *typing.get_args(hint)):
        if isinstance(t, type) and getattr(t, "_is_protocol", False):
            return t
    return None


def outside_protocol(reads: set[tuple[str, ...]], proto: type) -> list[str]:
    """The paths of ``reads`` that ``proto`` (and the protocols of its members) do not declare."""
    from accelpact_slurm.core.rank import protocol_members

    bad = []
    for path in sorted(reads):
        current: type | None = proto
        for i, name in enumerate(path):
            if current is None:
                break  # typed Any here: what is read of it is not the rank's business
            if name not in protocol_members(current):
                bad.append(".".join(path[:i + 1]))
                break
            current = _nested(current, name)
    return bad


def _source(rel: str, root: str = REPO) -> str:
    with open(os.path.join(root, rel), encoding="utf-8") as fh:
        return fh.read()


@pytest.mark.parametrize("path,proto", RANK_READERS, ids=[p for p, _ in RANK_READERS])
def test_each_part_reads_only_its_protocol_of_the_rank(path, proto):
    from accelpact_slurm.core import rank

    reads, writes = rank_uses(_source(path), path)
    assert reads, f"{path}: no read of the rank found (the scan lost track of it)"
    assert outside_protocol(reads, getattr(rank, proto)) == [], f"{path} reads the rank outside {proto}"
    assert writes == set(), f"{path} assigns to the rank: {sorted(writes)}"


def test_the_checkpoint_client_reads_what_it_needs_of_the_rank():
    """Positive control of the scan: the client's known reads are all found, nested ones included."""
    reads, _ = rank_uses(_source("ckpt_service/client.py"))
    assert {("ctx", "hostname"), ("ctx", "job_id"), ("ctx", "restart_count"), ("ctx", "nodelist"), ("local_rank",),
            ("rank",), ("node",), ("layout", "world_size"), ("layout", "shard_ranks"),
            ("control", "all_gather")} <= reads, sorted(reads)


@pytest.mark.parametrize("line,found", [
    ("self.rt.hardware", "hardware"),  # a member of the runtime, not of the client's protocol
    ("rt.ctx.step_id", "ctx.step_id"),
    ("getattr(self.rt.layout, 'mesh', None)", "layout.mesh"),
    ("self.rt.control.set_generation(0)", "control.set_generation"),
])
def test_negative_control_a_read_outside_the_protocol_is_found(line, found):
    from accelpact_slurm.core.rank import RankContext

    text = _source("ckpt_service/client.py") + f"\n\ndef _added(self, rt):\n    return {line}\n"
    assert outside_protocol(rank_uses(text)[0], RankContext) == [found]


def test_negative_control_an_assignment_to_the_rank_is_found():
    text = _source("accelpact_slurm/repair/engine.py") + (
        "\n\ndef _added(self, new):\n    self.rt.replicate_group = new\n    rt = self.rt\n"
        "    rt.shard_group, rt.mesh = new, new\n")
    assert rank_uses(text)[1] == {("replicate_group",), ("shard_group",), ("mesh",)}


def test_the_runtime_class_has_every_member_of_each_protocol():
    """Checked on the classes (a built runtime: the next test): the runtime, its layout, its control plane, its
    fault detector and its Slurm context each declare what the protocols name."""
    from accelpact_slurm.core import rank
    from accelpact_slurm.runtime.detection.collectives import Detector
    from accelpact_slurm.runtime.transport.control import ControlPlane
    from accelpact_slurm.runtime.job.topology import Layout, Runtime
    from accelpact_slurm.slurm.env import SlurmContext

    def declared(cls) -> set[str]:
        return set(getattr(cls, "__dataclass_fields__", {})) | set(dir(cls))

    for proto, cls in [(rank.RankContext, Runtime), (rank.RepairRank, Runtime), (rank.GuardRank, Runtime),
                       (rank.RecoveryRank, Runtime), (rank.RankLayout, Layout), (rank.JobIdentity, SlurmContext),
                       (rank.RepairControl, ControlPlane), (rank.ControlRounds, ControlPlane),
                       (rank.GroupDetector, Detector)]:
        missing = rank.protocol_members(proto) - declared(cls)
        assert not missing, f"{cls.__name__} lacks {sorted(missing)} of {proto.__name__}"
    # and the protocols say something: the members each consumer reads
    assert rank.protocol_members(rank.RankContext) == {"rank", "local_rank", "node", "layout", "ctx", "control"}
    assert {"replicate_group", "mesh", "detector", "collective_timeout_s"} <= rank.protocol_members(rank.RepairRank)


BUILT_RUNTIME = '''
import json, os, sys
from accelpact_slurm.core import rank
from accelpact_slurm.core.config import load_config
from accelpact_slurm.runtime.job.topology import init_runtime
from accelpact_slurm.slurm.env import SlurmContext

ctx = SlurmContext(job_id="4242", rank=0, local_rank=0, node_index=0, num_nodes=1, world_size=1,
                   tasks_per_node=(1,), nodelist=("localhost",), hostname="localhost")
rt = init_runtime(ctx, load_config(sys.argv[1]), {"ACCELPACT_EMULATED": "1", "PATH": os.environ["PATH"]},
                  key=os.urandom(32))
checks = {name: isinstance(rt, getattr(rank, name)) for name in ("RankContext", "RepairRank", "GuardRank",
                                                                   "RecoveryRank")}
checks.update(layout=isinstance(rt.layout, rank.RankLayout), ctx=isinstance(rt.ctx, rank.JobIdentity),
              control=isinstance(rt.control, rank.RepairControl), detector=isinstance(rt.detector, rank.GroupDetector))
print(json.dumps(checks), flush=True)
os._exit(0)  # Gloo's and the detector's teardown stay out of the check
'''


@pytest.mark.slow
def test_a_built_runtime_satisfies_each_protocol():
    """A real runtime, built by init_runtime on a world of one (Gloo, the job's store, the detector)."""
    import json

    from accelpact_slurm.core import settings
    from tests.conftest import DECODER_JOB

    assert settings.EMULATED == "ACCELPACT_EMULATED"
    proc = subprocess.run([sys.executable, "-c", BUILT_RUNTIME, DECODER_JOB], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={"PYTHONPATH": REPO, "PATH": os.environ.get("PATH", "")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert checks == dict.fromkeys(checks, True) and len(checks) == 8, checks


#: Where an object is built: the one place a test's switch may pick a collaborator (a broken one, for a negative
#: control) instead of a branch where the work runs.
BUILDERS = {"__init__", "forward_state", "build_guard", "run_rank", "_run_rank", "train", "init_runtime", "main", "from_environ",
            "heal_parts"}


def _fault_branches(path) -> list[str]:
    """``function:line`` of every ``if`` / conditional expression outside a builder whose test reads a
    :class:`TestFaults` switch (``faults.X``, ``self.faults.X``, ``job._faults.X``, ``self.o.faults.X``)."""
    import ast
    import dataclasses

    from accelpact_slurm.core.faults import TestFaults

    fields = {f.name for f in dataclasses.fields(TestFaults)}
    tree = ast.parse(path.read_text())
    out = []

    def reads_switch(node: ast.AST) -> bool:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and sub.attr in fields:
                base = sub.value
                name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                if name.endswith("faults"):
                    return True
        return False

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, (ast.If, ast.IfExp, ast.While)) and name not in BUILDERS and reads_switch(child.test):
                out.append(f"{name}:{child.lineno}")
            visit(child, name)

    visit(tree, "<module>")
    return out


def test_test_faults_are_collaborators_not_branches_in_the_methods_that_do_the_work():
    """A switch that breaks a step is a method of TestFaults (or of ckpt_service.faults), called where the fault
    belongs; one that turns a guarantee off picks a collaborator where the object is built.  No production
    method branches on a switch.  Negative control: such a branch, planted, is found."""
    from pathlib import Path

    repo = Path(REPO)
    roots = [repo / "accelpact_slurm", repo / "ckpt_service"]
    allowed = {repo / "accelpact_slurm" / "core" / "faults.py", repo / "ckpt_service" / "faults.py"}
    found = {str(p.relative_to(repo)): hits for root in roots for p in sorted(root.rglob("*.py"))
             if p not in allowed and (hits := _fault_branches(p))}
    assert found == {}, found


def test_negative_control_a_planted_fault_branch_is_found(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("class C:\n    def step(self, s):\n        if self.faults.crash_at == (s, 0):\n"
                       "            pass\n    def __init__(self, job):\n"
                       "        self.f = 1 if job._faults.skip_discard else 2\n")
    assert _fault_branches(planted) == ["step:3"]


def test_the_standard_library_is_imported_at_the_top_of_a_module():
    """A module's stdlib imports are at its top, where its readers see what it depends on; what stays inside a
    function is the project's own modules (an import cycle, or a login-node path kept free of torch) and heavy
    optional packages (torch, submitit, matplotlib)."""
    import ast
    from pathlib import Path

    stdlib = set(sys.stdlib_module_names)
    inside = []
    for root in ("accelpact_slurm", "ckpt_service"):
        for p in sorted((Path(REPO) / root).rglob("*.py")):
            for f in ast.walk(ast.parse(p.read_text())):
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for n in ast.walk(f):
                        if isinstance(n, (ast.Import, ast.ImportFrom)) and not getattr(n, "level", 0):
                            mod = n.module if isinstance(n, ast.ImportFrom) else n.names[0].name
                            if (mod or "").split(".")[0] in stdlib:
                                inside.append(f"{p.relative_to(REPO)}:{n.lineno} {ast.unparse(n)}")
    assert inside == [], inside


# --------------------------------------------------------------------------- imports inside functions

HEAVY = ("torch", "submitit", "matplotlib", "numpy")


class ImportGraph:
    """The modules of the two packages under ``root`` and what each imports at its top (not under
    ``TYPE_CHECKING``, not inside a function): enough to tell why an import was left inside a function."""

    def __init__(self, root: str) -> None:
        import ast
        from pathlib import Path

        self.ast = ast
        self.files: dict[str, Path] = {}
        for pkg in PACKAGES:
            for p in sorted((Path(root) / pkg).rglob("*.py")):
                parts = list(p.relative_to(root).with_suffix("").parts)
                self.files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
        self.trees = {m: ast.parse(p.read_text(), str(p)) for m, p in self.files.items()}
        self.top = {m: self._top(m) for m in self.files}

    def targets(self, mod: str, node) -> list[str]:
        """The modules an import statement loads: ``from a.b import c`` -> ``a.b`` and ``a.b.c`` if a module."""
        if isinstance(node, self.ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:
            pkg = mod.split(".") if self.files[mod].name == "__init__.py" else mod.split(".")[:-1]
            pkg = pkg[:len(pkg) - node.level + 1]
            base = ".".join(pkg + ([node.module] if node.module else []))
        return [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in self.files]

    def _top(self, mod: str) -> set[str]:
        ast, out = self.ast, set()

        def visit(body):
            for n in body:
                if isinstance(n, (ast.Import, ast.ImportFrom)):
                    for t in self.targets(mod, n):
                        parts = t.split(".")
                        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
                elif isinstance(n, ast.If) and "TYPE_CHECKING" not in ast.unparse(n.test):
                    visit(n.body)
                    visit(n.orelse)
                elif isinstance(n, ast.Try):
                    for b in (n.body, *[h.body for h in n.handlers], n.orelse, n.finalbody):
                        visit(b)

        visit(self.trees[mod].body)
        return out

    def closure(self, mod: str) -> set[str]:
        """Every module importing ``mod`` loads (its parent packages' included)."""
        parts = mod.split(".")
        seen: set[str] = set()
        stack = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        while stack:
            m = stack.pop()
            if m not in seen:
                seen.add(m)
                stack.extend(self.top.get(m, ()))
        return seen

    def heavy(self, mod: str) -> set[str]:
        return {m.split(".")[0] for m in self.closure(mod)} & set(HEAVY)

    def inside_functions(self):
        """``(module, line, statement, reason or None)`` for every import inside a function."""
        ast = self.ast
        for mod, tree in self.trees.items():
            in_try = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for n in ast.walk(t)}
            seen = set()
            for f in ast.walk(tree):
                if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for n in ast.walk(f):
                    if not isinstance(n, (ast.Import, ast.ImportFrom)) or id(n) in seen:
                        continue
                    seen.add(id(n))
                    yield mod, n.lineno, ast.unparse(n), self.reason(mod, n, id(n) in in_try)

    def reason(self, mod: str, node, in_try: bool) -> str | None:
        """Why this import is inside a function, or None when it could be at the module's top."""
        if in_try:
            return "a fallback: the name moved between releases"
        target = self.targets(mod, node)[-1]
        top = target.split(".")[0]
        added = (({top} if top in HEAVY else self.heavy(target)) - self.heavy(mod))
        if added:
            return f"keeps {', '.join(sorted(added))} out of importing {mod}"
        if top == "torch" and any(p.startswith("_") for p in target.split(".")):
            return "a private torch module: a release that moved it fails this path only"
        if top in PACKAGES and mod in self.closure(target):
            return f"an import cycle: {target} imports {mod}"
        return None


def test_every_import_inside_a_function_has_a_reason():
    """An import sits at the module's top, where its readers see what the module depends on, unless the scan
    finds why it cannot: it keeps a heavy package (torch, submitit, matplotlib, numpy) out of a module that does
    not load it (the login-node tools), it is a private torch module, a fallback, or it closes an import cycle."""
    unexplained = [f"{m}:{line} {s}" for m, line, s, why in ImportGraph(REPO).inside_functions() if why is None]
    assert unexplained == [], "move these to the module's top:\n" + "\n".join(unexplained)


def test_negative_control_a_needless_import_inside_a_function_is_found(tmp_path):
    for pkg in PACKAGES:
        shutil.copytree(os.path.join(REPO, pkg), tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    planted = tmp_path / "accelpact_slurm" / "ops" / "status.py"
    planted.write_text(planted.read_text() + "\n\ndef _planted():\n    from accelpact_slurm.core import errors\n"
                       "    import torch\n    return errors, torch\n")
    graph = ImportGraph(str(tmp_path))
    found = {(m, s): why for m, _, s, why in graph.inside_functions() if m == "accelpact_slurm.ops.status"}
    assert found[("accelpact_slurm.ops.status", "from accelpact_slurm.core import errors")] is None
    assert found[("accelpact_slurm.ops.status", "import torch")] == "keeps torch out of importing accelpact_slurm.ops.status"


def untyped_ranks(root: str) -> list[str]:
    """Every parameter named ``rt`` (the rank's runtime) annotated ``Any`` or not at all."""
    import ast
    from pathlib import Path

    bad = []
    for pkg in PACKAGES:
        for p in sorted((Path(root) / pkg).rglob("*.py")):
            for f in ast.walk(ast.parse(p.read_text())):
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for a in f.args.args + f.args.kwonlyargs:
                        if a.arg == "rt" and (a.annotation is None or ast.unparse(a.annotation) in ("Any", "'Any'")):
                            bad.append(f"{p.relative_to(root)}:{f.lineno} {f.name}")
    return bad


def test_the_rank_is_typed_wherever_it_is_passed():
    """A function taking the rank names what it is: a protocol of ``core.rank`` or the runtime class."""
    assert untyped_ranks(REPO) == []


def test_negative_control_an_untyped_rank_is_found(tmp_path):
    for pkg in PACKAGES:
        shutil.copytree(os.path.join(REPO, pkg), tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    planted = tmp_path / "ckpt_service" / "layout.py"
    planted.write_text(planted.read_text() + "\n\ndef _planted(rt: Any) -> None:\n    pass\n")
    assert untyped_ranks(str(tmp_path)) == [f"ckpt_service/layout.py:{len(planted.read_text().splitlines()) - 1} _planted"]
