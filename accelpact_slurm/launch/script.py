"""Script mode of the launchers: torchrun's command line, and the job it starts.

``accelpact-run [--nnodes N] [--nproc-per-node P] [accelpact's flags] train.py --its --own --args`` reads the
launcher's flags up to the script's path, as ``torchrun`` does, and leaves everything after it to the script
(``sys.argv = [train.py, --its, --own, --args]`` on every rank).  A flag ``torchrun`` has means here what it means
there where this launcher needs it (:data:`TORCHRUN_FLAGS`); one it cannot honour is refused in one line
(:data:`REFUSED`), before anything starts.

The job is the embedded default's: ``N`` emulated nodes x ``P`` ranks (the job file's topology, else 2 x 2, where
the flags are not given).  A job file is optional (``--config FILE``: its checkpoint, timeouts, recovery, params);
every field has its default.  :func:`script_job` makes the effective configuration -- entry ``PATH.py:__main__``
(:mod:`accelpact_slurm.core.script`) -- and :func:`write_job_file` writes it into the run directory, where the
ranks, the daemons and a relaunch read it.  The steps and seed of the training are the script's
(``init(steps=..., seed=...)`` of the package); the values a job file sets travel to the ranks as the
:class:`~accelpact_slurm.core.script.ScriptSpec` that checks them.

The same command line, parsed here, starts the script on Slurm too: ``accelpact-submit [flags] train.py [args]``
(submitit, one task per rank) and ``sbatch ... sbatch_templates/hsdp.sbatch [flags] train.py [args]``
(:func:`template_job`: the allocation's sizes are the topology).  Each writes the same effective job file into the
run directory and hands every rank the same ``--script-spec``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import yaml

from accelpact_slurm.core.atomic import write_atomic
from accelpact_slurm.core.config import FaultSpec, JobConfig, load_config, read_mapping, with_overrides
from accelpact_slurm.core.errors import ConfigError, SlurmEnvError
from accelpact_slurm.core.script import ScriptSpec, fixed_values, script_entry
from accelpact_slurm.core.spares import check_spares_started
from accelpact_slurm.slurm.hostlist import parse_tasks_per_node

#: The effective job file of a script-mode run, in its run directory.
JOB_FILE = "script-job.yaml"
SCRIPT_SUFFIXES = (".py",)
JOB_SUFFIXES = (".yaml", ".yml")

#: torchrun's flags this launcher honours, and what each means here (the help's words).
TORCHRUN_FLAGS = {
    "--nnodes": "number of nodes: here emulated nodes on this machine (N, or N:N; an elastic range is refused)",
    "--nproc-per-node": "ranks per node (an integer; also --nproc_per_node)",
    "--standalone": "a single-machine rendezvous: what the embedded default always is (accepted, changes nothing)",
    "--max-restarts": "relaunches after a fail-stop before the job gives up (the job file's recovery.max_restarts)",
    "--node-rank": "only 0: this one launcher starts every node",
    "-m, --module": "run the script as a module (python -m), e.g. -m pkg.train",
}

#: torchrun's flags this launcher cannot honour, and why (each refused in one line, exit 2).
REFUSED = {
    "--rdzv-backend": "the job's own store is the rendezvous (only holders of the run's key get in); drop --rdzv-*",
    "--rdzv-endpoint": "the job's own store is the rendezvous, at ports derived from the run's key; drop --rdzv-*",
    "--rdzv-id": "the run directory names the job; drop --rdzv-id (use --run-dir)",
    "--rdzv-conf": "the job file's timeouts section sets the rendezvous' deadlines; drop --rdzv-conf",
    "--master-addr": "the job's store picks its address; drop --master-addr",
    "--master-port": "the job's store takes ports derived from the run's key; drop --master-port",
    "--no-python": "every rank runs the script in its own Python (the runtime protects it there): give a .py "
                   "script or -m MODULE",
    "--log-dir": "every rank's output goes to RUN_DIR/logs/rank-R.log; drop --log-dir (use --run-dir)",
    "--redirects": "every rank's output goes to RUN_DIR/logs/rank-R.log, rank 0's to the terminal; drop it",
    "--tee": "every rank's output goes to RUN_DIR/logs/rank-R.log, rank 0's to the terminal; drop it",
    "--start-method": "ranks are forked from one warm process (or started as processes); drop --start-method",
    "--monitor-interval": "the launcher watches the ranks itself (a rank's death is named within milliseconds); "
                          "drop it",
    "--role": "a job has one role; drop --role",
    "--local-addr": "the job's store picks its address; drop --local-addr",
    "--steps": "the script's own flags follow its path: accelpact-run [flags] train.py --steps N (its call "
               "init(steps=...) of the package is the one source)",
    "--seed": "the script's own flags follow its path: accelpact-run [flags] train.py --seed N (its call "
              "init(seed=...) of the package is the one source)",
    "--entry": "the script is the entry in this form; for a function, use accelpact-run JOB.yaml --entry M:F",
}


class _Refuse(argparse.Action):
    """Records a refused flag (with its value) for :func:`parse` to name."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        refused = list(getattr(namespace, "refused", None) or [])
        refused.append((option_string or self.dest, values))
        setattr(namespace, "refused", refused)


