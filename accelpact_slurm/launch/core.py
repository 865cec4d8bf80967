"""The one launch core: what every path does to start a job's ranks and daemons, and what a rank's exit means.

Three paths start a job, all through this module: the embedded default (``accelpact-run``, :mod:`.local`),
submitit (``accelpact-submit``, :mod:`.submission`: one task per rank, on Slurm or its local executor), and the
sbatch template (``sbatch_templates/hsdp.sbatch``: ``srun`` over ``python -m accelpact_slurm.cli.worker`` per rank
and ``python -m accelpact_slurm.cli.node`` per node and for the batch script's hooks).

* :func:`start_rank`: one rank's start-up in a (real or emulated) Slurm task: the run directory's lock,
  :func:`check_same_training` (also run by both launchers first), ``check_run_dir``, then
  :func:`~accelpact_slurm.slurm.signals.mark_ready`; :func:`run_task` is the whole rank (start-up, the node's daemon
  where it is the rank's child, training).  Called by the worker entry and by submitit's ``RankTask``.
* :func:`exit_verdict`: THE mapping from an exit status (a rank's, or the training step's) to what happens next:
  ``done``, ``requeue``, ``relaunch`` in place, or ``stop`` (a bug, a usage error, no progress, or a job someone is
  ending); :func:`combine_exit_codes` folds the ranks' codes with it.
* :func:`relaunch_in_place`: **Slurm requeues; the embedded default and submitit's local executor have no Slurm,
  so they relaunch in place what Slurm would requeue** (with the next ``SLURM_RESTART_COUNT``), up to
  ``recovery.max_restarts``.  This is the one place that says so.
* :func:`settle_step`: the batch script's end: a crash nobody decided on is requeued here (exit 75).
* :func:`forward_usr2`: the pre-timeout USR2, recorded in the run directory and forwarded to the training step
  once every task is ready.  :func:`gpus_per_node`: the template's check, one GPU per rank.
* :func:`serve_node`: one node's checkpoint daemon under the template, then the staging a killed daemon left.
* :func:`rank_label` / :class:`LabelledWriter`: the ``R: `` prefix (``srun --label``'s form) on a rank's lines.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence, TextIO

from accelpact_slurm.core import settings
from accelpact_slurm.core.errors import EXIT_NO_REQUEUE, EXIT_OK, EXIT_REQUEUE, EXIT_USAGE, ConfigError
from accelpact_slurm.core.atomic import write_json_atomic
from accelpact_slurm.core.config import load_config, read_mapping, training_diff, training_part, with_overrides
from accelpact_slurm.core.script import ScriptSpec, fixed_values
from accelpact_slurm.core.events import EVENTS_FILE, EventLog, parse_json, read_events
from accelpact_slurm.core.safeopen import NotRegular, check_dir, open_writable, read_regular
from accelpact_slurm.launch.daemons import DAEMON_RESTARTS, record_restart, worth_restarting
from accelpact_slurm.launch.ranks import daemon_command
from accelpact_slurm.launch.run_lock import claim
from accelpact_slurm.runtime.job.entry import run_rank
from accelpact_slurm.runtime.job.rundir import check_run_dir
from accelpact_slurm.slurm import signals
from accelpact_slurm.slurm.env import SlurmContext
from accelpact_slurm.slurm.requeue import request_requeue, step_outcome
from ckpt_service.layout import node_dir
from ckpt_service.staging import FAILED, NOTHING, drop_unserved

log = logging.getLogger(__name__)

#: The training-relevant part of the configuration of a run directory's first start.
TRAINING_FILE = "job-training.json"
#: The most read of ``job-training.json`` (a job file's training part: a few kilobytes; a file past this is
#: refused before it is parsed, as a 200 MB one would take tens of seconds and gigabytes to parse).
TRAINING_LIMIT = 16 << 20

DONE = "done"
REQUEUE = "requeue"
RELAUNCH = "relaunch"
STOP = "stop"


# --------------------------------------------------------------------------- the job-level flags


def add_job_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of a job, shared by ``accelpact-run``, ``accelpact-submit`` and the worker entry."""
    p.add_argument("config", metavar="CONFIG", help="YAML job file (see examples/decoder/job.yaml)")
    p.add_argument("--run-dir", metavar="DIR",
                   help="the run directory shared by every node: events.jsonl, summary.json, logs, snapshots "
                        f"(default: ${settings.RUNS_ROOT} or ./runs, then the job id, or the job's name and time)")
    p.add_argument("--entry", metavar="MODULE:FUNCTION",
                   help="the training function to call on every rank (overrides the file's entry)")
    p.add_argument("--steps", type=int, metavar="N", help="number of optimizer updates (overrides the file)")
    p.add_argument("--seed", type=int, metavar="N", help="random seed (overrides the file)")
    p.add_argument("--spare-nodes", type=int, metavar="K",
                   help="warm spare nodes beside the training nodes (overrides the file's topology.spare_nodes)")
    p.add_argument("--allow-config-change", action="store_true",
                   help="run in a run directory whose first start had another entry, seed, steps or params "
                        "(its snapshots then continue a deliberately changed training)")
    p.add_argument("--inject-fault", action="append", default=[], metavar="PHASE:STEP:RANK",
                   help="test only: make RANK withhold its part of the replication collective: PHASE boundary (at "
                        "the committed boundary after update STEP), forward or backward (of update STEP); "
                        "repeatable, added to the file's faults")
    # The launcher's word to the ranks in script mode (core.script.ScriptSpec): the script's own arguments and the
    # values of steps and seed the job's side fixed.  Not a user flag: accelpact-run [flags] SCRIPT.py [args].
    p.add_argument("--script-spec", metavar="JSON", help=argparse.SUPPRESS)
    return p


