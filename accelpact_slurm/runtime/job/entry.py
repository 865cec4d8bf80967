"""One rank's whole job: join, call the user's entry point, report.

Called by ``accelpact-run`` on every rank (a local process on the embedded default, an ``srun``
task on Slurm, a submitit task).  Rank 0 writes the job-level events, prints progress and writes
``summary.json``; every rank writes its membership.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import socket
import sys
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Mapping, NoReturn, TextIO

from accelpact_slurm.core import settings
from accelpact_slurm.core.atomic import write_json_atomic
from accelpact_slurm.core.config import JobConfig, snapshot_note
from accelpact_slurm.core.errors import (EXIT_NO_REQUEUE, EXIT_OK, EXIT_USAGE, AccelpactError, CheckpointError,
                                         ConfigError, FailStop, Stopped, UsageError)
from accelpact_slurm.core.events import EVENTS_FILE, SUMMARY_FILE, EventLog
from accelpact_slurm.core.faults import TestFaults
from accelpact_slurm.core.script import ScriptSpec, is_script_entry
from accelpact_slurm.core.spares import announce_end
from accelpact_slurm.runtime.detection.peers import dead_peer_stop
from accelpact_slurm.runtime.job import script as script_mode
from accelpact_slurm.runtime.job.phases import log_exception
from accelpact_slurm.slurm.env import SlurmContext
from accelpact_slurm.runtime.job.stopping import as_fail_stop, check_progress, exit_stopped, fail_stop, reraise
from ckpt_service.auth import load_or_create_key

if TYPE_CHECKING:
    from accelpact_slurm.runtime.job.api import Run
    from accelpact_slurm.runtime.job.topology import Runtime

log = logging.getLogger(__name__)

#: What the rank runtime imports (the ``train`` extra).  numpy is first needed at the first snapshot
#: (``Tensor.numpy()``), after all the training before it; checked at start instead.
RUNTIME_MODULES = ("numpy", "torch", "torch.distributed.checkpoint")
TRAIN_EXTRA_FIX = "pip install 'accelpact-slurm[train]'"


def check_dependencies(modules: tuple[str, ...] = RUNTIME_MODULES) -> None:
    """Import every module the rank runtime needs, before the rank joins the job.

    Raises:
        ConfigError: naming the first module that cannot be imported and the fix
            (``accelpact-run`` exits 2 on it, and Slurm does not requeue).
    """
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError("dependencies", name, f"cannot import it ({exc}) on {socket.gethostname()}; install "
                                                    f"the training runtime there with {TRAIN_EXTRA_FIX}") from None


def resolve_entry(entry: str, job_file: str | None) -> Callable[[Any], Any]:
    """The entry point ``module:function`` (or ``path/to/file.py:function``), the job file's directory first.

    Raises:
        ConfigError: naming the entry and the fix when the module cannot be found, does not parse, imports a
            dependency that cannot be imported (named as such; the chained traceback goes to the rank's log), or
            has no such function.
        FailStop: the module raised while it was imported (its own code: exit 76, not requeued).
    """
    if not entry:
        raise ConfigError("entry", entry, "name the training function as module:function in the job file "
                                          "(e.g. entry: train_decoder:main, see examples/decoder/job.yaml)")
    module_name, _, fn_name = entry.rpartition(":")
    base = os.path.dirname(os.path.abspath(job_file)) if job_file else os.getcwd()
    own = module_name[:-3].replace(os.sep, ".").rsplit(".", 1)[-1] if module_name.endswith(".py") else module_name
    try:
        if module_name.endswith(".py"):
            path = module_name if os.path.isabs(module_name) else os.path.join(base, module_name)
            if not os.path.isfile(path):
                raise ConfigError("entry", entry, f"no file {path}; put the module next to the job file or give "
                                                  f"its path")
            sys.path.insert(0, os.path.dirname(path))
            spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
            if spec is None or spec.loader is None:
                raise ConfigError("entry", entry, f"{path} is not a Python module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            if base not in sys.path:
                sys.path.insert(0, base)
            module = importlib.import_module(module_name)
    except ConfigError:
        raise
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        if isinstance(exc, ModuleNotFoundError) and missing in (module_name, own) or \
                (missing and module_name.startswith(missing + ".")):
            raise ConfigError("entry", entry, f"cannot find module {missing} ({exc}); put the module next to the "
                                              f"job file ({base}) or on PYTHONPATH") from exc
        log_exception(log, f"the entry module {module_name} could not import one of its own dependencies", exc)
        raise ConfigError("entry", entry, f"the module was found, but it imports {missing or 'a module'}, which "
                                          f"cannot be imported: {exc}; install it where the ranks run "
                                          f"({socket.gethostname()}); the rank's log has the traceback") from exc
    except SyntaxError as exc:
        raise ConfigError("entry", entry, f"{exc.filename}:{exc.lineno}: {exc.msg}; fix the syntax there") from exc
    except Exception as exc:  # the module's own code raised while it was imported
        info = log_exception(log, f"the entry module {module_name} raised while it was imported", exc)
        raise FailStop(f"the entry module {module_name} raised {info['type']}: {info['message']} while it was "
                       f"imported ({info['file']}:{info['line']}); not requeued: fix the code and resubmit",
                       EXIT_NO_REQUEUE, cause="training-code", phase="import", frontier=None,
                       decided_at=time.monotonic(), exception=info) from exc
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError("entry", entry, f"module {module_name} has no function {fn_name}")
    return fn


def record_label(rank: int) -> str:
    """The prefix of every line of a log record a rank prints where nothing labels its output."""
    return f"[rank {rank}] "


class RankFormatter(logging.Formatter):
    """Another formatter's text with every line (a traceback's too) prefixed ``[rank R] ``."""

    def __init__(self, rank: int, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.label = record_label(rank)
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(self.label + line for line in self.inner.format(record).split("\n"))


def label_log_records(rank: int, environ: Mapping[str, str] | None = None) -> None:
    """Make the log records this rank prints (its root logger's handlers) carry its rank, unless its output is
    labelled already (``ACCELPACT_OUTPUT_LABELLED=1``: ``srun --label``, a launcher's own prefix)."""
    if settings.output_labelled(environ):
        return
    for handler in logging.getLogger().handlers:
        if not isinstance(handler.formatter, RankFormatter):
            handler.setFormatter(RankFormatter(rank, handler.formatter))


def warn_at_start(cfg: JobConfig, events: EventLog, out: TextIO) -> None:
    """Rank 0, once per start: what the job file's defaults cost that its user may not know (one line and one
    ``warning`` event each)."""
    note = snapshot_note(cfg)
    if note:
        print(f"[accelpact] warning: {note}", file=out, flush=True)
        events.emit("warning", step=None, reason=note)


def run_rank(cfg: JobConfig, ctx: SlurmContext, run_dir: str, environ: Mapping[str, str] | None = None,
             out: TextIO | None = None, job_file: str | None = None, script: ScriptSpec | None = None) -> int:
    """Run the job's entry point on this rank to its end; return the process exit code (0).

    ``entry: PATH.py:__main__`` (script mode) runs the script as ``__main__`` with ``script``'s arguments; either
    way the package's ``init()`` returns this rank's Job, checked against the values ``script`` says the job's
    side fixed (:mod:`accelpact_slurm.runtime.job.script`; None: those the job file sets).

    A stop unwinds the script as :class:`Stopped` (its ``finally`` blocks and context managers run) and ends here:
    the stop hooks, then the rank exits with the stop's code (75, 76, 2) and never returns.
    """
    try:
        return _run_rank(cfg, ctx, run_dir, environ, out, job_file, script)
    except Stopped as stop:
        exit_stopped(stop)


def _run_rank(cfg: JobConfig, ctx: SlurmContext, run_dir: str, environ: Mapping[str, str] | None,
              out: TextIO | None, job_file: str | None, script: ScriptSpec | None) -> int:
    check_dependencies()  # before joining: a node without the train extra fails now, not at the first snapshot
    # torch is imported here, not at module level, so the CLI's --help stays fast.
    import torch

    from accelpact_slurm.runtime.job.topology import init_runtime

    out = out or sys.stdout
    environ = os.environ if environ is None else environ
    label_log_records(ctx.rank, environ)
    # Noise from libraries on every rank's log, not the user's concern: torchdata's deprecated set_vital, DCP's
    # "assuming the intent is to save/load in a single process" (the daemon and the reload use no_dist on purpose).
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    faults = TestFaults.from_environ(environ)
    torch.set_num_threads(cfg.topology.threads_per_rank)
    wall0 = time.monotonic()
    events = EventLog(os.path.join(run_dir, EVENTS_FILE), job_id=ctx.job_id, restart=ctx.restart_count,
                      rank=ctx.rank, node=ctx.node_index)
    hostname = ctx.hostname or socket.gethostname()
    events.emit("process", role="rank", pid=os.getpid(), hostname=hostname)  # before joining: findable at once
    as_script = is_script_entry(cfg.entry)
    spec = script if script is not None else script_mode.spec_of(job_file)
    try:  # before joining: a bad entry fails fast on every rank
        entry = script_mode.program(cfg.entry, job_file, spec) if as_script else resolve_entry(cfg.entry, job_file)
    except FailStop as stop:  # every rank imports the same module and stops the same way: nobody to tell
        fail_stop(stop, events, out, ctx.rank == 0, None, ctx, environ)
    except ConfigError as exc:
        fail_stop(FailStop(str(exc), EXIT_USAGE, cause="config", phase="import", frontier=None,
                           decided_at=time.monotonic()), events, out, ctx.rank == 0, None, ctx, environ)

    try:  # the store admits only holders of the run's key (created by the first rank or daemon of the run)
        key = load_or_create_key(run_dir)
    except CheckpointError as exc:  # a key of another user, readable by others, or no key: a restart repeats it
        fail_stop(FailStop(f"the run's key: {exc}", EXIT_USAGE, cause="config", phase="start", frontier=None,
                           decided_at=time.monotonic()), events, out, ctx.rank == 0, None, ctx, environ)
    rt = init_runtime(ctx, cfg, environ, key=key, detect=not faults.no_detector,
                      on_warning=lambda msg: events.emit("warning", step=None, reason=msg))  # type: ignore[arg-type]
    lead = rt.rank == 0
    if lead and rt.store_server is not None:  # the job's store: a process beside rank 0 (a thread of it: its pid)
        events.emit("process", role="store", pid=getattr(rt.store_server, "pid", os.getpid()), hostname=hostname,
                    thread=not hasattr(rt.store_server, "pid"))
    if rt.standby_server is not None:  # the store's standby: a process beside node 1's first rank
        events.emit("process", role="store-standby", pid=rt.standby_server.pid, hostname=hostname)

    def announce(cfg: JobConfig) -> None:
        """Rank 0: the job's start, with the effective config (in script mode: once the script's values are in)."""
        if not lead:
            return
        events.emit("job_start", config=cfg.to_dict(), config_digest=cfg.digest(), world_size=rt.layout.world_size,
                    nodes=rt.layout.num_nodes, ranks_per_node=rt.layout.ranks_per_node,
                    hostnames=list(ctx.nodelist), run_dir=os.path.abspath(run_dir), entry=cfg.entry,
                    device=rt.hardware.device, backend=rt.hardware.backend, device_reason=rt.hardware.reason,
                    versions=rt.hardware.versions,
                    store_port=getattr(rt.data_store, "port", None))  # the candidate the job's store took
        warn_at_start(cfg, events, out)

    if not as_script:
        announce(cfg)
    events.emit("membership", local_rank=rt.local_rank, hostname=hostname,
                pid=os.getpid(), shard_ranks=rt.layout.shard_ranks(rt.node),
                replicate_ranks=rt.layout.replicate_ranks(rt.local_rank))
    check_progress(cfg, ctx, rt, run_dir, events, out)
    return train(cfg, ctx, rt, run_dir, events, out, environ, entry, faults, wall0, spec=spec,
                 announce=(lambda j: announce(j.config)) if as_script else None)


def train(cfg: JobConfig, ctx: SlurmContext, rt: Runtime, run_dir: str, events: EventLog, out: TextIO,
          environ: Mapping[str, str], entry: Callable[[Any], Any], faults: TestFaults, wall0: float, *,
          resume: Callable[[Any], None] | None = None, spec: ScriptSpec | None = None,
          announce: Callable[[Any], None] | None = None) -> int:
    """Call the entry point with this rank's :class:`~accelpact_slurm.runtime.job.api.Job` and end the job
    (collective); fails stop on anything the project raises.  ``resume``: how ``job.protect`` takes up the state
    instead of reloading the newest snapshot (a spare taking a dead rank's place heals it from the live replica:
    :mod:`accelpact_slurm.runtime.job.spare_place`).  ``spec`` and ``announce``: what the package's ``init()``
    checks and, in script mode, the job's start recorded once the script's values are in
    (:mod:`accelpact_slurm.runtime.job.script`)."""
    from accelpact_slurm.runtime.job.api import Job

    lead = rt.rank == 0
    peer_stop = _no_peer_check if faults.dead_peer_as_bug else _peer_stop

    def stop_on(exc: BaseException, phase: str = "script", frontier: int | None = None) -> NoReturn:
        """Fail stop on one of the project's own errors: a peer's death if one is gone, else its own stop."""
        fail_stop(peer_stop(exc, rt, phase, job) or as_fail_stop(exc, phase=phase, frontier=frontier), events, out,
                  lead, rt.control, ctx, environ)

    job = Job(cfg, rt, run_dir, events, out=out, faults=faults, environ=environ, stop=stop_on, resume=resume)
    script_mode.serve(job, spec if spec is not None else ScriptSpec(), announce)  # accelpact_slurm.init()
    train_t0 = time.monotonic()
    try:
        entry(job)
    except AccelpactError as exc:  # the detector (a member dead, hung or stopped), the runtime, or bad input
        stop_on(exc)
    except Exception as exc:  # the training code's own error outside an update: a restart would repeat it
        reraise()  # raised by the script's finally or hook while its stop unwound it: that stop stands
        stop = peer_stop(exc, rt, "script", job)  # unless a peer is gone: a snapshot's or a restore's
        if stop is not None:  # collective failed with it ("Connection closed by peer"): L2, naming the dead
            log_exception(log, f"rank {rt.rank} raised {type(exc).__name__} with a peer gone", exc)
            fail_stop(stop, events, out, lead, rt.control, ctx, environ)
        info = log_exception(log, f"the training code raised {type(exc).__name__} on rank {rt.rank} (outside an "
                                  f"update; the job stops, not to be requeued)", exc)
        fail_stop(FailStop(f"training code raised on rank {rt.rank}: {info['type']}: {info['message']} "
                           f"({info['file']}:{info['line']}, in {info['function']}); not requeued: fix the code and "
                           f"resubmit", EXIT_NO_REQUEUE, cause="training-code", phase="script", frontier=None,
                           decided_at=time.monotonic(), rank=rt.rank, exception=info),
                  events, out, lead, rt.control, ctx, environ)
    reraise()  # the script caught its stop and returned: the stop stands
    script_mode.announce(job)  # a script that never called accelpact_slurm.init(): its start is on record all the same
    run = job.run
    if run is None:
        how = "job = accelpact_slurm.init(steps=..., seed=...) and " if is_script_entry(cfg.entry) else ""
        fail_stop(FailStop(f"entry: the entry point {cfg.entry} returned without calling {how}job.protect(model, "
                           f"optimizer)", EXIT_USAGE, cause="config", phase="script", frontier=None,
                           decided_at=time.monotonic()), events, out, lead, rt.control, ctx, environ)
    cfg = job.config  # the script's steps and seed (accelpact_slurm.init)
    try:  # the job's end is collective too: a rank lost now fails the others stop, with the reason
        return _end(cfg, ctx, rt, run, run_dir, events, out, lead, wall0, time.monotonic() - train_t0)
    except AccelpactError as exc:
        stop_on(exc, "end", run.step)
    except Exception as exc:  # the final snapshot's or the digests' collective, failed with a peer gone
        stop = peer_stop(exc, rt, "end", job)
        if stop is None:
            raise
        log_exception(log, f"rank {rt.rank} raised {type(exc).__name__} at the job's end with a peer gone", exc)
        fail_stop(stop, events, out, lead, rt.control, ctx, environ)


def _no_peer_check(exc: BaseException, rt: Runtime, phase: str, job: Any) -> None:
    """Test-only (``ACCELPACT_TEST_DEAD_PEER_AS_BUG``): nobody asks whether a peer is gone; an exception is a bug."""
    return None


def _peer_stop(exc: BaseException, rt: Runtime, phase: str, job: Any) -> FailStop | None:
    """The L2 stop naming the dead ranks and their node when ``exc`` was raised with a peer gone (a dead peer is
    never a bug: :mod:`accelpact_slurm.runtime.detection.peers`); None when every peer lives, or for a decided stop or
    bad input."""
    if isinstance(exc, (FailStop, ConfigError, UsageError)):
        return None
    run = getattr(job, "run", None)
    return dead_peer_stop(rt.detector, rt.layout.world_size, rt.layout.ranks_per_node, exc, phase=phase,
                          frontier=run.step if run is not None else None)


def _end(cfg: JobConfig, ctx: SlurmContext, rt: Runtime, run: Run, run_dir: str, events: EventLog, out: TextIO,
         lead: bool, wall0: float, train_s: float) -> int:
    """After the entry returned on every rank: the final snapshot, verified, then the digests, the summary, the
    job's last rounds (collective).  Nothing says the job completed before its last update is on disk."""
    final = run._final()  # None: the job takes no snapshots
    if rt.detector is not None:  # before the digests' collective: every rank's lands before rank 0's job_end
        events.emit("detector", **rt.detector.summary())
    digest, model_digest = run._digests()
    wall_s = time.monotonic() - wall0
    if lead:
        summary = {
            "job_id": ctx.job_id, "final_step": run.step, "final_loss": run.losses[-1] if run.losses else None,
            "wall_s": wall_s, "train_s": train_s, "final_state_digest": digest,
            "final_model_digest": model_digest, "exit_code": EXIT_OK, "world_size": rt.layout.world_size,
            "nodes": rt.layout.num_nodes,
            "ranks_per_node": rt.layout.ranks_per_node, "restart_count": ctx.restart_count, "losses": run.losses,
            "final_snapshot": final,
        }
        write_json_atomic(os.path.join(run_dir, SUMMARY_FILE), summary)
        events.emit("job_end", final_step=run.step, final_loss=summary["final_loss"], wall_s=wall_s,
                    final_state_digest=digest, exit_code=EXIT_OK,
                    final_snapshot=None if final is None else {k: final[k] for k in ("step", "verified")})
        final = f"{summary['final_loss']:.4f}" if summary["final_loss"] is not None else "-"
        print(f"[accelpact] done: {run.step} updates in {wall_s:.1f} s, final loss {final}\n"
              f"[accelpact] final_state_digest {digest}\n"
              f"[accelpact] summary: {os.path.join(run_dir, SUMMARY_FILE)}", file=out, flush=True)
    run.close()
    if lead and cfg.topology.spare_nodes > 0:  # every parked spare exits 0 (core.spares)
        announce_end(rt.data_store, nodes=rt.layout.num_nodes, spare_count=cfg.topology.spare_nodes)
    if rt.detector is not None:  # a peer that sees this rank's process end now knows it finished, not died
        rt.detector.publish_stop({"cause": "completed", "reason": "the job finished", "exit_code": EXIT_OK})
    rt.control.barrier("job-end")
    rt.control.leave("job-end", cfg.timeouts.shutdown_s)
    events.close()
    rt.close()
    return EXIT_OK
