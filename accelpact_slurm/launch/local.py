"""The embedded default: run a job's ranks as local processes with an emulated Slurm environment.

Outside Slurm, ``accelpact-run`` calls :func:`launch_local`, which starts one process per rank
(``nodes x ranks_per_node`` of the job file), each seeing the variables ``srun --nodes=N --ntasks-per-node=R`` would
give it, and supervises them: when one rank fails, the others get ``timeouts.shutdown_s`` to stop on their own (at
least long enough to name a rank that died without a witness: :func:`lost_rank_grace`), then SIGTERM, then SIGKILL.
Each rank runs the worker entry (``python -m accelpact_slurm.cli.worker``, as under the sbatch template).  Rank 0's
output goes to the terminal, every line labelled ``0: `` as ``srun --label`` writes it; every rank's output is also
kept under ``RUN_DIR/logs/``.  What a start's exit means (relaunch in place what Slurm would requeue, or stop) is
:func:`accelpact_slurm.launch.core.exit_verdict` and :func:`~accelpact_slurm.launch.core.relaunch_in_place`.  Once a
start's ranks and daemons are gone, however they ended (``kill -9`` included), the shared-memory staging a daemon
could not drop itself is removed.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, TextIO

from accelpact_slurm.core.config import JobConfig, relaunch_resumes
from accelpact_slurm.core.errors import EXIT_NO_REQUEUE, LaunchError
from accelpact_slurm.core.faults import TestFaults
from accelpact_slurm.slurm.requeue import repeated_failure
from accelpact_slurm.core import settings
from accelpact_slurm.launch.core import (  # noqa: F401 - combine_exit_codes: also this module's API
    DONE, RELAUNCH, STOP, LabelledWriter, combine_exit_codes, exit_verdict, rank_label, relaunch_in_place)
from accelpact_slurm.launch.ranks import WORKER_MODULE, rank_environ
from accelpact_slurm.core.events import EVENTS_FILE, EventLog, read_events
from accelpact_slurm.core.safeopen import open_regular, open_writable
from accelpact_slurm.runtime.job.entry import record_label
from accelpact_slurm.launch.daemons import drop_leftover_staging, restart_exited, start_local_daemons, stop_daemons
from accelpact_slurm.launch.spares import SpareProcess, TakenPlaces, start_local_spares, stop_spares
from accelpact_slurm.launch.zygote import Zygote
from accelpact_slurm.ops.stops import read_tail
from accelpact_slurm.runtime.detection.liveness import dump_stacks
from accelpact_slurm.runtime.detection.peers import SLACK_INTERVALS

log = logging.getLogger(__name__)

POLL_S = 0.05
#: How often the supervision reads the event log's new lines for spares that took a rank's place (jobs with spares).
TAKEN_LOOK_S = 0.25


def free_port() -> int:
    """A TCP port that was free a moment ago on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> tuple[int, int]:
    """Two distinct free ports: the data plane's store and the control plane's."""
    data_port = free_port()
    control_port = free_port()
    while control_port == data_port:
        control_port = free_port()
    return data_port, control_port


@dataclass
class RankProcess:
    rank: int
    proc: Any  # subprocess.Popen, or a zygote's Forked (the same interface)
    log_path: str
    pump: threading.Thread | None = None
    done: threading.Event | None = None  # tells a log follower (rank 0's echo) that the rank has ended


def _follow(path: str, echo: TextIO, done: threading.Event, label: str = "", drop: str = "", pos: int = 0) -> None:
    """Echo what a rank appends to its log file from byte ``pos`` on, each line after ``label`` (``drop`` left
    out), until it has ended (a forked rank writes its log itself)."""
    echo = LabelledWriter(echo, label, drop) if label else echo
    while True:
        ended = done.is_set()
        try:  # a regular file only, never through a link (a FIFO there must not block the echo: core.safeopen)
            fd, _st = open_regular(path)
            with os.fdopen(fd, "rb") as fh:
                fh.seek(pos)
                data = fh.read()
        except FileNotFoundError:
            data = b""
        if data:
            pos += len(data)
            echo.write(data.decode(errors="replace"))
            echo.flush()
        if ended:
            return
        done.wait(POLL_S)


def _pump(src, dst_file, echo: TextIO | None, label: str = "", drop: str = "") -> None:
    """Copy a rank's output to its log file and, for rank 0, to the terminal (each line after ``label``,
    ``drop`` left out)."""
    if echo is not None and label:
        echo = LabelledWriter(echo, label, drop)
    with os.fdopen(open_writable(dst_file, append=True, mode=0o644)[0], "ab") as fh:  # never through a link
        for line in iter(src.readline, b""):
            fh.write(line)
            fh.flush()
            if echo is not None:
                echo.write(line.decode(errors="replace"))
                echo.flush()