def job_config(args: argparse.Namespace):
    """The job file with the job-level flags applied (:func:`add_job_flags`)."""
    cfg = load_config(args.config)
    overrides: dict[str, Any] = {}
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.seed is not None:
        overrides["seed"] = args.seed
    if args.entry is not None:
        overrides["entry"] = args.entry
    if args.spare_nodes is not None:
        overrides["topology.spare_nodes"] = args.spare_nodes
    cfg = with_overrides(cfg, overrides) if overrides else cfg
    if args.inject_fault:
        cfg = with_overrides(cfg, {"faults": list(dict.fromkeys([*map(str, cfg.faults), *args.inject_fault]))})
    return cfg


def worker_args(args: argparse.Namespace) -> list[str]:
    """The job-level flags (less CONFIG and --run-dir) as the worker entry takes them again (pure)."""
    out: list[str] = []
    if args.steps is not None:
        out += ["--steps", str(args.steps)]
    if args.seed is not None:
        out += ["--seed", str(args.seed)]
    if args.entry is not None:
        out += ["--entry", args.entry]
    if args.spare_nodes is not None:
        out += ["--spare-nodes", str(args.spare_nodes)]
    for f in args.inject_fault:
        out += ["--inject-fault", f]
    if args.allow_config_change:
        out += ["--allow-config-change"]
    if getattr(args, "script_spec", None):
        out += [f"--script-spec={args.script_spec}"]
    return out


def script_spec(args: argparse.Namespace) -> ScriptSpec:
    """What the rank's ``init()`` (the package's) checks the script's values against: the launcher's word
    (``--script-spec``), else the job file's own ``steps:``/``seed:`` and the ``--steps``/``--seed`` flags."""
    if getattr(args, "script_spec", None):
        return ScriptSpec.from_json(args.script_spec)
    return ScriptSpec(fixed=fixed_values(read_mapping(args.config), args.config,
                                         {"steps": args.steps, "seed": args.seed}))


# --------------------------------------------------------------------------- start-up checks