def build_parser(prog: str = "accelpact-run", description: str = "", epilog: str = "",
                 nodes: str = "emulated nodes on this machine") -> argparse.ArgumentParser:
    """The script form's parser: torchrun's flags, this launcher's own, the script and its arguments.  ``nodes``:
    what a node is where ``prog`` starts the job (the help's words)."""
    p = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage=f"{prog} [--nnodes N] [--nproc-per-node P] [--spare-nodes K] [--run-dir DIR] "
                                      f"[...] SCRIPT.py [script args ...]\n       {prog} JOB.yaml [job flags] "
                                      f"(see {prog} JOB.yaml --help)")
    t = p.add_argument_group("torchrun's flags (the same meaning)")
    t.add_argument("--nnodes", metavar="N", help=TORCHRUN_FLAGS["--nnodes"].replace("emulated nodes on this machine",
                                                                                   nodes))
    t.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", metavar="P",
                   help=TORCHRUN_FLAGS["--nproc-per-node"])
    t.add_argument("--standalone", action="store_true", help=TORCHRUN_FLAGS["--standalone"])
    t.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, metavar="R",
                   help=TORCHRUN_FLAGS["--max-restarts"])
    t.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, metavar="0",
                   help=TORCHRUN_FLAGS["--node-rank"])
    t.add_argument("-m", "--module", action="store_true", help=TORCHRUN_FLAGS["-m, --module"])
    r = p.add_argument_group("torchrun's flags refused here (exit 2, with the reason)")
    for flag in REFUSED:
        if flag in ("--steps", "--seed", "--entry"):
            continue
        names = [flag, flag.replace("-", "_").replace("__", "--", 1)]
        takes = flag != "--no-python"
        r.add_argument(*dict.fromkeys(names), action=_Refuse, nargs=None if takes else 0,
                       dest=f"refused_{flag[2:].replace('-', '_')}", metavar="X", help=REFUSED[flag].split(";")[0])
    a = p.add_argument_group("accelpact's flags")
    a.add_argument("--run-dir", metavar="DIR", help="the run directory: events.jsonl, summary.json, logs, snapshots "
                                                   "(default: $ACCELPACT_RUNS_ROOT or ./runs, then the script's name "
                                                   "and time)")
    a.add_argument("--config", metavar="JOB.yaml", help="an optional job file: checkpoint, timeouts, recovery, "
                                                       "params (every field has a default; its steps and seed must "
                                                       "agree with the script's)")
    a.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="a snapshot every N updates (the job file's checkpoint.every_steps; default 0: none)")
    a.add_argument("--spare-nodes", type=int, metavar="K", help="warm spare nodes beside the training nodes")
    a.add_argument("--allow-config-change", action="store_true",
                   help="run in a run directory whose first start trained something else")
    a.add_argument("--inject-fault", action="append", default=[], metavar="PHASE:STEP:RANK",
                   help="test only: a real fault (boundary, forward, backward ...), repeatable")
    for flag in ("--steps", "--seed", "--entry"):
        a.add_argument(flag, action=_Refuse, dest=f"refused_{flag[2:]}", help=argparse.SUPPRESS)
    p.add_argument("script", metavar="SCRIPT.py", help="the training script (or, with -m, a module)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments (its sys.argv[1:])")
    return p