def job_id_for(environ: Mapping[str, str]) -> str:
    """The embedded default's job id: ``ACCELPACT_LOCAL_JOB_ID``, else ``local-<pid of the launcher>``."""
    return settings.local_job_id(environ) or f"local-{os.getpid()}"


def run_local(config_path: str, cfg: JobConfig, run_dir: str, worker_args: Sequence[str] = (),
              environ: Mapping[str, str] | None = None, out: TextIO | None = None) -> int:
    """The embedded default's whole job: launch, and relaunch on "requeue me" as Slurm would.

    Each relaunch is a new start with the next restart count (``SLURM_RESTART_COUNT``);
    the ranks reload the newest verified snapshot themselves.  Stops on success, on
    "do not requeue", or after ``recovery.max_restarts`` relaunches.
    """
    out = out or sys.stdout
    environ = dict(os.environ if environ is None else environ)
    job_id = job_id_for(environ)
    zygote = start_zygote(environ)  # one per job: its imports serve every start
    try:
        # the negative control (ACCELPACT_TEST_RETRY_REPEATED) compares no two starts
        repeated = _never_repeated if TestFaults.from_environ(environ).retry_repeated else repeated_failure
        return _relaunch(config_path, cfg, run_dir, worker_args, environ, out, job_id, zygote, repeated)
    finally:
        if zygote is not None:
            zygote.close()


def start_zygote(environ: Mapping[str, str]) -> Any:
    """The job's rank zygote (:mod:`.zygote`), or None where it cannot start (ranks are then plain subprocesses)."""
    if not settings.zygote(environ):
        return None

    try:
        return Zygote(environ)
    except OSError as exc:
        log.warning("ranks start as plain processes: %s", exc)
        return None


def _never_repeated(events: Any, restart: int) -> None:
    """Test-only (``ACCELPACT_TEST_RETRY_REPEATED``): no failure counts as repeated."""
    return None


def _relaunch(config_path: str, cfg: JobConfig, run_dir: str, worker_args: Sequence[str], environ: dict[str, str],
              out: TextIO, job_id: str, zygote: Any, repeated: Any = repeated_failure) -> int:
    restart = 0
    while True:
        stopped: list[bool] = []
        code = launch_local(config_path, cfg, run_dir, worker_args, environ, out, job_id, restart, zygote=zygote,
                            stopped=stopped)
        verdict = exit_verdict(code, ending=bool(stopped), slurm=False)
        again, reason = relaunch_in_place(verdict, restart, cfg.recovery.max_restarts)
        why = repeated(read_events(os.path.join(run_dir, EVENTS_FILE)), restart) if again else None
        if why:  # a deterministic failure (an OOM kill) at the same place twice: a third start meets it too
            print(f"[accelpact] stop: {why} (exit {EXIT_NO_REQUEUE})", file=out, flush=True)
            return EXIT_NO_REQUEUE
        if not again:
            if verdict.action not in (STOP, DONE):
                print(f"[accelpact] {reason}", file=out, flush=True)
            return code
        restart += 1
        print(f"[accelpact] fail-stop: relaunching the job (restart {restart}); "
              f"{relaunch_resumes(cfg.checkpoint.every_steps)}", file=out, flush=True)


