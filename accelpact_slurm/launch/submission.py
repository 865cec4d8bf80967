"""The submitit-facing side of ``accelpact-submit``: one :class:`RankTask` per rank, and waiting for it.

Who calls what, in which order:

* the submitting process (``accelpact-submit``) builds a :class:`TaskSpec`, submits ``RankTask(spec)`` through a
  ``submitit.AutoExecutor`` with ``nodes x ranks_per_node`` tasks, then (``--wait``) calls :func:`wait_for_job`
  and, on submitit's local executor, :func:`relaunch_decision` after a run that ended in a fail-stop;
* submitit starts one process per task (``python -u -m submitit.core._submit FOLDER``, with the submitting
  interpreter), unpickles ``RankTask`` and calls it: the task joins as its rank exactly as the sbatch template's
  ranks do (:mod:`.core`: ``install_signals``, then ``run_task``: ``start_rank`` -- the run directory's lock,
  ``check_same_training``, ``check_run_dir``, ``signals.mark_ready`` -- and ``job.run_rank``), with the same
  job-level flags (:attr:`TaskSpec.worker_args`).  Local rank 0 of each node starts that node's checkpoint daemon
  as its child after the start-up checks.

On submitit's local executor there is no ``SLURM_*`` environment: :func:`task_environ` builds the one ``srun``
would give (:func:`~accelpact_slurm.slurm.env.emulated_environ`) from ``submitit.JobEnvironment()``'s global rank,
with ``ACCELPACT_EMULATED=1`` and the rendezvous ports the submitting process picked.  The local executor knows
one node only (its ``JobEnvironment`` says ``num_nodes=1``); the emulated nodes come from the spec, and rank ``r``
sits on emulated node ``r // ranks_per_node``, as under ``srun --ntasks-per-node``.

GPUs (``accelpact-submit --gpus-per-node G``, G equal to the ranks per node): on Slurm the job asks for
``--gpus-per-node=G`` and its step for ``--gpu-bind=none``, so every task sees its node's G GPUs and the runtime
gives each rank ``cuda:LOCAL_RANK`` (:mod:`accelpact_slurm.runtime.job.hardware`).  On the local executor submitit
sets ``CUDA_VISIBLE_DEVICES`` of every task to ``nodes x G`` GPUs of this machine, and the emulated rank ``r``
takes ``cuda:r``; with G = 0 it lists none: a CPU job.

submitit's Checkpointable (its USR2 handler, ``checkpoint()``, ``max_num_timeout``) is bypassed on purpose: the
first thing :meth:`RankTask.__call__` does is ``signals.install()``, so a USR2 takes our snapshot-then-requeue path;
``docs/launch.md`` says why, step by step (submitit 1.5.4).

Output: on Slurm every task's srun has ``--label`` (each line of rank R starts ``R: ``, as under the sbatch
template); on the local executor the task puts the same prefix on what it writes (:func:`.core.label_output`).

A preemption's SIGTERM (Slurm sends it to every task of a preempted job, then SIGKILL after the grace time)
takes the USR2 path too on Slurm (:func:`~accelpact_slurm.slurm.signals.stop_signals`), in place of submitit's
handler, which only logs it and trains on until the SIGKILL; on the local executor SIGTERM keeps that handler.

The node's daemon is a child of local rank 0: it ignores USR2, and on Slurm SIGTERM as well
(``--keep-serving-on-sigterm``): Slurm signals every process of the step, and the daemon must stay up for the
snapshot the signal asks for.  It gets SIGINT when its parent dies (a fail-stop ends the rank with ``os._exit``
once the script unwound, skipping the launcher's ``finally``), so a daemon never outlives its task.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import submitit

from accelpact_slurm.core.config import load_config, relaunch_resumes
from accelpact_slurm.core.errors import EXIT_OK, SlurmEnvError
from accelpact_slurm.core import settings
from accelpact_slurm.core.events import EVENTS_FILE, read_events
from accelpact_slurm.core.safeopen import open_writable
from accelpact_slurm.launch import core
from accelpact_slurm.launch.core import decided_code, exit_verdict, relaunch_in_place
from accelpact_slurm.launch.daemons import spawn_daemon
from accelpact_slurm.launch.ranks import rank_environ
from accelpact_slurm.slurm import signals
from accelpact_slurm.slurm.env import in_slurm
from ckpt_service.layout import LOCK, node_dir
from submitit.core.utils import pickle_load

log = logging.getLogger(__name__)

BACKENDS = ("slurm", "local")
#: Seconds between two looks at a job or a lock.
POLL_S = 0.25
#: After Slurm says a job ended, how long its result files may take to appear (shared file systems lag).
RESULT_GRACE_S = 15.0
SCONTROL_TIMEOUT_S = 30.0
#: States a Slurm job does not leave by itself (a requeued job goes back to PENDING instead).
SLURM_FINAL_STATES = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
    "TIMEOUT", "REQUEUE_HOLD", "SPECIAL_EXIT",
})


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """What every task of one submission needs; pickled with the task, so plain values only.

    Attributes:
        backend: ``"slurm"`` (a real allocation) or ``"local"`` (submitit's local executor, emulated Slurm).
        config_path: Absolute path of the job file, read by every task and by the node daemons.
        runs_root: Absolute runs root; the run directory is ``runs_root/<job id>`` when ``run_dir`` is None.
        run_dir: Absolute run directory, or None for the default above.
        nodes: Nodes of the job (emulated ones on the local executor).
        ranks_per_node: Ranks on each node.
        job_id: Local executor only: the emulated ``SLURM_JOB_ID`` (kept across relaunches); None: derived.
        restart_count: Local executor only: the emulated ``SLURM_RESTART_COUNT``.
        master_port: Local executor only: data-plane store port picked by the submitting process.
        control_port: Local executor only: control-plane store port.
        drain_s: How long a node daemon may finish queued snapshots when stopped.
        worker_args: The job-level flags after CONFIG and ``--run-dir`` (``--steps``, ``--seed``, ``--entry``,
            ``--inject-fault``, ``--allow-config-change``), as :func:`.core.add_job_flags` parses them.
    """

    backend: str
    config_path: str
    runs_root: str
    run_dir: str | None = None
    nodes: int
    ranks_per_node: int
    job_id: str | None = None
    restart_count: int = 0
    master_port: int | None = None
    control_port: int | None = None
    drain_s: float = 120.0
    worker_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(f"nodes and ranks_per_node must be >= 1, got {self.nodes} x {self.ranks_per_node}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


def local_job_id(submitit_job_id: str) -> str:
    """The emulated ``SLURM_JOB_ID`` of a local-executor job (submitit's id is its controller's pid)."""
    return f"local-{submitit_job_id}"


def run_dir_for(spec: TaskSpec, job_id: str) -> str:
    """Where the run of ``spec`` writes, once its job id (as the ranks see it) is known."""
    return spec.run_dir or os.path.join(spec.runs_root, job_id)


def task_environ(spec: TaskSpec, base: Mapping[str, str], submitit_job_id: str, global_rank: int,
                 num_tasks: int) -> dict[str, str]:
    """The environment of one local-executor task: ``base`` without ``SLURM_*``, plus the emulated step (pure).

    Raises:
        SlurmEnvError: If submitit started a different number of tasks than the spec describes.
    """
    if num_tasks != spec.world_size:
        raise SlurmEnvError(f"submitit started {num_tasks} tasks but the job needs {spec.nodes} x "
                            f"{spec.ranks_per_node} = {spec.world_size}: submit with tasks_per_node={spec.world_size}")
    if spec.master_port is None or spec.control_port is None:
        raise SlurmEnvError("a local-executor task needs master_port and control_port in its spec: "
                            "submit through accelpact-submit, which picks them")

    return rank_environ(base, spec.job_id or local_job_id(submitit_job_id), global_rank, spec.nodes,
                        spec.ranks_per_node, restart=spec.restart_count, data_port=spec.master_port,
                        control_port=spec.control_port)


class RankTask(submitit.helpers.Checkpointable):
    """One rank of the job, as submitit runs it (one task per rank).  See the module docstring for the mapping."""

    def __init__(self, spec: TaskSpec) -> None:
        self.spec = spec

    def __call__(self) -> dict[str, Any]:

        # First thing: replaces submitit's USR2 handler, which would requeue mid-update (and, on Slurm, SIGTERM's
        # default action: a preemption's SIGTERM asks for the same snapshot-then-requeue).
        core.install_signals(emulated=self.spec.backend == "local")

        spec = self.spec
        if spec.backend == "local":
            job_env = submitit.JobEnvironment()
            env = task_environ(spec, os.environ, job_env.job_id, job_env.global_rank, job_env.num_tasks)
            os.environ.clear()  # this process is the task: later readers of os.environ must see the emulation
            os.environ.update(env)
            # submitit's local executor keeps one log per task and no srun labels them: the same "R: " prefix
            core.label_output(job_env.global_rank, spec.world_size)
        else:
            os.environ.pop(settings.EMULATED, None)  # a real allocation: rank 0 must run scontrol requeue
            if not in_slurm(os.environ):
                raise SlurmEnvError("a Slurm task has no SLURM_PROCID/SLURM_STEP_ID: submitit must start the "
                                    "tasks with srun (use_srun=True)")
        os.environ[settings.OUTPUT_LABELLED] = "1"  # "R: " on every line already: log records add no "[rank R]"
        args = core.add_job_flags(argparse.ArgumentParser(prog="RankTask")).parse_args(
            [spec.config_path, *spec.worker_args])
        cfg = core.job_config(args)
        # The same start-up as the template's ranks (core.start_rank: lock, check_same_training, check_run_dir,
        # mark_ready); local rank 0 of each node then starts that node's daemon as its child.
        code, start = core.run_task(
            cfg, spec.config_path, spec.run_dir, os.environ, allow_config_change=args.allow_config_change,
            runs_root=spec.runs_root,
            node_daemon=lambda st: start_node_daemon(spec, st.cfg, st.run_dir, st.ctx) if st.ctx.local_rank == 0
            else None, drain_s=spec.drain_s, script=core.script_spec(args))
        ctx = start.ctx
        return {"rank": ctx.rank, "exit_code": code, "job_id": ctx.job_id, "restart": ctx.restart_count,
                "run_dir": start.run_dir}

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Called by submitit's USR2 handler (rank 0): only ask for our snapshot-then-requeue, never snapshot here.

        Returns the same task with the same arguments: the state to resume from lives in the run directory's
        snapshots, not in the pickle.
        """
        signals.request()
        return super().checkpoint(*args, **kwargs)


# --------------------------------------------------------------------------- the node's checkpoint daemon


def _child_setup(parent_pid: int):
    """preexec_fn of the daemon: ignore USR2 (inherited across exec) and stop with the parent (Linux)."""
    prctl = None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork: nothing to load in the child
    except (OSError, AttributeError):  # not Linux: the daemon is stopped by run's end or by Slurm
        pass

    def setup() -> None:
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # Slurm signals every process of the step
        if prctl is not None:
            # PR_SET_PDEATHSIG: os._exit on a fail-stop must not orphan the daemon.  SIGINT: on Slurm the daemon
            # ignores SIGTERM (--keep-serving-on-sigterm); it stops on SIGINT everywhere.
            prctl(1, signal.SIGINT)
        if os.getppid() != parent_pid:  # the parent died before prctl: nobody to serve
            os._exit(0)

    return setup


def wait_lock_free(lock_path: str, deadline_s: float) -> bool:
    """Poll until nobody holds ``lock_path`` (a daemon of an earlier attempt still draining); False at the deadline."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:  # a link or FIFO at the name is nobody's lock: refused, not followed (core.safeopen)
            fd, _st = open_writable(lock_path, create=False)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return True
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def start_node_daemon(spec: TaskSpec, cfg, run_dir: str, ctx):
    """Start this node's ``accelpact-ckptd`` as a child of local rank 0 (None when snapshots are off)."""
    if cfg.checkpoint.every_steps <= 0:
        return None

    node = ctx.hostname
    ndir = node_dir(run_dir, node, cfg.checkpoint.local_dir)
    if not wait_lock_free(os.path.join(ndir, LOCK), cfg.timeouts.startup_s):
        log.warning("a daemon of an earlier attempt still holds %s; the ranks go on without a new one", ndir)
    return spawn_daemon(spec.config_path, run_dir, node, ctx.node_index, ctx.job_id, os.environ,
                        restart=ctx.restart_count, drain_s=spec.drain_s, preexec_fn=_child_setup(os.getpid()),
                        num_nodes=ctx.num_nodes, every_steps=cfg.checkpoint.every_steps,
                        keep_serving_on_sigterm=spec.backend != "local")


# --------------------------------------------------------------------------- the submitting side


def relaunch_decision(events: Iterable[dict], restart: int, max_restarts: int) -> tuple[bool, str]:
    """Whether the local executor's job, which ended without results at ``restart``, is relaunched (pure).

    What the ranks decided (:func:`.core.decided_code`), else a crash, through :func:`.core.exit_verdict` and
    :func:`.core.relaunch_in_place`, as on the embedded default: a fail-stop or a crash is relaunched in place
    (Slurm would requeue it), a bug (76) never.
    """
    decided = decided_code(events, restart)
    verdict = exit_verdict(decided if decided is not None else -1, slurm=False)
    return relaunch_in_place(verdict, restart, max_restarts)


@dataclass(frozen=True)
class Outcome:
    """How a submitted job ended, as far as the submitting side can tell.

    ``state``: ``completed`` (every task returned exit 0), ``failed`` (a task raised: ``errors`` holds the
    last line of each traceback), ``ended`` (some task left no result: fail-stop, crash or kill),
    or ``timeout`` (the wait's deadline passed; the job may still run).
    """

    state: str
    detail: str
    results: tuple[Any, ...] = ()
    errors: tuple[str, ...] = ()


def slurm_state(job_id: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The job's state from the controller (``scontrol show job``); None when it no longer knows the job."""
    try:
        proc = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_S, env=dict(os.environ if environ is None else environ))
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("scontrol show job %s: %s", job_id, exc)
        return "UNKNOWN"
    if proc.returncode != 0:
        return None if "Invalid job id" in proc.stderr else "UNKNOWN"
    for word in proc.stdout.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return "UNKNOWN"


def _read_results(job) -> list[tuple[str, Any] | None]:

    out: list[tuple[str, Any] | None] = []
    for k in range(job.num_tasks):
        path = job.task(k).paths.result_pickle
        try:
            out.append(pickle_load(path) if path.exists() else None)
        except (EOFError, OSError):  # being renamed into place: read on the next look
            out.append(None)
    return out


def judge(results: Sequence[tuple[str, Any] | None]) -> Outcome:
    """The outcome from every task's (outcome, value) pair; call once all are present or the job ended (pure)."""
    errors = tuple(_last_line(r[1]) for r in results if r is not None and r[0] == "error")
    values = tuple(r[1] if r is not None and r[0] == "success" else None for r in results)
    missing = [k for k, r in enumerate(results) if r is None]
    if errors:
        return Outcome("failed", f"{len(errors)} task(s) raised: {errors[0]}", values, errors)
    if missing:
        return Outcome("ended", f"task(s) {missing} left no result (fail-stop, crash or kill)", values)
    bad = [v for v in values if not isinstance(v, dict) or v.get("exit_code") != EXIT_OK]
    if bad:
        return Outcome("failed", f"task(s) returned {bad}", values)
    return Outcome("completed", "every task finished", values)


def _last_line(trace: Any) -> str:
    lines = str(trace).strip().splitlines()
    return lines[-1] if lines else "?"


def wait_for_job(job, backend: str, deadline_s: float, environ: Mapping[str, str] | None = None) -> Outcome:
    """Poll until every task left its result, or the job ended without, or ``deadline_s`` passed.

    Never ``job.result()``: without slurmdbd submitit cannot see a job that died and would wait forever.
    On Slurm a requeued job goes back to PENDING and the wait goes on.
    """
    deadline = time.monotonic() + deadline_s
    ended_at: float | None = None
    state = "?"
    while True:
        now = time.monotonic()
        if ended_at is None:  # looked at before the results: a task writes its result before it exits
            if backend == "local":
                state = "ended" if job.done() else "RUNNING"  # done: the local controller process exited
            else:
                state = slurm_state(job.job_id, environ) or "gone"
            if state == "ended" or state in SLURM_FINAL_STATES or state == "gone":
                ended_at = now
        results = _read_results(job)
        if all(r is not None for r in results):
            return judge(results)
        if ended_at is not None and (backend == "local" or now - ended_at >= RESULT_GRACE_S):
            out = judge(results)
            return dataclasses.replace(out, detail=f"{out.detail}; job state {state}")
        if now >= deadline:
            return Outcome("timeout", f"not finished after {deadline_s:g} s (state {state}); it keeps running")
        time.sleep(POLL_S)


def submit_until_settled(submit: Any, spec: TaskSpec, *, backend: str, why: str, wait: bool, deadline_s: float,
                         max_restarts: int, out: Any = None) -> tuple[Outcome | None, TaskSpec, Any]:
    """Submit, and on the local executor relaunch on "requeue me" as Slurm would (Slurm requeues by itself).

    ``submit(spec)`` submits one launch and returns submitit's job.  Returns ``(outcome, spec, job)`` of
    the last launch; ``outcome`` is None when ``wait`` is false.  Prints one progress line per launch.
    """
    out = out or sys.stdout
    restart = 0
    while True:
        job = submit(spec)
        ranks_job_id = job.job_id if backend == "slurm" else (spec.job_id or local_job_id(job.job_id))
        spec = dataclasses.replace(spec, job_id=ranks_job_id if backend == "local" else None,
                                   run_dir=run_dir_for(spec, ranks_job_id))
        print(f"[accelpact] submitted job {job.job_id} ({backend}: {why}; {spec.nodes} nodes x "
              f"{spec.ranks_per_node} ranks{f', restart {restart}' if restart else ''})\n"
              f"[accelpact] run dir {spec.run_dir}\n"
              f"[accelpact] submitit logs {job.paths.folder} (rank 0: {job.task(0).paths.stdout})", file=out,
              flush=True)
        if not wait:
            return None, spec, job
        outcome = wait_for_job(job, backend, deadline_s)
        if outcome.state != "completed" and backend == "local" and outcome.state == "ended":

            again, reason = relaunch_decision(read_events(os.path.join(spec.run_dir, EVENTS_FILE)), restart,
                                              max_restarts)
            if again:
                restart += 1
                every = load_config(spec.config_path).checkpoint.every_steps
                print(f"[accelpact] {reason}: relaunching (restart {restart}); {relaunch_resumes(every)}", file=out,
                      flush=True)
                spec = dataclasses.replace(spec, restart_count=restart)
                continue
            outcome = dataclasses.replace(outcome, detail=f"{outcome.detail}; not relaunched: {reason}")
        return outcome, spec, job