def positional(argv: Sequence[str], parsers: Sequence[argparse.ArgumentParser]) -> tuple[str | None, bool]:
    """The first positional of ``argv`` (the script or the job file; None: none) and whether ``-m``/``--module``
    or ``--no-python`` came before it (pure).  An option's value is skipped by what ``parsers`` say it takes."""
    takes: set[str] = set()
    for parser in parsers:
        for action in parser._actions:
            if action.option_strings and action.nargs != 0:
                takes.update(action.option_strings)
    module = False
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        if token == "--":
            return None, module
        if token.startswith("-") and token != "-":
            if token in ("-m", "--module", "--no-python", "--no_python"):
                module = True
            skip = "=" not in token and token in takes
            continue
        return token, module
    return None, module


def script_mode(argv: Sequence[str], job_parser: argparse.ArgumentParser,
                script_parser: argparse.ArgumentParser) -> bool:
    """Whether ``argv`` is the script form: its positional ends in ``.py`` or follows ``-m``, or there is none
    (``--help`` alone shows the script form).

    Raises:
        ConfigError: a positional that is neither a script nor a job file.
    """
    first, module = positional(argv, (job_parser, script_parser))
    if first is None or module or first.endswith(SCRIPT_SUFFIXES):
        return True
    if first.endswith(JOB_SUFFIXES):
        return False
    raise ConfigError("SCRIPT", first, "give a training script (.py), a module after -m, or a job file "
                                       "(.yaml or .yml)")


def parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """The script form's arguments, checked: a refused flag, an elastic ``--nnodes`` range, a size that is not a
    positive integer, a node rank other than 0, each raises one :class:`ConfigError` line."""
    args = parser.parse_args(list(argv))
    for flag, value in getattr(args, "refused", None) or []:
        key = flag.replace("_", "-") if flag.startswith("--") else flag
        reason = REFUSED.get(key, "not supported here")
        raise ConfigError(flag, value if value not in (None, []) else "(set)", f"not supported by {parser.prog}: "
                                                                               f"{reason}")
    args.nnodes = _size("--nnodes", args.nnodes)
    args.nproc_per_node = _size("--nproc-per-node", args.nproc_per_node)
    if args.node_rank not in (None, 0):
        raise ConfigError("--node-rank", args.node_rank, "this one launcher starts every node: drop --node-rank "
                                                         "(on Slurm, the allocation gives each node its rank)")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise ConfigError("--max-restarts", args.max_restarts, "must be >= 0")
    return args


def _size(flag: str, value: str | None) -> int | None:
    if value is None:
        return None
    text = str(value)
    if flag == "--nnodes" and ":" in text:
        low, _, high = text.partition(":")
        if low != high:
            raise ConfigError(flag, text, "elastic node ranges are not supported: a job keeps its nodes (a lost "
                                          "node is restarted or replaced by a spare, --spare-nodes K); give one "
                                          "number, e.g. --nnodes 2")
        text = low
    if flag == "--nproc-per-node" and text in ("auto", "gpu", "cpu", "xpu"):
        raise ConfigError(flag, text, "give the number of ranks per node, e.g. --nproc-per-node 4 (on GPUs: one "
                                      "per GPU)")
    try:
        n = int(text)
    except ValueError:
        raise ConfigError(flag, text, "must be a positive integer") from None
    if n < 1:
        raise ConfigError(flag, text, "must be a positive integer")
    return n