def launch_local(
    config_path: str,
    cfg: JobConfig,
    run_dir: str,
    worker_args: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    out: TextIO | None = None,
    job_id: str | None = None,
    restart_count: int = 0,
    zygote: Any = None,
    stopped: list[bool] | None = None,
) -> int:
    """Start and supervise ``cfg.world_size`` local ranks; return the job's exit code.

    ``zygote`` (:class:`~accelpact_slurm.launch.zygote.Zygote`): fork the ranks from it; else plain subprocesses.
    ``stopped``: gets True appended when the user stopped the job (SIGINT/SIGTERM to the launcher).
    Rank 0's lines echoed to ``out`` carry its rank label (``0: ``), as ``srun --label`` writes them.
    """
    environ = dict(os.environ if environ is None else environ)
    out = out or sys.stdout
    nodes, rpn = cfg.topology.nodes, cfg.topology.ranks_per_node
    job_id = job_id or settings.local_job_id(environ) or f"local-{os.getpid()}"
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    data_port, control_port = free_port_pair()
    no_port = TestFaults.from_environ(environ).no_launcher_port

    record_launcher(run_dir, job_id, restart_count, zygote)
    daemons = start_local_daemons(config_path, cfg, run_dir, job_id, environ, restart=restart_count,
                                  zygote=zygote)  # one per emulated node, forked where the ranks are
    spares: list[SpareProcess] = []
    ranks: list[RankProcess] = []
    args = [config_path, "--run-dir", run_dir, *worker_args]
    cmd = [sys.executable, "-m", WORKER_MODULE, *args]
    label = rank_label(0, nodes * rpn)
    drop = record_label(0)  # rank 0's records carry "[rank 0] " in its log file; its echo says "0: " once
    try:
        for rank in range(nodes * rpn):
            env = rank_environ(environ, job_id, rank, nodes, rpn, restart=restart_count, data_port=data_port,
                               control_port=control_port)
            if no_port:  # test-only: as under the sbatch template, the ranks find the store at derived ports
                env.pop(settings.MASTER_PORT, None)
            log_path = os.path.join(logs, f"rank-{rank}.log")
            if zygote is not None and zygote.alive:
                # Every start appends to the same log: echo only this start's part (from 0, a relaunch printed
                # every earlier start's lines again before its own).
                start = _size(log_path)
                rp = RankProcess(rank, zygote.spawn(args, env, log_path), log_path)
                if rank == 0:
                    rp.done = threading.Event()
                    rp.pump = threading.Thread(target=_follow, args=(log_path, out, rp.done, label, drop, start),
                                               name="echo-rank-0",
                                               daemon=True)
                    rp.pump.start()
            else:
                proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
                rp = RankProcess(rank, proc, log_path)
                rp.pump = threading.Thread(target=_pump, name=f"pump-rank-{rank}", daemon=True,
                                           args=(proc.stdout, log_path, out if rank == 0 else None, label, drop))
                rp.pump.start()
            ranks.append(rp)
        # warm spare nodes (topology.spare_nodes): parked in the job's store, no rank waits on them
        spares = start_local_spares(config_path, cfg, run_dir, worker_args, environ, job_id=job_id,
                                    restart=restart_count, data_port=data_port, control_port=control_port,
                                    zygote=zygote, no_port=no_port)
    except OSError as exc:
        _terminate(ranks, grace_s=0)
        stop_daemons(daemons)
        drop_leftover_staging(daemons, run_dir, cfg.checkpoint.local_dir, cfg.checkpoint.shared_dir)
        what = f"rank {len(ranks)}" if len(ranks) < nodes * rpn else "a spare process"
        raise LaunchError(f"could not start {what}: {exc}") from exc
    try:
        # a daemon killed mid-job is started again at once (bounded): else its node takes no snapshot until the end
        code = _supervise(ranks, cfg.timeouts.shutdown_s, out, stopped, lost_grace_s=lost_rank_grace(cfg.timeouts),
                          tick=lambda: restart_exited(daemons, run_dir, job_id, restart_count),
                          taken=TakenPlaces(run_dir, restart_count, spares) if spares else None,
                          echo=(label, drop))
        record_undecided_end(run_dir, job_id, restart_count, code, [rp.proc.returncode for rp in ranks],
                             {rp.rank: rp.log_path for rp in ranks})
        return code
    finally:
        stop_spares(spares)  # the ranks are gone: a spare still parked has nothing left to wait for
        stop_daemons(daemons)  # SIGINT: the daemons finish in-flight snapshots (bounded), then exit
        # A daemon killed by kill -9 could not drop its /dev/shm slots; nothing of this start serves them now.
        drop_leftover_staging(daemons, run_dir, cfg.checkpoint.local_dir, cfg.checkpoint.shared_dir)


def record_launcher(run_dir: str, job_id: str, restart: int, zygote: Any) -> None:
    """The ``process`` events of the launcher and its zygote at a start (on no emulated node: ``node`` null)."""
    events = EventLog(os.path.join(run_dir, EVENTS_FILE), job_id=job_id, restart=restart, rank=None, node=None)
    try:
        events.emit("process", role="launcher", pid=os.getpid(), hostname=socket.gethostname())
        if zygote is not None and zygote.alive:
            events.emit("process", role="zygote", pid=zygote.pid, hostname=socket.gethostname())
    finally:
        events.close()