def check_same_training(cfg, run_dir: str, allow: bool) -> None:
    """Refuse a run directory whose first start trained something else (its snapshots would all fail the
    replay check); record the training part at the first start.  ``allow``: a deliberate change."""
    path = os.path.join(run_dir, TRAINING_FILE)
    mine = training_part(cfg)
    check_dir(run_dir)  # a directory others may write could hold their FIFO or link at the name
    try:  # a FIFO refused at once (not waited on), a huge file before a byte is parsed (core.safeopen)
        first = parse_json(read_regular(path, TRAINING_LIMIT, owner=os.geteuid()))
    except FileNotFoundError:
        first = None
    except NotRegular as exc:
        raise ConfigError("run dir", path, f"{exc.why}; remove it or use another --run-dir") from None
    except (OSError, ValueError) as exc:
        raise ConfigError("run dir", path, f"cannot read it ({exc}); remove it or use another --run-dir") from None
    if first is not None and not allow:
        changed = training_diff(first, mine)
        if changed:
            raise ConfigError("run dir", run_dir, f"its first start trained with other values of {', '.join(changed)}: "
                                                  f"use another --run-dir, or pass --allow-config-change to continue "
                                                  f"its snapshots with the changed training")
    if first != mine:
        write_json_atomic(path, mine)


@dataclass
class RankStart:
    """What :func:`start_rank` found and holds: the step's context, the sized job, the run directory, the lock."""

    ctx: Any
    cfg: Any
    run_dir: str
    lock: Any


def start_rank(cfg, run_dir: str | None, environ: Mapping[str, str], *, allow_config_change: bool = False,
               runs_root: str | None = None) -> RankStart:
    """One rank's start-up inside a (real or emulated) Slurm task, the same on every path.

    The caller has installed the signal handlers first thing (:func:`install_signals`).  Then: the step's
    sizes win over the job file's topology; the run directory (``run_dir``, else ``<runs_root>/<job id>``,
    ``runs_root`` defaulting to ``$ACCELPACT_RUNS_ROOT`` or ``./runs``); one job per run directory (global rank 0 holds the lock, the others check it);
    :func:`check_same_training`; ``check_run_dir`` (an unsafe run dir is exit 2); and last
    :func:`~accelpact_slurm.slurm.signals.mark_ready` (the batch script may forward USR2 from now on).

    Raises:
        ConfigError: A changed training or an unsafe run directory (exit 2: a requeue would not help).
    """
    ctx = SlurmContext.from_environ(environ)
    cfg = with_overrides(cfg, {"topology.nodes": ctx.num_nodes, "topology.ranks_per_node": ctx.ranks_per_node})
    run_dir = run_dir or os.path.join(runs_root or settings.runs_root(), ctx.job_id)
    os.makedirs(run_dir, exist_ok=True)
    lock = claim(run_dir, ctx.job_id, hold=ctx.rank == 0)
    check_same_training(cfg, run_dir, allow_config_change)
    check_run_dir(run_dir, cfg, ctx.hostname)
    signals.mark_ready(run_dir, ctx.restart_count, ctx.rank)
    return RankStart(ctx, cfg, run_dir, lock)


def install_signals(emulated: bool) -> None:
    """First thing in a rank: an unhandled USR2 would kill the task.  In a real Slurm task SIGTERM (a preemption's
    notice) asks for the same snapshot-then-requeue; emulated, it still stops the rank."""
    signals.install(signals.stop_signals(emulated))


def run_task(cfg, config_path: str, run_dir: str | None, environ: Mapping[str, str], *,
             allow_config_change: bool = False, node_daemon: Any = None,
             runs_root: str | None = None, drain_s: float = 120.0,
             script: ScriptSpec | None = None) -> tuple[int, RankStart]:
    """A whole rank: :func:`start_rank`, the node's daemon where the rank starts it (``node_daemon(start)``
    returns a daemon for :func:`~accelpact_slurm.launch.daemons.stop_daemons`, or None), then training.

    Returns the rank's exit code (a fail-stop never returns: it exits 75/76 via ``os._exit``).
    """
    start = start_rank(cfg, run_dir, environ, allow_config_change=allow_config_change, runs_root=runs_root)
    daemon = node_daemon(start) if node_daemon is not None else None
    try:
        code = run_rank(start.cfg, start.ctx, start.run_dir, job_file=config_path, script=script)
    finally:
        if daemon is not None:
            from accelpact_slurm.launch.daemons import stop_daemons

            stop_daemons([daemon], drain_s=drain_s)
    return code, start