def script_job(args: argparse.Namespace, cwd: str | None = None) -> tuple[JobConfig, ScriptSpec]:
    """The effective job of the script form, and what its ranks check the script's values against.

    The job file (``--config``, optional) or the defaults; the script as its entry (``PATH.py:__main__``, the path
    absolute); the flags over the file.  ``steps`` is the file's where it sets it, else the default raised to the
    last injected fault's update, until the script's ``init(steps=...)`` says (its value is checked there).

    Raises:
        ConfigError: the job file names an entry of its own, or a value the flags make invalid.
    """
    cwd = cwd or os.getcwd()
    cfg = load_config(args.config) if args.config else JobConfig()
    raw = read_mapping(args.config) if args.config else None
    if raw is not None and raw.get("entry"):
        raise ConfigError("entry", raw["entry"], f"the script {args.script} is the entry of this form: remove entry "
                                                 f"from {args.config}, or run accelpact-run {args.config}")
    target = args.script if args.module else os.path.abspath(os.path.join(cwd, args.script))
    if not args.module and not os.path.isfile(target):
        raise ConfigError("SCRIPT", args.script, f"no such file ({target}); give the training script's path")
    spec = ScriptSpec(argv=tuple(args.script_args), fixed=fixed_values(raw, args.config or "", {}))
    overrides: dict[str, Any] = {"entry": script_entry(target, module=args.module)}
    if raw is None or "name" not in raw:
        overrides["name"] = os.path.basename(args.script).rsplit(".", 1)[0] if not args.module else \
            args.script.rsplit(".", 1)[-1]
    if args.nnodes is not None:
        overrides["topology.nodes"] = args.nnodes
    if args.nproc_per_node is not None:
        overrides["topology.ranks_per_node"] = args.nproc_per_node
    if args.spare_nodes is not None:
        overrides["topology.spare_nodes"] = args.spare_nodes
    if args.max_restarts is not None:
        overrides["recovery.max_restarts"] = args.max_restarts
    if args.checkpoint_every is not None:
        overrides["checkpoint.every_steps"] = args.checkpoint_every
    injected = [FaultSpec.parse(f, "--inject-fault") for f in args.inject_fault]
    if "steps" not in spec.fixed and (cfg.faults or injected):  # checked again against the script's init(steps=)
        overrides["steps"] = max([cfg.steps, *(f.step for f in (*cfg.faults, *injected))])
    cfg = with_overrides(cfg, overrides)
    if args.inject_fault:
        cfg = with_overrides(cfg, {"faults": list(dict.fromkeys([*map(str, cfg.faults), *map(str, injected)]))})
    return cfg, spec