def record_undecided_end(run_dir: str, job_id: str, restart: int, code: int, rank_codes: Sequence[int | None],
                         logs: Mapping[int, str] | None = None) -> None:
    """Every start ends with a ``fail_stop`` or ``job_end`` event: write one when no rank could (they all died).

    Its frontier is the newest update the log committed (None: none yet); a rank that crashed (exit 1: an
    exception no handler took) is named with the exception its log (``logs``: rank -> path) ends with.
    """
    path = os.path.join(run_dir, EVENTS_FILE)
    decided, frontier = False, None
    for e in (read_events(path) if os.path.exists(path) else ()):
        if e.get("event") in ("fail_stop", "job_end") and e.get("restart") == restart:
            decided = True
        elif e.get("event") == "step" and isinstance(e.get("step"), int) and not isinstance(e.get("step"), bool):
            frontier = e["step"]  # the log's order: after an L2 the reloaded start's steps come later
    if decided:
        return
    signals = {128 + s.value: s.name for s in (signal.SIGINT, signal.SIGTERM)}
    if code in signals:
        cause, reason = "signal", f"stopped by {signals[code]} on the launcher: every rank and daemon stopped"
    else:
        cause = "launcher"
        reason = f"every rank ended without a decision (exit codes {list(rank_codes)}): killed, or crashed"
        crashes = crash_lines(logs or {}, rank_codes)
        if crashes:
            reason = f"every rank ended without a decision (exit codes {list(rank_codes)}): " + "; ".join(
                f"rank(s) {', '.join(map(str, ranks))} crashed: {text}" for text, ranks in crashes.items())
    events = EventLog(path, job_id=job_id, restart=restart, rank=None, node=None)
    again = exit_verdict(code, ending=cause == "signal", slurm=False).action == RELAUNCH
    try:
        events.emit("fail_stop", reason=reason, exit_code=code, cause=cause, phase=None, frontier=frontier,
                    decision_s=None, decision="restart" if again else "stop", key=None, by="launcher")
    finally:
        events.close()


#: How much of a crashed rank's log end is read for its exception (a traceback's last line is near the end).
_CRASH_TAIL = 16 * 1024
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)\b.*)$")


def crash_lines(logs: Mapping[int, str], rank_codes: Sequence[int | None]) -> dict[str, list[int]]:
    """``{exception line: [ranks]}`` for each rank that exited 1 (Python's exit for an uncaught exception) and
    whose log ends with a traceback; the same line on several ranks is named once."""
    out: dict[str, list[int]] = {}
    for rank, rc in enumerate(rank_codes):
        if rc != 1 or rank not in logs:
            continue
        tail = read_tail(logs[rank], _CRASH_TAIL)[0].decode(errors="replace")
        if "Traceback (most recent call last)" not in tail:
            continue
        found = [m.group(1).strip() for line in tail.splitlines() if (m := _EXCEPTION_LINE.match(line.strip()))]
        if found:
            text = found[-1] if len(found[-1]) <= 300 else found[-1][:297] + "..."
            out.setdefault(text, []).append(rank)
    return out