# --------------------------------------------------------------------------- what an exit means


@dataclass(frozen=True)
class Verdict:
    """What happens after an exit.

    ``action``: :data:`DONE`, :data:`REQUEUE` (Slurm starts the job again), :data:`RELAUNCH` (no Slurm: the
    launcher starts it again in place) or :data:`STOP` (never again: do not requeue).  ``exit_code``: the job's
    exit code for it.  ``ask``: nobody in the job asked for the requeue (a crash): the launcher side must.
    """

    action: str
    exit_code: int
    reason: str
    ask: bool = False


def exit_verdict(status: int | None, *, decided: int | None = None, ending: bool = False,
                 slurm: bool = True) -> Verdict:
    """The one mapping from an exit to what happens next (pure).

    ``status``: a rank's exit code (negative: killed by that signal, as ``Popen`` says it), or the training step's
    status (``128 + N``: killed by signal N, as the shell says it).  ``decided``: what the ranks decided in the
    event log when ``status`` is none of the documented codes (srun reports 143 once ``--kill-on-bad-exit``
    ended the ranks still running after the first one left).  ``ending``: someone is ending the job (Slurm's
    SIGTERM to the batch shell, the user's SIGINT/SIGTERM to the launcher): whatever was not decided is not
    requeued.  ``slurm``: Slurm requeues; without it the launcher relaunches in place (:func:`relaunch_in_place`).

    * 0: done.
    * 2 (usage or configuration error) and 76 (a bug in the training code, no progress): stop, do not requeue --
      a restart would repeat it.
    * 75 (fail-stop): requeue -- rank 0 has asked Slurm already -- or relaunch in place.
    * anything else (a crash: an exception outside the runtime, a segfault, an OOM kill): a fail-stop nobody
      decided on: requeue (the launcher side asks) or relaunch, unless the job is ending.
    """
    again = REQUEUE if slurm else RELAUNCH
    if status == EXIT_OK:
        return Verdict(DONE, EXIT_OK, "every rank finished")
    for code in (status, decided):
        if code == EXIT_USAGE:
            return Verdict(STOP, EXIT_USAGE, "a usage or configuration error: a restart would repeat it")
        if code == EXIT_NO_REQUEUE:
            return Verdict(STOP, EXIT_NO_REQUEUE, "do not requeue: a bug in the training code, no progress, or no "
                                                  "snapshot can be restored; a restart would repeat it")
        if code == EXIT_REQUEUE:
            return Verdict(again, EXIT_REQUEUE, f"fail-stop {EXIT_REQUEUE} (requeue me)")
    if ending:
        return Verdict(STOP, status if status is not None else EXIT_REQUEUE,
                       f"ended (status {status}) while the job is being ended: not requeued")
    return Verdict(again, EXIT_REQUEUE, f"crashed (exit status {status}): a fail-stop nobody decided on", ask=slurm)


def combine_exit_codes(codes: Sequence[int | None]) -> int:
    """The job's exit code from its ranks' codes (pure), each through :func:`exit_verdict`.

    0 when every rank finished; otherwise "stop" wins over "requeue me" (76 over 2), and a crash is a fail-stop.
    """
    verdicts = [exit_verdict(c, slurm=False) for c in codes if c not in (EXIT_OK, None)]
    if not verdicts:
        return EXIT_OK
    for code in (EXIT_NO_REQUEUE, EXIT_USAGE):
        if any(v.exit_code == code for v in verdicts):
            return code
    return EXIT_REQUEUE


def decided_code(events: Iterable[dict], restart: int) -> int | None:
    """What the ranks of start ``restart`` decided in the event log: 76 wins over 75; None when none did (pure)."""
    return step_outcome(events, restart)