def write_job_file(cfg: JobConfig, run_dir: str) -> str:
    """The effective configuration as a job file in ``run_dir`` (:data:`JOB_FILE`), written atomically; its path."""
    path = os.path.join(os.path.abspath(run_dir), JOB_FILE)
    text = ("# written by the launcher (accelpact-run, accelpact-submit or the sbatch template) for a script started "
            "in its torchrun form: the effective job (defaults, the --config file, the flags)\n"
            + yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    write_atomic(path, lambda fh: fh.write(text.encode()))
    return path


def worker_args(args: argparse.Namespace, spec: ScriptSpec) -> list[str]:
    """What every rank (and spare) of the script form takes after the job file and ``--run-dir`` (pure)."""
    out = ["--allow-config-change"] if args.allow_config_change else []
    return out + [f"--script-spec={spec.to_json()}"]


# --------------------------------------------------------------------------- the sbatch template's two forms

TEMPLATE = "hsdp.sbatch"
TEMPLATE_USAGE = (f"sbatch --nodes=N --ntasks-per-node=M [...] {TEMPLATE} CONFIG [RUN_DIR]  or  sbatch --nodes=N "
                  f"--ntasks-per-node=M [...] {TEMPLATE} [--run-dir DIR] [--config JOB.yaml] [...] SCRIPT.py "
                  f"[script args ...]")


@dataclass(frozen=True)
class TemplateJob:
    """What the sbatch template's steps take: the job file the daemons and ranks read, the run directory, and what
    every rank takes after them (the script form's ``--script-spec``; nothing in the job-file form)."""

    config: str
    run_dir: str
    worker_args: tuple[str, ...] = ()

    def shell(self) -> str:
        """Bash assignments of ``CONFIG``, ``RUN_DIR`` and the array ``WORKER_ARGS``, every value quoted (pure):
        what the template's ``eval`` takes."""
        words = " ".join(shlex.quote(w) for w in self.worker_args)
        return f"CONFIG={shlex.quote(self.config)}\nRUN_DIR={shlex.quote(self.run_dir)}\nWORKER_ARGS=({words})\n"


def allocation_sizes(environ: Mapping[str, str]) -> tuple[int | None, int | None]:
    """The allocation's nodes and tasks per node from Slurm's variables (pure); None where they do not say, or
    where the nodes' task counts differ (``SLURM_TASKS_PER_NODE=3,1``)."""
    def number(text: str | None) -> int | None:
        return int(text) if text and re.fullmatch(r"[0-9]+", text) else None

    nodes = number(environ.get("SLURM_JOB_NUM_NODES")) or number(environ.get("SLURM_NNODES"))
    per_node = number(environ.get("SLURM_NTASKS_PER_NODE"))
    if per_node is None and environ.get("SLURM_TASKS_PER_NODE"):
        try:
            counts = set(parse_tasks_per_node(environ["SLURM_TASKS_PER_NODE"]))
        except SlurmEnvError:
            counts = set()
        per_node = counts.pop() if len(counts) == 1 else None
    return nodes, per_node


def template_job(argv: Sequence[str], environ: Mapping[str, str], cwd: str | None = None) -> TemplateJob:
    """The sbatch template's job from its arguments: a job file (``CONFIG [RUN_DIR]``), or -- the torchrun form --
    this module's flags, a script and its own arguments (``[--run-dir DIR] [--config JOB.yaml] [...] train.py
    --its --args``; ``-m pkg.train`` for a module).  Told apart by the first argument: a flag or a ``.py`` path
    starts the script form.

    The script form makes the effective job as ``accelpact-run`` does (:func:`script_job`, with the allocation's
    sizes as its topology) and writes it into the run directory (:func:`write_job_file`); every rank gets the
    script's arguments in its ``--script-spec`` (:func:`worker_args`).  The run directory defaults to
    ``$SLURM_SUBMIT_DIR/runs/$SLURM_JOB_ID`` in both forms: a requeued job (same id, same arguments) writes the same
    job file there again and finds its snapshots.  Relative paths are taken from ``cwd`` (the job's working
    directory).

    Raises:
        ConfigError: no arguments, a job-file form with more than ``CONFIG [RUN_DIR]``, a flag refused (as by
            ``accelpact-run``), ``--max-restarts`` (Slurm requeues, not a launcher), ``--nnodes``/``--nproc-per-node``
            other than the allocation's, spare nodes (the template does not start them yet), no ``SLURM_JOB_ID``.
    """
    cwd = cwd or os.getcwd()
    argv = list(argv)
    if not argv or not argv[0]:
        raise ConfigError("arguments", "(none)", f"give a job file or a training script: {TEMPLATE_USAGE}")
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        raise ConfigError("SLURM_JOB_ID", None, f"{TEMPLATE} runs as a Slurm batch job: submit it with sbatch")
    default = os.path.join(environ.get("SLURM_SUBMIT_DIR") or cwd, "runs", job_id)
    if not (argv[0].startswith("-") or argv[0].endswith(SCRIPT_SUFFIXES)):
        if len(argv) > 2:
            raise ConfigError("arguments", " ".join(argv), f"the job-file form takes CONFIG [RUN_DIR] only; a "
                                                           f"script's own arguments follow its path (.py, or -m "
                                                           f"MODULE): {TEMPLATE_USAGE}")
        run_dir = argv[1] if len(argv) == 2 and argv[1] else default
        return TemplateJob(os.path.join(cwd, argv[0]), os.path.join(cwd, run_dir))
    args = parse(build_parser(prog=TEMPLATE, nodes="the allocation's nodes, which sbatch --nodes sets"), argv)
    if not args.module and args.script.endswith(JOB_SUFFIXES):
        raise ConfigError("SCRIPT", args.script, f"a job file comes first and alone ({TEMPLATE} CONFIG [RUN_DIR]); "
                                                 f"flags go with a script: {TEMPLATE} [flags] SCRIPT.py [args]")
    if args.max_restarts is not None:
        raise ConfigError("--max-restarts", args.max_restarts, "under the template Slurm requeues the job, not a "
                                                               "launcher: the cluster's requeue policy and the "
                                                               "no-progress rule (recovery.max_stalled_restarts) bound "
                                                               "its restarts; drop --max-restarts")
    nodes, per_node = allocation_sizes(environ)
    for flag, given, size, sbatch in (("--nnodes", args.nnodes, nodes, "--nodes"),
                                      ("--nproc-per-node", args.nproc_per_node, per_node, "--ntasks-per-node")):
        if given is not None and size is not None and given != size:
            raise ConfigError(flag, given, f"the allocation has {size} (sbatch {sbatch}={size}), and the template "
                                           f"runs on it as it is: drop {flag}, or submit with {sbatch}={given}")
    args.nnodes, args.nproc_per_node = nodes or args.nnodes, per_node or args.nproc_per_node
    cfg, spec = script_job(args, cwd)
    check_spares_started(cfg.topology.spare_nodes, f"the sbatch template ({TEMPLATE})")
    run_dir = os.path.join(cwd, args.run_dir or default)
    os.makedirs(run_dir, exist_ok=True)
    return TemplateJob(write_job_file(cfg, run_dir), os.path.abspath(run_dir), tuple(worker_args(args, spec)))