def _size(path: str) -> int:
    """The size of the file at ``path``; 0 when there is none yet."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def lost_rank_grace(timeouts: Any) -> float:
    """How long the other ranks get once one exited: ``shutdown_s``, and at least what a survivor needs to call a rank
    gone that nobody saw die (a whole node lost: ``heartbeat_s`` without a heartbeat, and its look's slack), so that
    the stop it writes names the lost node instead of the launcher's "every rank ended without a decision"."""
    return max(timeouts.shutdown_s, timeouts.heartbeat_s + (SLACK_INTERVALS + 2) * timeouts.heartbeat_interval_s)


def _supervise(ranks: list[RankProcess], shutdown_s: float, out: TextIO, stopped: list[bool] | None = None,
               lost_grace_s: float | None = None, tick: Callable[[], None] | None = None,
               taken: Callable[[], dict[int, Any]] | None = None, echo: tuple[str, str] = ("", "")) -> int:
    """Wait for the ranks; stop the others once one failed or the launcher got a signal.  ``tick``: called at
    every poll while every rank runs (the daemons' restarts), never once the ranks are being stopped.
    ``taken``: the spare processes handed a rank's place so far, by rank (:class:`.spares.TakenPlaces`): a rank
    killed by a signal whose place a spare took is no failure; the spare is supervised in its place, and a rank
    still running whose place was taken (a hung node) is killed."""
    stop = {"signal": None}

    def on_signal(signum, _frame):  # handlers only set a flag
        if signum == signal.SIGUSR2:
            stop["usr2"] = True
        else:
            stop["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        deadline: float | None = None
        next_look, stopping = 0.0, False
        while True:
            codes = [rp.proc.poll() for rp in ranks]
            if all(c is not None for c in codes):
                break
            failed = [(rp.rank, c) for rp, c in zip(ranks, codes) if c not in (None, 0)]
            if taken is not None and stop["signal"] is None and time.monotonic() >= next_look:
                next_look = time.monotonic() + TAKEN_LOOK_S  # the event log's new lines, a few times a second
                lost = [r for r, c in failed if c < 0] + [r for r, c in enumerate(codes) if c is None]
                healed = _take_places(ranks, lost, taken(), out, label=echo[0], drop=echo[1])
                if healed:
                    failed = [(r, c) for r, c in failed if r not in healed]
                    if not failed and deadline is not None and not stopping:
                        deadline = None  # every lost rank has a spare in its place: the job goes on
                    continue
            if stop.get("usr2"):  # pre-timeout warning: every rank snapshots at its next boundary and requeues
                stop["usr2"] = False
                for rp in ranks:
                    if rp.proc.poll() is None:
                        rp.proc.send_signal(signal.SIGUSR2)
            if stop["signal"] is not None and not stopping:
                stopping = True
                for rp in ranks:
                    if rp.proc.poll() is None:
                        rp.proc.send_signal(stop["signal"])
                deadline = time.monotonic() + shutdown_s
            if failed and deadline is None:
                stopping = taken is None  # with spares, a lost node may yet be healed within the grace
                r, c = failed[0]
                then = "stopping the other ranks" if stopping else "a spare may take its place, else stopping the others"
                print(f"[accelpact] rank {r} exited with code {c}; {then} (grace {lost_grace_s or shutdown_s:g} s, "
                      f"log {ranks[r].log_path})", file=out, flush=True)
                deadline = time.monotonic() + (lost_grace_s or shutdown_s)
            if deadline is not None and time.monotonic() > deadline:
                _terminate(ranks, grace_s=shutdown_s)
                break
            if tick is not None and deadline is None and not failed:
                tick()
            time.sleep(POLL_S)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    for rp in ranks:
        if rp.done is not None:
            rp.done.set()
        if rp.pump is not None:
            rp.pump.join(timeout=5)
    if stop["signal"] is not None:  # the user stopped the job: stop it, do not relaunch it
        if stopped is not None:
            stopped.append(True)
        print(f"[accelpact] stopped by {signal.Signals(stop['signal']).name}: every rank and daemon stopped; "
              f"exit {128 + stop['signal']}", file=out, flush=True)
        return 128 + stop["signal"]
    return combine_exit_codes([rp.proc.returncode for rp in ranks])


def _take_places(ranks: list[RankProcess], lost: list[int], spares: dict[int, Any], out: TextIO, *,
                 label: str = "", drop: str = "") -> list[int]:
    """Put the spare that took a lost rank's place where the rank was (its exit is the rank's from now on); the
    ranks so replaced.  A rank whose place was taken while its process still runs (a node that hangs: named gone
    by its silence) is killed first, so that it can never come back beside the spare in its place.  In rank 0's
    place the spare's log is echoed from then on, as rank 0's was (``label``, ``drop``)."""
    done = []
    for r in lost:
        sp = spares.get(r)
        if sp is None or ranks[r].proc is sp.proc:
            continue
        if ranks[r].proc.poll() is None:
            ranks[r].proc.kill()  # SIGKILL ends a stopped process too
            print(f"[accelpact] rank {r} (pid {ranks[r].proc.pid}) was named gone and its place taken: killed",
                  file=out, flush=True)
        print(f"[accelpact] rank {r} was lost with its node; spare {sp.node}/{sp.local_rank} (pid {sp.proc.pid}) "
              f"takes its place (log {sp.log_path})", file=out, flush=True)
        old, ranks[r] = ranks[r], RankProcess(r, sp.proc, sp.log_path)
        if r == 0:  # rank 0's lines (progress, the heal, the job's end) come from the spare's log now
            if old.done is not None:
                old.done.set()
            ranks[r].done = threading.Event()
            ranks[r].pump = threading.Thread(target=_follow, name="echo-rank-0", daemon=True,
                                             args=(sp.log_path, out, ranks[r].done, label, drop, sp.log_start))
        done.append(r)
    if 0 in done:  # after this call's own lines
        ranks[0].pump.start()  # type: ignore[union-attr]
    return done


def _terminate(ranks: list[RankProcess], grace_s: float) -> None:
    """Stop the ranks still running: their stacks into their logs first (a rank left over is usually stuck; a
    stopped one is woken for it), then SIGTERM, then SIGKILL after ``grace_s``."""
    dump_stacks([rp.proc.pid for rp in ranks if rp.proc.poll() is None])
    for rp in ranks:
        if rp.proc.poll() is None:
            rp.proc.terminate()
    end = time.monotonic() + grace_s
    for rp in ranks:
        try:
            rp.proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            rp.proc.kill()
            rp.proc.wait(timeout=5)