def relaunch_in_place(verdict: Verdict, restart: int, max_restarts: int) -> tuple[bool, str]:
    """Whether a launcher without Slurm starts the job again after ``verdict`` at ``restart`` (pure).

    Slurm requeues a job that asked for it (exit 75) or that crashed; the embedded default and submitit's local
    executor have no Slurm, so they relaunch it in place, with the next restart count, while fewer than
    ``recovery.max_restarts`` relaunches are spent.  A stop is never relaunched.
    """
    if verdict.action not in (REQUEUE, RELAUNCH):
        return False, verdict.reason
    if restart >= max_restarts:
        return False, f"requeue requested but recovery.max_restarts ({max_restarts}) relaunches are spent"
    return True, verdict.reason


# --------------------------------------------------------------------------- the batch script's hooks


def settle_step(run_dir: str, restart: int, status: int, *, ending: bool, job_id: str,
                environ: Mapping[str, str], out: TextIO | None = None) -> int:
    """The batch script's end: the training step's ``status`` through :func:`exit_verdict`; the job's exit code.

    A crash nobody decided on is requeued here (an event ``requeue`` by ``template``, then ``scontrol requeue``):
    exit 75 when Slurm took it.  After the batch shell's own SIGTERM (``ending``) nothing undecided is requeued:
    Slurm is ending the job, and a requeue now would bring a cancelled job back or requeue one twice.
    """
    out = out or sys.stderr
    path = os.path.join(run_dir, EVENTS_FILE)
    decided = decided_code(read_events(path), restart) if os.path.exists(path) else None
    verdict = exit_verdict(status, decided=decided, ending=ending, slurm=True)
    if verdict.action == STOP and verdict.exit_code not in (EXIT_USAGE, EXIT_NO_REQUEUE):  # stopped by ``ending``
        print(f"hsdp.sbatch: training step ended (status {status}) while Slurm ends the job: not requeued here",
              file=out, flush=True)
    if not verdict.ask:
        return verdict.exit_code
    reason = f"training step crashed (exit status {status})"
    events = EventLog(path, job_id=job_id, restart=restart, rank=None, node=None)
    try:
        events.emit("requeue", reason=reason, by="template")
    finally:
        events.close()
    if request_requeue(job_id, reason, None, environ, emulated=False):
        print(f"hsdp.sbatch: {reason}: requeued; the next start reloads the newest verified checkpoint", file=out,
              flush=True)
        return EXIT_REQUEUE
    print(f"hsdp.sbatch: {reason}, and scontrol requeue failed", file=out, flush=True)
    return status


def forward_usr2(run_dir: str, restart: int, ntasks: int, step_pid: int | None, out: TextIO | None = None) -> bool:
    """The batch script's pre-timeout USR2: record it in the run directory, then forward it to the training step
    (``step_pid``: its ``srun``) once every task has written its ready marker; True when forwarded.

    A task killed by USR2 before its Python has installed the handler would turn a warning into a crash; a task
    that becomes ready later reads the request file after writing its marker
    (:func:`~accelpact_slurm.slurm.signals.mark_ready`): the request reaches the start either way.
    """
    out = out or sys.stderr
    os.makedirs(run_dir, exist_ok=True)
    try:  # an empty marker: created new, or left as it is (never opened through a link: core.safeopen)
        os.close(open_writable(signals.request_file(run_dir, restart), mode=0o644)[0])
    except NotRegular as exc:
        print(f"hsdp.sbatch: {exc.strerror}: USR2 not recorded there", file=out, flush=True)
    ready_dir = os.path.join(run_dir, signals.READY_DIR)
    ready = len([n for n in os.listdir(ready_dir) if n.startswith(f"{restart}-")]) if os.path.isdir(ready_dir) else 0
    if step_pid is not None and ready >= ntasks:
        print("hsdp.sbatch: USR2 (time limit near): forwarding it to the training step", file=out, flush=True)
        try:
            os.kill(step_pid, signal.SIGUSR2)
        except ProcessLookupError:
            pass
        return True
    print(f"hsdp.sbatch: USR2 (time limit near) before every task took it ({ready} of {ntasks} ready): recorded in "
          f"the run directory, the tasks pick it up", file=out, flush=True)
    return False


