"""The public API: what a training script written against the project sees.

``accelpact-run JOB.yaml`` calls the job file's ``entry: module:function`` on every rank with a :class:`Job`; the
script wraps its own model on ``job.mesh`` and hands model, optimizer, scheduler and data loader to
:meth:`Job.protect`, which returns a :class:`Run`; the loop stays the script's own (``for batch in
run.batches(loader): with run.update() as update: ...``).  Every rank makes the same calls in the same order:
:meth:`Job.protect` once (collective: it reloads the newest verified snapshot), then :meth:`Run.batches` and
:meth:`Run.update` per update, :meth:`Run.save` (collective) between updates; when the entry point returns, the
runtime snapshots the last update, writes the summary and calls :meth:`Run.close`.  ``docs/api.md`` documents
every public name, with an example.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, NoReturn, TextIO

import torch

from accelpact_slurm.core import settings
from accelpact_slurm.core.config import JobConfig
from accelpact_slurm.core.errors import (EXIT_REQUEUE, CollectiveAbandoned, ControlPlaneError, FailStop, Stopped,
                                         UsageError)
from accelpact_slurm.core.events import EVENTS_FILE, EventLog, read_events
from accelpact_slurm.core.faults import NO_FAULTS, TestFaults
from accelpact_slurm.runtime.state import appstate, buddy_ring, replay
from accelpact_slurm.runtime.job import envelope as env_mod, footprint, stopping
from accelpact_slurm.runtime.state.buffers import forward_state
from accelpact_slurm.runtime.job.phases import (TRAINING_CODE, PhaseTracker, Redo, Withheld, communication_fault,
                                                log_exception)
from accelpact_slurm.runtime.state.sampler import ShardedSampler
from accelpact_slurm.runtime.job.stopping import as_fail_stop, fail_stop, reraise, stop_for_requeue
from accelpact_slurm.repair import torch_compat as tc
from accelpact_slurm.runtime.job.heal_run import SurvivorHeal, snapshot_after_commit
from accelpact_slurm.runtime.job.recovery import build_guard
from accelpact_slurm.runtime.state.restore import restore
from accelpact_slurm.runtime.state.digest import state_digests
from ckpt_service.auth import load_key, load_or_create_key
from ckpt_service.client import SnapshotClient
from ckpt_service.layout import step_of as snapshot_step
from accelpact_slurm.runtime.state.saving import refusal, settle

if TYPE_CHECKING:
    from accelpact_slurm.runtime.job.topology import Runtime

log = logging.getLogger(__name__)

__all__ = ["Job", "Run", "Update", "Stopped"]

_END = object()
#: How torch words the error of an op without a deterministic implementation under use_deterministic_algorithms.
NONDETERMINISTIC = "does not have a deterministic implementation"


class Job:
    """One rank's view of the job: who it is, the mesh to wrap on, where things go.  Built by the runtime.

    Attributes:
        rank, world_size, node, num_nodes, local_rank, ranks_per_node: this rank's place; rank ``r``
            sits on node ``r // ranks_per_node``.
        device: the device to train on: ``cuda:N`` (one GPU per rank, NCCL data plane) or ``cpu`` (Gloo), from
            the job file's ``topology.device`` and the allocation (``docs/gpus.md``).
        mesh: the 2-D ``DeviceMesh`` with dims ``("replicate", "shard")`` (nodes x ranks of a node).
        groups: ``(shard_group, replicate_group)``, the explicit pair for FSDP1 ``process_group=``: always the
            live groups (an L1 repair may replace them; read ``job.groups`` again rather than keeping the tuple).
        run_dir: the job's run directory (shared by all nodes); events: its event log.
        params: the job file's free-form ``params`` section; seed, steps: the job file's values.
        config: the project's effective configuration (read-only).
    """

    def __init__(self, cfg: JobConfig, rt: Runtime, run_dir: str, events: EventLog, *, out: TextIO,
                 faults: TestFaults = NO_FAULTS, environ: Mapping[str, str] | None = None,
                 stop: Callable[[BaseException], Any] = lambda exc: None,
                 resume: Callable[["Run"], None] | None = None) -> None:
        self.config = cfg
        #: How ``protect`` takes up the state: None reloads the newest verified snapshot; a spare that took a dead
        #: rank's place heals it from the live replica instead (:class:`..heal_run.SpareResume`).
        self._resume = resume
        #: Fails the rank stop on a stop or a lost control plane (the entry's rule), raising ``Stopped``.
        self._stop = stop
        self._rt = rt
        self._out = out
        self._faults = faults
        self._environ = environ
        self.rank, self.world_size = rt.rank, rt.layout.world_size
        self.node, self.num_nodes = rt.node, rt.layout.num_nodes
        self.local_rank, self.ranks_per_node = rt.local_rank, rt.layout.ranks_per_node
        self.device = torch.device(getattr(rt, "device", "cpu"))
        self.mesh = rt.mesh
        self.run_dir = run_dir
        self.events = events
        self.params: dict[str, Any] = dict(cfg.params)
        self.seed, self.steps = cfg.seed, cfg.steps
        self.run: Run | None = None

    @property
    def groups(self) -> tuple[Any, Any]:
        """``(shard_group, replicate_group)`` as they are now: an L1 repair may have replaced the ones of the start."""
        return self._rt.shard_group, self._rt.replicate_group

    def _fail_stop(self, stop: FailStop) -> NoReturn:
        fail_stop(stop, self.events, self._out, self.is_lead, self._rt.control, self._rt.ctx, self._environ)

    @property
    def is_lead(self) -> bool:
        """True on rank 0 (which writes the job-level events and prints progress)."""
        return self.rank == 0

    def log(self, message: str) -> None:
        """Print one progress line on rank 0."""
        if self.is_lead:
            print(f"[accelpact] {message}", file=self._out, flush=True)

    def on_stop(self, hook: Callable[[Stopped], Any]) -> None:
        """Call ``hook(stop)`` (a :class:`Stopped`) once when the job stops this rank, after the script unwound and
        before the rank exits, to flush the script's own logs.  Hooks run in order on a thread of their own, within
        ``STOP_HOOKS_S`` all together; an error in one is logged, never changes the exit code (``docs/api.md``)."""
        if not callable(hook):
            raise UsageError("job.on_stop", hook, "pass a function taking one argument, the Stopped")
        stopping.on_stop(hook)

    def sampler(self, dataset: Any, *, shuffle: bool = True, seed: int | None = None,
                drop_last: bool = True) -> ShardedSampler:
        """A deterministic, resumable sampler giving this rank its share of a map-style ``dataset``."""
        return ShardedSampler(dataset, rank=self.rank, world_size=self.world_size, shuffle=shuffle,
                              seed=self.seed if seed is None else seed, drop_last=drop_last)

    def protect(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
                state: Mapping[str, Any] | None = None, exact: bool = True) -> "Run":
        """Collective, once per rank: guard ``model`` and ``optimizer``, snapshot them with ``scheduler`` and
        every ``Stateful`` in ``state``, and reload the newest verified snapshot if there is one.

        ``exact=True`` (the default) promises bitwise recovery, so every op must be deterministic
        (``torch.use_deterministic_algorithms(True)`` is set; an op without a deterministic implementation
        stops the job with a :class:`UsageError` naming it).  ``exact=False`` leaves that to the script.
        """
        if self.run is not None:
            raise UsageError("job.protect", "a second call", "call job.protect once per job, after wrapping")
        if exact:
            torch.use_deterministic_algorithms(True)
        try:
            self.run = Run(self, model, optimizer, scheduler, dict(state or {}), exact=exact)
        except (FailStop, ControlPlaneError) as exc:  # reaches the script as Stopped, never as an Exception
            self._stop(exc)
            raise
        return self.run


class Update:
    """The context of one update (``with run.update() as update``).

    Attributes:
        step: the number of the update this context runs (``run.step + 1``).
        loss: set it to report the update's loss on this rank, **before** ``optimizer.step()``: it is read at the
            vote taken there (or at the update's end when the update never steps).  Setting it after the vote
            raises :class:`UsageError` (a loss set late would never be reported).
    """

    def __init__(self, run: "Run") -> None:
        self._run = run
        self.step = run.step + 1  # the update this context runs (F + 1)
        self._loss: Any = None
        self._redoable = run._take_yielded()  # its batch came from run.batches: it can run again
        self._rng: Any = None
        self._decided: str | None = None  # the vote's outcome once taken (continue | redo)
        self._mean: float | None = None
        self._need_fp = False
        self._exception: dict[str, Any] | None = None  # a training-code error of this update, described

    @property
    def loss(self) -> Any:
        return self._loss

    @loss.setter
    def loss(self, value: Any) -> None:
        if self._decided is not None:
            raise UsageError("update.loss", "set after optimizer.step()",
                             f"set update.loss before optimizer.step(): the loss of update {self.step} travels in "
                             f"the vote taken at the step, so a loss set later is never reported")
        self._loss = value

    def __enter__(self) -> "Update":
        job = self._run.job
        job._faults.at_update_start(self.step, job.rank)  # a test's crash or hang; nothing otherwise
        self._rng = appstate.rng_snapshot()  # an update discarded by L1 runs again with these
        self._run._forward.keep()  # and over these buffers (batch-norm statistics its forward changes)
        self._run._current = self
        self._run._tracker.begin(self.step)
        return self

    def __exit__(self, et: Any, ev: BaseException | None, tb: Any) -> bool:
        try:
            return self._run._finish(self, ev)
        except (FailStop, ControlPlaneError) as exc:  # the commit's snapshot, the requeue stop
            self._run._stopped(exc)
            raise


class Run:
    """What :meth:`Job.protect` returns: the loop's side of the guarantees.

    Attributes:
        job: the :class:`Job` it belongs to.
        step: committed updates so far (the frontier F); epoch: passes over the data so far;
        losses: the job's mean reported loss of every committed update (None where none was reported).
    """

    def __init__(self, job: Job, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                 state: dict[str, Any], *, exact: bool = True) -> None:
        self.job = job
        self._model, self._optimizer = model, optimizer
        self._exact = exact
        rt, cfg = job._rt, job.config
        try:
            self._wrapping = tc.wrapping(model)
        except ValueError as exc:
            raise UsageError("model", type(model).__name__, str(exc)) from None
        if self._wrapping[0] == "fsdp2":  # a reduce-scatter group of its own (set_separate_reduce_scatter_group) is
            for pg in tc.fsdp2_separate_reduce_scatter_groups(model):  # created with Gloo's 30-min default
                tc.set_group_timeout(pg, rt.collective_timeout_s)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UsageError("optimizer", type(optimizer).__name__, "pass a torch.optim.Optimizer over model.parameters()")
        self._statefuls = appstate.statefuls(scheduler, state)
        self._forward = forward_state(model, job._faults)
        #: What a test's negative controls turn off, picked here, not branched on where it runs.
        self._checked = not job._faults.skip_reload_check  # restore re-checks checksums; the replay check runs
        self._rng_restore = appstate.rng_restore if not job._faults.skip_redo_rng else appstate.keep_rng
        self._extra_restore = self._restore_extra if not job._faults.skip_extra_restore else appstate.skip_extra
        self.step, self.epoch = 0, 0
        self.losses: list[float | None] = []
        # RNG states are the project's: every rank draws its own stream from the job's seed (a reload overrides it).
        appstate.seed_all(job.seed * 1000 + job.rank + 1)
        self._guard = build_guard(cfg, rt, model, job.events, self._wrapping, faults=job._faults,
                                  environ=job._environ, out=job._out)
        detector = getattr(rt, "detector", None)
        self._tracker = PhaseTracker(model, optimizer, self._guard.injector, fsdp=self._wrapping[0],
                                     state=getattr(detector, "state", None), detector=detector,
                                     slow=job._faults.slow_forward(job.rank),
                                     lose_node=lambda phase, step: job._faults.kill_node_at(phase, step, job.node))
        self._tracker.decide = lambda: self._decide(self._current, None, None) if self._current else "continue"
        self._snapshots = SnapshotClient(cfg, rt, job.run_dir, job.events, model, optimizer, self._extra,
                                         faults=job._faults)
        self._ring = buddy_ring.ring_for(cfg.topology.spare_nodes, getattr(rt, "data_store", None), model, job.rank,
                                         self._statefuls, heal_fault=job._faults.heal_fault)
        if job._resume is None:  # collective; a spare taking a place joins the job without it
            footprint.check(model, optimizer, job, snapshots=cfg.checkpoint.every_steps > 0)  # before an OOM
        #: Spare nodes: the survivors' side of a heal when a node is lost (:mod:`..heal_run`).
        self._healer = SurvivorHeal(self, load_or_create_key(job.run_dir)) if cfg.topology.spare_nodes > 0 else None
        self._replay: tuple[int, dict[str, Any] | None] | None = None
        self._warned_no_step = self._warned_late_loss = False
        self._yielded = False  # run.batches yielded an item the next update may run again
        self._redo = False  # the last update was discarded: run.batches yields its batch again
        self._current: Update | None = None
        self._loaded_step: int | None = None  # the step this start reloaded (verified by the reload's rule)
        self._closed = False
        self._voting = False
        key = self._guard.key_for("committed")
        if job.is_lead:
            job.events.emit("protected", platform=key.platform, profile=key.profile, fsdp=self._wrapping[0],
                            mesh=self._wrapping[1], state=sorted(self._statefuls))
            if not settings.qualifying(job._environ):  # a trial's envelope holds its own phase only
                note = env_mod.coverage_note(self._guard.envelope, self._guard.key_for)
                if note:  # said at the start, not first at a fault
                    print(f"[accelpact] warning: {note}", file=job._out, flush=True)
                    job.events.emit("warning", step=None, reason=note)
        loaded: int | None = None
        if job._resume is not None:  # a spare in a dead rank's place: healed from the live replica, not reloaded
            job._resume(self)
        else:
            try:
                loaded = restore(rt, cfg, job.run_dir, self._load, job.events, check=self._checked,
                                 copy=not job._faults.no_restore_copy, model=self._model).step
            except FailStop as stop:  # no snapshot can be restored (76), or the requeue its exit code asks for
                job._fail_stop(stop)
        self._loaded_step = loaded
        if loaded is not None and self._checked:
            ref = None
            if job.is_lead:
                ref = replay.find_reference(read_events(f"{job.run_dir}/{EVENTS_FILE}"), loaded,
                                            load_key(job.run_dir))
            self._replay = (loaded, rt.control.broadcast("replay-ref", ref))
        self._t_last = time.monotonic()
        if job.is_lead:
            start = f", resumed at update {self.step}" if self.step else ""
            print(f"[accelpact] job {rt.ctx.job_id}: {rt.layout.num_nodes} nodes x {rt.layout.ranks_per_node} ranks, "
                  f"{self._wrapping[0]} {self._wrapping[1]}, {job.steps} updates{start}, run dir {job.run_dir}",
                  file=job._out, flush=True)
        if detector is not None:  # a stop found in a collective the training code waits on: raised as Stopped
            detector.stop_hook = (threading.get_ident(), self._stopped)

    # ------------------------------------------------------------------ the loop

    def batches(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield ``iterable``'s items, pass after pass (``set_epoch`` on its sampler), until ``job.steps`` updates."""
        empty = 0
        while self.step < self.job.steps:
            sampler = getattr(iterable, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            # A data loader draws a seed from the global RNG when its iterator starts (on iter(), or on the
            # first next() of a lazy wrapper).  A resumed run starts one mid-pass where the first run did not:
            # the start of every pass must leave the training RNG (dropout) where it was.
            rng = torch.get_rng_state()
            it = iter(iterable)
            first = next(it, _END)
            torch.set_rng_state(rng)
            got = first is not _END
            if got:
                yield from self._again(first)
                if self.step >= self.job.steps:
                    return
                for item in it:
                    yield from self._again(item)
                    if self.step >= self.job.steps:
                        return
            empty = 0 if got else empty + 1
            if empty >= 2:
                raise UsageError("run.batches", type(iterable).__name__,
                                 f"the iterable yielded nothing in epochs {self.epoch - 1} and {self.epoch}: "
                                 f"pass a data loader with at least one batch per rank")
            self.epoch += 1

    def _again(self, item: Any) -> Iterator[Any]:
        """Yield ``item``, and again as long as the update that used it was discarded by an L1 repair."""
        while True:
            self._yielded = True
            yield item
            if not self._redo:
                return
            self._redo = False

    def _take_yielded(self) -> bool:
        got, self._yielded = self._yielded, False
        return got

    def update(self) -> Update:
        """The context of one update: forward, backward and ``optimizer.step`` go inside it."""
        reraise()  # the script caught its stop and went on: the stop stands
        if self._closed:
            raise UsageError("run.update", "called after run.close()", "close the run after its last update")
        return Update(self)

    def save(self) -> bool:
        """Collective, between updates: snapshot the committed update ``run.step`` now and wait until every node's
        checkpoint daemon has verified it; True when it is verified on every node.

        Every rank calls it at the same boundary.  Nothing is taken again when this start already has a snapshot
        of ``run.step`` (the cadence's, an earlier call) or loaded it.  A snapshot that is not verified on every
        node is not an error: False, with one line and a ``saved`` event saying why.

        Raises:
            UsageError: ``run.save()`` called inside an update (its ``with run.update()`` block open), after
                :meth:`close`, before the first update, or on a job without snapshots (``checkpoint.every_steps`` 0).
        """
        inside = self._current.step if self._current is not None else None
        refused = refusal(closed=self._closed, inside=inside, every_steps=self.job.config.checkpoint.every_steps,
                          step=self.step)
        if refused is not None:
            raise UsageError("run.save()", *refused)
        try:
            return self._settle("run.save")["verified"]
        except (FailStop, ControlPlaneError) as exc:
            self._stopped(exc)
            raise

    def _final(self) -> dict[str, Any] | None:
        """Collective, at the job's end (before the digests and ``job_end``): the snapshot of the last committed
        update, verified (:mod:`..state.saving`); None when the job takes no snapshots, does not want one at its end
        (``checkpoint.at_end: false``) or committed no update."""
        c = self.job.config.checkpoint
        if c.every_steps <= 0 or not c.at_end or self.step <= 0:
            return None
        return self._settle("final")

    def _settle(self, trigger: str) -> dict[str, Any]:
        job = self.job
        return settle(job._rt, job.config, self._snapshots, job.events, job._out, self.step, trigger,
                      loaded=self.step == self._loaded_step)

    def close(self) -> None:
        """Release the snapshot client (its staging slots), the phase hooks and the repair engine's background
        aborts.  The runtime calls it after the entry point returns (again: nothing); no update may run after it."""
        if self._closed:
            return
        self._closed = True
        if getattr(self.job._rt, "detector", None) is not None:  # the rank's end: the project's own collectives
            self.job._rt.detector.stop_hook = None
        self._snapshots.close()
        self._tracker.close()
        left = self._guard.engine.close(self.job.config.timeouts.shutdown_s)  # retired NCCL communicators
        if left:  # pragma: no cover - GPU only
            log.warning("%d retired communicator(s) still aborting at the end of the job", left)

    def _digests(self) -> tuple[str | None, str | None]:
        """Collective: ``(final_state_digest, final_model_digest)`` (:mod:`..state.digest`)."""
        return state_digests(self.job._rt, self._model, self._optimizer, self._statefuls, self._forward,
                             self.step, self.epoch)

    # ------------------------------------------------------------------ state

    def _extra(self) -> dict[str, Any]:
        """This rank's non-tensor state for a snapshot (JSON-able), with the buffers only this rank holds.  The
        loss history is the same on every rank and the snapshot keeps rank 0's ``run`` only: only rank 0 sends it,
        so the other ranks' part stays O(1) in the number of updates."""
        run: dict[str, Any] = {"step": self.step, "epoch": self.epoch}
        if self.job.rank == 0:
            run["losses"] = list(self.losses)
        rank = {"rng": appstate.rng_state(),
                "state": {n: appstate.encode(o.state_dict(), f"state[{n!r}]") for n, o in self._statefuls.items()}}
        own = self._forward.per_rank()
        if own:  # batch-norm statistics: the sharded state dict holds one copy of a buffer
            rank["buffers"] = appstate.encode(own, "buffers")
        return {"run": run, "rank": rank}

    def _load(self, path: str) -> dict[str, Any]:
        """Collective: load one snapshot into the model, the optimizer and the extra state; the seconds of its parts."""
        verified = self._checked
        self.job._faults.kill_node_at("restore", snapshot_step(path), self.job._rt.node)
        parts: dict[str, Any] = {}
        doc = appstate.load(self._model, self._optimizer, path, load_key(self.job.run_dir) if verified else None,
                            verified=verified, parts=parts, control=self.job._rt.control)
        run = doc["run"]
        self.step, self.epoch = int(run["step"]), int(run["epoch"])
        self.losses = [None if x is None else float(x) for x in run["losses"]]
        mine, rng = appstate.rank_state(doc["ranks"], self.job.rank, self.job.seed, self.step)
        self._extra_restore(path, mine, rng)
        return parts

    def _restore_extra(self, path: str, mine: dict[str, Any], rng: dict[str, Any]) -> None:
        """This rank's RNG, Stateful states and own buffers from the snapshot at ``path``."""
        appstate.set_rng_state(rng)
        for name, obj in self._statefuls.items():
            if name in mine["state"]:
                obj.load_state_dict(appstate.decode(mine["state"][name]))
        if "buffers" in mine:
            missing = self._forward.load(appstate.decode(mine["buffers"]))
            if missing:
                log.warning("snapshot %s holds buffers this model does not have: %s", path, ", ".join(missing[:5]))

    # ------------------------------------------------------------------ the end of an update

    def _stopped(self, exc: BaseException) -> None:
        """A stop on its way into the script (the detector's, the control plane's): the rank fails stop, raising
        ``Stopped`` (a script's ``except Exception`` cannot swallow it); not in the vote, whose guard and repair take
        a stop found in their own collectives.  With spare nodes, a rank gone in the middle of an update is a fault
        of that update instead: its vote then heals the lost node or fails stop (:mod:`..heal_run`)."""
        if self._healer is not None and self._current is not None and not self._current._decided \
                and isinstance(exc, FailStop) and self._healer.covers(exc):
            raise CollectiveAbandoned(f"a member of the collective is gone: {exc.reason}")
        if not self._voting:
            self._current = None
            self._tracker.end()
            self.job._stop(exc)

    def _vote(self, *args: Any, **kwargs: Any) -> tuple[str, float | None, list[str | None]]:
        self._voting = True
        try:
            return self._guard.decide(*args, **kwargs)
        finally:
            self._voting = False

    def _decide(self, update: Update, fault: str | None, error: str | None) -> str:
        """The update's one vote (collective): at its first ``optimizer.step``, or at its end when it raised or
        never stepped.  Returns ``continue`` or ``redo``; fails stop (raises ``Stopped``) on a Restart decision."""
        job, rt = self.job, self.job._rt
        detector = getattr(rt, "detector", None)
        latched = detector.take_latched() if detector is not None else None
        if latched and not fault:  # a collective given up whose error the training code swallowed
            fault, error = latched
        loss = None if fault else appstate.loss_value(update._loss)
        if update._loss is None and not fault and self.losses and self.losses[-1] is not None \
                and not self._warned_late_loss:
            self._warned_late_loss = True
            log.warning("update %d reached optimizer.step() without update.loss: set it before the step "
                        "(the loss travels in the vote taken there)", update.step)
        update._need_fp = not fault and (self.step in self._snapshots.taken or self._replay is not None)
        extra = {"fp": replay.fingerprint(self._model, self._optimizer)} if update._need_fp else None
        try:
            outcome, mean, fps = self._vote(update.step, fault, error, loss, extra,
                                                    redoable=update._redoable, optimizer=self._optimizer,
                                                    exception=update._exception)
        except (FailStop, ControlPlaneError) as exc:  # a Restart decision, or no vote could be taken at all
            stop = as_fail_stop(exc, phase=self._tracker.phase, frontier=self.step)
            if self._healer is None or not self._healer.covers(stop):
                job._fail_stop(stop)
            self._healer.heal_or_stop(stop, update.step)  # spare nodes: a lost node healed, the update runs again
            outcome, mean, fps = "redo", None, []
        update._decided, update._mean = outcome, mean
        if outcome == "redo":
            self._rng_restore(update._rng)
            self._forward.restore()
            self._redo = True
            return outcome
        self._ring.at_vote(update.step, self.epoch)  # spare nodes: the packet of the state this update commits
        if update._need_fp:
            self._replay_bookkeeping(self.step, update.step, mean, fps)
        return outcome

    def _finish(self, update: Update, ev: BaseException | None) -> bool:
        job, rt, tracker = self.job, self.job._rt, self._tracker
        self._current = None
        fault = error = None
        phase = tracker.phase
        tracker.end()
        reraise()  # the script caught its stop inside the update and went on: the stop stands
        if isinstance(ev, Redo):
            return True  # the vote discarded the update: run.batches yields its batch again
        if update._decided == "redo" and ev is None:  # the script caught the Redo raised out of optimizer.step()
            raise UsageError("optimizer.step()", f"its Redo caught by the script in update {update.step}",
                             "let accelpact_slurm's Redo leave the update (it is a BaseException: catch Exception, "
                             "not BaseException, around optimizer.step()); the update is discarded and runs again")
        if ev is not None:
            if isinstance(ev, FailStop):  # the detector: a member is dead, hung or stopped (no vote can complete)
                job._fail_stop(ev)
            if not isinstance(ev, Exception) or isinstance(ev, UsageError):
                return False  # KeyboardInterrupt, SystemExit, a Stopped, the API's own usage errors: not a fault
            if isinstance(ev, RuntimeError) and NONDETERMINISTIC in str(ev):
                op = str(ev).split(NONDETERMINISTIC)[0].strip() or "an op"
                raise UsageError("model", op, "it has no deterministic implementation, and exact recovery needs "
                                              "every op deterministic: use another op, or job.protect(..., "
                                              "exact=False) to give up bitwise recovery") from ev
            fault = phase if phase != "committed" else "forward"
            if not communication_fault(ev):  # the training code's own error: a redo or a restart fails the same way
                fault = TRAINING_CODE
                update._exception = log_exception(
                    log, f"update {update.step}: the training code raised {type(ev).__name__} on rank {job.rank} "
                         f"(the job stops, not to be requeued)", ev)
                if job.events is not None:
                    job.events.emit("fault", phase=TRAINING_CODE, step=update.step, fault_rank=job.rank,
                                    error=f"{type(ev).__name__}: {update._exception['message']}",
                                    frontier=self.step, exception=update._exception)
            elif update._decided:  # after the vote (in the optimizer step or later): peers may have stepped
                fault = "optimizer"
            if isinstance(ev, Withheld):
                error = f"injected fault: rank {job.rank} withheld its part in {ev.args[0]} of update {update.step}"
            else:
                error = f"{type(ev).__name__}: {(str(ev).splitlines() or [''])[0][:300]}"
            if update._decided:
                # Vote again with the old frontier: the others' next vote reports the new one, and the
                # frontier mismatch fails every rank stop (no rank can repair a state it does not share).
                try:
                    self._vote(update.step, fault, error, None, None, redoable=False,
                                       exception=update._exception)
                except FailStop as stop:
                    job._fail_stop(stop)
                raise AssertionError("unreachable: a fault after the vote always fails stop")  # pragma: no cover
        elif not tracker.stepped and not self._warned_no_step:
            # A gradient scaler skips the step when it finds inf/NaN gradients; anything else is a loop that
            # forgot optimizer.step().  Either way the update commits; say it once.
            self._warned_no_step = True
            log.warning("update %d ended without optimizer.step() (a skipped fp16 step, or a missing call)",
                        update.step)
            if job.is_lead:
                job.events.emit("warning", step=update.step, reason="update ended without optimizer.step()")
        if not update._decided:
            if self._decide(update, fault, error) == "redo":
                return True
        mean = update._mean
        self.step = update.step
        self.losses.append(mean)
        now = time.monotonic()
        dt, self._t_last = now - self._t_last, now
        if job.is_lead:
            job.events.emit("step", step=self.step, loss=mean, step_s=dt)
            if self.step % job.config.log_every == 0 or self.step == job.steps:
                shown = f"{mean:.4f}" if mean is not None else "-"
                print(f"[accelpact] step {self.step:>5}/{job.steps}  loss {shown}  ({dt * 1000:.0f} ms/update)",
                      file=job._out, flush=True)
        self._ring.after_commit(self.step, self.epoch)  # spare nodes: what changed since the vote, first
        snapshot_after_commit(self)  # spare nodes: a node lost in the snapshot's collectives is healed
        if self._guard.stop_requested and self.step < job.steps:
            stop_for_requeue(self.step, job.config, rt.ctx, rt, self._snapshots, job.events, job._out)
        self._t_last = time.monotonic()
        return True

    def _replay_bookkeeping(self, prev: int, step: int, mean: float | None, fps: list[str | None]) -> None:
        """Record the update after a snapshot; check the first update after a load (:mod:`..state.replay`).  At the
        vote: ``fps`` fingerprint each rank's weights, optimizer state and reduced gradients (they decide the step)."""
        job, rt = self.job, self.job._rt
        layout = [rt.layout.num_nodes, rt.layout.ranks_per_node]
        record = prev in self._snapshots.taken
        if self._replay is not None:
            snap, ref = self._replay
            self._replay = None
            verdict, why = replay.judge(ref, mean, fps, layout) if self._exact else (
                "unconfirmed", "job.protect(..., exact=False): the first update after a load is not compared bitwise")
            record = record or verdict == "unconfirmed"
            if job.is_lead:
                job.events.emit("replay_check", snapshot=snap, step=step, verdict=verdict, reason=why)
                print(f"[accelpact] replay check of snapshot {snap}: {verdict}: {why}", file=job._out, flush=True)
            if verdict == "mismatch":
                replay.reject_loaded(rt, job.config, job.run_dir, snap, why, job.events)
                job._fail_stop(FailStop(f"snapshot {snap} rejected: {why}", EXIT_REQUEUE, cause="checkpoint",
                                        phase="replay", frontier=snap, decided_at=time.monotonic()))
        if record and job.is_lead:
            ref = {"snapshot": prev, "step": step, "loss": mean, "fingerprints": fps, "layout": layout}
            # MAC'd under the run's key: a line another user appends to the log cannot reject the snapshot
            job.events.emit("replay_ref", **ref, mac=replay.ref_mac(load_or_create_key(job.run_dir), ref))