def serve_node(config_path: str, run_dir: str, environ: Mapping[str, str], drain_s: float = 120.0) -> int:
    """One node's checkpoint daemon under the template (one task per node), output to the job's output.

    The task outlives its daemon: SIGINT (how the batch script stops the daemons), SIGTERM (a preemption's notice: the
    daemon serves on, ``--keep-serving-on-sigterm``) and USR2 reach every process of the step and leave this one
    waiting.  A daemon killed before SIGINT came (``kill -9``, the OOM killer) is started again on the same node
    directory, up to :data:`.daemons.DAEMON_RESTARTS` times (a ``ckptd_restarted`` event each): the node's later
    snapshots, its final one included, go to the new one.  Once the last daemon has exited the shared-memory staging
    it could not drop is removed -- a live daemon's never (it holds the node directory's lock).
    """
    def env_int(name: str) -> int | None:
        try:
            return int(environ[name])
        except (KeyError, ValueError):
            return None

    stopping: list[int] = []
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2):  # handlers: reset to the default in the daemon at exec
        signal.signal(s, (lambda n, _f: stopping.append(n)) if s == signal.SIGINT else (lambda *_: None))
    node = environ.get("SLURMD_NODENAME") or os.uname().nodename
    node_index, job_id, restart = env_int("SLURM_NODEID") or 0, environ.get("SLURM_JOB_ID", ""), \
        env_int("SLURM_RESTART_COUNT") or 0
    cmd = daemon_command(config_path, run_dir, node, node_index, job_id, restart=restart, drain_s=drain_s,
                         num_nodes=env_int("SLURM_JOB_NUM_NODES") or env_int("SLURM_NNODES"),
                         keep_serving_on_sigterm=True)
    proc = subprocess.Popen(cmd, env=dict(environ), stdin=subprocess.DEVNULL)
    rc, restarts = proc.wait(), 0
    while worth_restarting(rc) and not stopping:  # killed while the job ran: the node would take no snapshot
        if restarts >= DAEMON_RESTARTS:
            record_restart(run_dir, job_id, restart, node, node_index, proc.pid, rc, None, restarts)
            break
        old, restarts = proc.pid, restarts + 1
        proc = subprocess.Popen(cmd, env=dict(environ), stdin=subprocess.DEVNULL)
        record_restart(run_dir, job_id, restart, node, node_index, old, rc, proc.pid, restarts)
        rc = proc.wait()
    try:
        local_dir = load_config(config_path).checkpoint.local_dir
    except (OSError, ValueError, ConfigError) as exc:
        print(f"accelpact-ckptd on {node}: cannot read {config_path} to drop the staging: {exc}", file=sys.stderr)
        return rc
    what, why = drop_unserved(node_dir(run_dir, node, local_dir))
    if what != NOTHING:  # after a clean exit (the common case) the daemon has dropped it itself: say nothing
        print(f"accelpact-ckptd: staging on {node}: {why}", file=sys.stderr if what == FAILED else sys.stdout,
              flush=True)
    return rc if rc >= 0 else 128 - rc


def gpus_per_node(environ: Mapping[str, str]) -> int:
    """The allocation's GPUs per node (0: a CPU job), checked against its tasks per node: one GPU per rank (pure).

    This node's GPUs (``SLURM_GPUS_ON_NODE``), else the request (``--gpus-per-node``: ``[type:]count`` per GPU
    type), else the job's GPU ids on this node (``SLURM_JOB_GPUS``: ``0,1,2,3`` or ``0-3``); the tasks per node
    from ``SLURM_NTASKS_PER_NODE``, else ``SLURM_TASKS_PER_NODE`` (``4(x2)``, or ``4,3,...``: equal on every node).

    Raises:
        ValueError: A count it cannot read, or GPUs and tasks per node that differ; one line with the fix.
    """
    var = value = ""
    for var in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_JOB_GPUS"):
        value = environ.get(var, "")
        if value:
            break
    if not value:
        return 0
    count = 0
    for part in value.split(","):
        span = re.fullmatch(r"([0-9]+)-([0-9]+)", part)
        if var == "SLURM_JOB_GPUS" and span:
            count += int(span[2]) - int(span[1]) + 1
        elif var == "SLURM_JOB_GPUS" and re.fullmatch(r"[0-9]+", part):
            count += 1
        elif var != "SLURM_JOB_GPUS" and re.fullmatch(r"[0-9]+", part.rsplit(":", 1)[-1]):
            count += int(part.rsplit(":", 1)[-1])
        else:
            raise ValueError(f"{var}={value}: cannot tell the GPUs per node from it; submit with "
                             f"--gpus-per-node=N --ntasks-per-node=N")
    if count <= 0:
        return 0
    tasks, tasks_from = "", ""
    if environ.get("SLURM_NTASKS_PER_NODE"):
        tasks = environ["SLURM_NTASKS_PER_NODE"]
        tasks_from = f"SLURM_NTASKS_PER_NODE={tasks}"
    elif environ.get("SLURM_TASKS_PER_NODE"):
        tasks_from = f"SLURM_TASKS_PER_NODE={environ['SLURM_TASKS_PER_NODE']}"
        for part in environ["SLURM_TASKS_PER_NODE"].split(","):
            part = part.split("(", 1)[0]
            if tasks and part != tasks:
                raise ValueError(f"{tasks_from}: a GPU job needs the same number of tasks on every node; submit with "
                                 f"--ntasks-per-node={count} --gpus-per-node={count}")
            tasks = part
    if not re.fullmatch(r"[0-9]+", tasks):
        raise ValueError(f"{tasks_from or 'no SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE'}: cannot tell the tasks "
                         f"per node; submit with --ntasks-per-node={count} --gpus-per-node={count}")
    t = int(tasks)
    if t != count:
        raise ValueError(f"{count} GPUs per node ({var}={value}) but {t} tasks per node ({tasks_from}): each rank "
                         f"drives one GPU, so the two must be equal; submit with --ntasks-per-node={count} "
                         f"--gpus-per-node={count}, or --ntasks-per-node={t} --gpus-per-node={t}")
    return count


# --------------------------------------------------------------------------- rank-labelled output


def rank_label(rank: int, world_size: int) -> str:
    """The prefix of a rank's lines in the shared output, as ``srun --label`` writes it: ``3: `` (pure).

    Right-aligned to the widest rank, as srun does (`` 3: `` among 12 ranks).
    """
    return f"{rank:>{len(str(max(world_size - 1, 0)))}}: "


class LabelledWriter:
    """A text stream that puts :func:`rank_label`'s prefix at the start of every line written through it.

    ``drop``: a prefix a line already carries that says the same (a log record's ``[rank R] `` in a rank's own
    log file, echoed to the terminal), left out so that a line reads ``0: ...``, not ``0: [rank 0] ...``.
    """

    def __init__(self, stream: TextIO, label: str, drop: str = "") -> None:
        self._stream = stream
        self._label = label
        self._drop = drop
        self._at_start = True

    def write(self, text: str) -> int:
        if not text:
            return 0
        parts = text.split("\n")
        pieces = []
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if self._at_start and (part or not last):  # an empty line is labelled too, as srun does
                pieces.append(self._label)
                if self._drop and part.startswith(self._drop):
                    part = part[len(self._drop):]
            pieces.append(part)
            if not last:
                pieces.append("\n")
                self._at_start = True
            elif part:
                self._at_start = False
        self._stream.write("".join(pieces))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...
        return getattr(self._stream, name)


def label_output(rank: int, world_size: int) -> None:
    """Prefix every line this process writes through ``sys.stdout``/``sys.stderr`` with its rank label (where no
    ``srun --label`` does it: submitit's local executor)."""
    label = rank_label(rank, world_size)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, LabelledWriter):
            setattr(sys, name, LabelledWriter(stream, label))
