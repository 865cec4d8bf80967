"""Failure history from the logs admins already have, classified for ``accelpact-cadence``.

Three sources, each parsed line by line; a line that cannot be read becomes a
:class:`~accelpact_slurm.core.events.BadLine` (file, 1-based line number, reason) and is skipped, so a truncated or
hand-edited log never stops the analysis:

* ``sacct --parsable2`` output (``sacct -P -D -X -o JobID,State,ExitCode,Start,End,NodeList,Elapsed``).  The first
  line must be the header; without one (``-n``) that field order is assumed. ``JobID`` and ``State`` are required;
  ``Start``/``End`` or ``Elapsed`` give the exposure; ``ExitCode`` separates our fail-stops (75, 76) from other
  failures.  Job steps (``123.batch``, ``123.0``) are ignored.
* Slurm's ``jobcomp/filetxt`` log: one ``Key=Value ...`` line per run; a run ended by ``scontrol requeue`` is logged
  as ``PENDING`` and read as a requeue.
* Our own event logs (``events.jsonl``), which know what Slurm cannot: whether a fault hit a committed boundary
  (L1-eligible) or uncommitted compute, and the measured costs (step, snapshot, restart and repair times).

The same run seen in several sources is counted once; the event log refines the class of a Slurm record of the same
job and restart.  No torch: login-node tools use it.
"""

from __future__ import annotations

import os
import re
import statistics
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Iterable

from accelpact_slurm.core.events import EVENTS_FILE, BadLine, finite_number, read_events, read_lines

COMM_COMMITTED = "comm_committed"  # communicator fault at a committed boundary: L1-eligible
UNCOMMITTED = "uncommitted"  # fault in forward/backward/optimizer: L2 by design
NODE_FAIL = "node_fail"
PREEMPTED = "preempted"
TIMEOUT = "timeout"
OTHER = "other"
CLASSES = (COMM_COMMITTED, UNCOMMITTED, NODE_FAIL, PREEMPTED, TIMEOUT, OTHER)
#: Classes that force a restart without L1.  Timeouts are left out: they are
#: announced (``--signal=B:USR2@N``) and a snapshot is taken before them, so
#: they cost no replay and do not bear on the cadence.
RESTART_CLASSES = (COMM_COMMITTED, UNCOMMITTED, NODE_FAIL, PREEMPTED, OTHER)
#: Outcomes of a run that are not interruptions.
COMPLETED, CANCELLED, RUNNING = "completed", "cancelled", "running"

SACCT_DEFAULT_FIELDS = ("JobID", "State", "ExitCode", "Start", "End", "NodeList", "Elapsed")
SACCT_REQUIRED_FIELDS = ("JobID", "State")
_COMMITTED_PHASES = {"committed", "boundary"}
_UNCOMMITTED_PHASES = {"forward", "backward", "optimizer", "uncommitted", "compute"}
#: Fields a ``checkpoint`` event may carry for the time training was blocked, best first.
CHECKPOINT_COST_FIELDS = ("blocking_s", "stage_s", "duration_s", "save_s")
#: A run longer than a century is a corrupt record (and a 400-digit day count overflows a float).
MAX_ELAPSED_S = 36_500 * 86_400
#: Slurm's elapsed time: ``[D-]HH:MM:SS`` or ``MM:SS[.mmm]``; ASCII digits only (int() reads "٣" too).
_ELAPSED_RE = re.compile(r"(?:([0-9]{1,9})-)?(?:([0-9]{1,9}):)?([0-9]{1,2}):([0-9]{1,2})(\.[0-9]{1,6})?")
#: Larger integers are no step count; a 400-digit one overflows float() in a step gap or an age.
_MAX_COUNT = 2 ** 53


@dataclass(frozen=True)
class SlurmRun:
    """One run (allocation) of a job as Slurm logged it."""

    job_id: str
    state: str
    exit_code: str
    start: float | None
    end: float | None
    elapsed_s: float | None
    nodes: str
    source: str
    lineno: int

    @property
    def duration_s(self) -> float | None:
        if self.elapsed_s is not None:
            return self.elapsed_s
        if self.start is not None and self.end is not None and self.end >= self.start:
            return self.end - self.start
        return None


@dataclass(frozen=True)
class Interruption:
    """One interruption, classified; ``outcome`` is ``repaired`` (L1) or ``restarted``/``ended`` (L2)."""

    cls: str
    outcome: str
    job_id: str | None
    run: int | None
    ts: float | None
    detail: str
    source: str
    lineno: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Measured:
    """A cost measured from event logs: median of ``samples`` values."""

    value: float | None
    samples: int
    source: str


@dataclass
class History:
    """Everything :func:`build_history` learned; the CLI turns it into rates and advice."""

    interruptions: list[Interruption]
    exposure_s: float
    runs: int
    costs: dict[str, Measured]
    notes: list[str] = field(default_factory=list)

    def count(self, cls: str) -> int:
        return sum(1 for i in self.interruptions if i.cls == cls)


# --------------------------------------------------------------------------- Slurm logs


def classify_slurm(state: str, exit_code: str) -> tuple[str, str]:
    """Class (or non-interruption outcome) of a Slurm run and why, from its state and exit code."""
    base = state.split()[0].upper().rstrip("+") if state.strip() else ""
    code = _exit_status(exit_code)
    if base == "COMPLETED":
        return COMPLETED, "completed"
    if base in ("NODE_FAIL", "BOOT_FAIL"):
        return NODE_FAIL, f"Slurm state {base}"
    if base == "PREEMPTED":
        return PREEMPTED, "preempted by Slurm"
    if base in ("TIMEOUT", "DEADLINE"):
        return TIMEOUT, f"Slurm state {base}"
    if base == "CANCELLED":
        return CANCELLED, state.strip()
    if base in ("RUNNING", "PENDING", "SUSPENDED", "COMPLETING", "CONFIGURING", "RESIZING", "REQUEUE_HOLD"):
        return RUNNING, f"Slurm state {base}"
    if code == 75:
        return OTHER, f"AccelPact fail-stop, requeue (exit 75; {base})"
    if code == 76:
        return OTHER, f"AccelPact stop, no requeue (exit 76; {base})"
    return OTHER, f"Slurm state {base or '?'} exit {exit_code or '?'}"


def parse_sacct(path: str | os.PathLike[str], bad: list[BadLine]) -> list[SlurmRun]:
    """Runs from ``sacct --parsable2`` output; bad lines go to ``bad``."""
    path = os.fspath(path)
    runs: list[SlurmRun] = []
    fields: tuple[str, ...] | None = None
    for lineno, line in _lines(path, bad):
        cells = line.split("|")
        if fields is None:
            if "JobID" in cells:
                fields = tuple(c.strip() for c in cells)
                missing = [f for f in SACCT_REQUIRED_FIELDS if f not in fields]
                if missing:
                    bad.append(BadLine(path, lineno, f"header lacks {', '.join(missing)}: no line can be read"))
                    return runs
                continue
            fields = SACCT_DEFAULT_FIELDS
        if len(cells) != len(fields):
            bad.append(BadLine(path, lineno, f"{len(cells)} fields, header has {len(fields)} (truncated?)"))
            continue
        row = dict(zip(fields, cells))
        job_id = row["JobID"].strip()
        if not job_id or not row["State"].strip():
            bad.append(BadLine(path, lineno, "empty JobID or State"))
            continue
        if "." in job_id:  # a step (123.batch, 123.0, 123.extern): the allocation line speaks for the run
            continue
        try:
            start, end = _slurm_time(row.get("Start", "")), _slurm_time(row.get("End", ""))
            elapsed = _elapsed(row.get("Elapsed", ""))
        except ValueError as exc:
            bad.append(BadLine(path, lineno, str(exc)))
            continue
        runs.append(SlurmRun(job_id, row["State"].strip(), row.get("ExitCode", "").strip(), start, end, elapsed,
                             row.get("NodeList", "").strip(), path, lineno))
    return runs


_KV = re.compile(r"(\w+)=(.*?)(?=\s+\w+=|\s*$)")


def parse_jobcomp(path: str | os.PathLike[str], bad: list[BadLine]) -> list[SlurmRun]:
    """Runs from a ``jobcomp/filetxt`` log (``JobId=... JobState=... StartTime=...``)."""
    path = os.fspath(path)
    runs: list[SlurmRun] = []
    for lineno, line in _lines(path, bad):
        row = dict(_KV.findall(line))
        if "JobId" not in row or "JobState" not in row:
            bad.append(BadLine(path, lineno, "no JobId= or JobState= (truncated?)"))
            continue
        state = row["JobState"].strip()
        if state.upper() == "PENDING":  # how filetxt logs a run ended by `scontrol requeue`
            state = "REQUEUED"
        try:
            start, end = _slurm_time(row.get("StartTime", "")), _slurm_time(row.get("EndTime", ""))
        except ValueError as exc:
            bad.append(BadLine(path, lineno, str(exc)))
            continue
        runs.append(SlurmRun(row["JobId"].strip(), state, row.get("ExitCode", "").strip(), start, end, None,
                             row.get("NodeList", "").strip(), path, lineno))
    return runs


# --------------------------------------------------------------------------- event logs


@dataclass
class _Run:
    first_ts: float
    last_ts: float
    terminal: dict[str, Any] | None = None
    requeue_reason: str | None = None
    resume_ts: float | None = None  # restart_load, else first step
    last_fault: dict[str, Any] | None = None
    lineno: int | None = None


@dataclass
class EventScan:
    """What one pass over event logs found, keyed by (job id, restart)."""

    runs: dict[tuple[str, int], _Run] = field(default_factory=dict)
    repairs: dict[tuple[str, int, Any], Interruption] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)
    step_gaps: list[float] = field(default_factory=list)
    checkpoint_s: list[float] = field(default_factory=list)
    repair_s: list[float] = field(default_factory=list)
    decision_s: list[float] = field(default_factory=list)
    ages: list[float] = field(default_factory=list)
    _steps: dict[tuple[str, int], tuple[int, float]] = field(default_factory=dict)
    _seen_steps: set[tuple[str, int, int]] = field(default_factory=set)
    _verified: dict[str, int] = field(default_factory=dict)


def events_path(path: str | os.PathLike[str]) -> str:
    """A run directory stands for its ``events.jsonl`` (a directory named ``events.jsonl`` is that, refused)."""
    path = os.fspath(path)
    if os.path.isdir(path) and os.path.basename(os.path.normpath(path)) != EVENTS_FILE:
        return os.path.join(path, EVENTS_FILE)
    return path


def scan_events(paths: Iterable[str | os.PathLike[str]], bad: list[BadLine], scan: EventScan | None = None) -> EventScan:
    """One pass over each event log; ranks that log the same event are counted once."""
    scan = scan or EventScan()
    for path in paths:
        path = events_path(path)
        if not os.path.exists(path):
            bad.append(BadLine(path, 0, "no such file"))
            continue
        for rec in read_events(path, bad):
            _scan_one(scan, rec, path)
    return scan


def _scan_one(scan: EventScan, rec: dict[str, Any], path: str) -> None:
    ts = _num(rec.get("ts"))
    if ts is None:
        return
    job = str(rec.get("job_id") if rec.get("job_id") is not None else os.path.basename(os.path.dirname(path)))
    restart = _int(rec.get("restart")) or 0
    key = (job, restart)
    run = scan.runs.get(key)
    if run is None:
        run = scan.runs[key] = _Run(ts, ts)
    run.first_ts, run.last_ts = min(run.first_ts, ts), max(run.last_ts, ts)
    kind = rec["event"]
    if kind == "step":
        step = _int(rec.get("step"))
        if step is None or (job, restart, step) in scan._seen_steps:
            return
        scan._seen_steps.add((job, restart, step))
        if (v := _num(rec.get("step_s"))) is not None:
            scan.step_s.append(v)
        prev = scan._steps.get(key)
        if prev is not None and step > prev[0] and ts > prev[1]:
            scan.step_gaps.append((ts - prev[1]) / (step - prev[0]))
        scan._steps[key] = (step, ts)
        if run.resume_ts is None:
            run.resume_ts = ts
    elif kind == "restart_load":
        run.resume_ts = ts if run.resume_ts is None else min(run.resume_ts, ts)
    elif kind in ("checkpoint", "snapshot"):
        if (cost := next((c for f in CHECKPOINT_COST_FIELDS if (c := _num(rec.get(f))) is not None), None)) is not None:
            scan.checkpoint_s.append(cost)
        step = _int(rec.get("step"))
        if rec.get("state") == "verified" and step is not None:
            scan._verified[job] = max(step, scan._verified.get(job, step))
    elif kind == "fault":
        run.last_fault = rec
    elif kind == "repair":
        rkey = (job, restart, rec.get("generation", ts))
        if rkey in scan.repairs:
            return
        frontier = _int(rec.get("frontier"))
        total = _num(rec.get("total_s"))
        if total is not None:
            scan.repair_s.append(total)
        if frontier is not None and job in scan._verified:
            scan.ages.append(frontier - scan._verified[job])
        detail = f"L1 repair, generation {rec.get('generation')}, frontier {frontier}"
        scan.repairs[rkey] = Interruption(COMM_COMMITTED, "repaired", job, restart, ts, detail, path)
    elif kind == "fail_stop":
        if run.terminal is None or run.terminal.get("event") != "fail_stop":
            run.terminal = dict(rec, _path=path)
            if (v := _num(rec.get("decision_s"))) is not None:
                scan.decision_s.append(v)
            frontier = _int(rec.get("frontier"))
            if frontier is not None and job in scan._verified:
                scan.ages.append(frontier - scan._verified[job])
    elif kind == "job_end":
        if run.terminal is None:
            run.terminal = dict(rec, _path=path)
    elif kind == "requeue":
        run.requeue_reason = str(rec.get("reason") or rec.get("by") or "requeue")


def classify_event_run(run: _Run) -> tuple[str, str]:
    """Class (or outcome) of a run from its own events, and why."""
    term = run.terminal
    if term is not None and term.get("event") == "fail_stop":
        fault = run.last_fault or {}
        phase = str(term.get("phase") or fault.get("phase") or "").lower()
        reason = term.get("reason")
        if phase in _COMMITTED_PHASES or phase.startswith("repair"):
            return COMM_COMMITTED, f"fail-stop at a committed boundary ({reason}; phase {phase})"
        if phase in _UNCOMMITTED_PHASES:
            return UNCOMMITTED, f"fail-stop in uncommitted compute ({reason}; phase {phase})"
        if run.requeue_reason:
            return _class_from_reason(run.requeue_reason)
        return OTHER, f"fail-stop: {reason} (exit {term.get('exit_code')})"
    if run.requeue_reason:
        return _class_from_reason(run.requeue_reason)
    if term is not None and term.get("event") == "job_end":
        return (COMPLETED, "job_end") if _int(term.get("exit_code")) in (0, None) else (
            OTHER, f"job_end with exit {term.get('exit_code')}")
    return RUNNING, "no terminal event"


def _class_from_reason(reason: str) -> tuple[str, str]:
    r = reason.lower()
    if "preempt" in r:
        return PREEMPTED, f"requeue: {reason}"
    if "timeout" in r or "time_limit" in r or "usr2" in r:
        return TIMEOUT, f"requeue: {reason}"
    if "node" in r:
        return NODE_FAIL, f"requeue: {reason}"
    return OTHER, f"requeue: {reason}"


# --------------------------------------------------------------------------- merge


def build_history(slurm_runs: list[SlurmRun], scan: EventScan) -> History:
    """Merge Slurm records and event logs into classified interruptions, exposure and measured costs."""
    notes: list[str] = []
    unique: dict[tuple[str, Any], SlurmRun] = {}
    for r in slurm_runs:  # sacct and jobcomp may both hold the same run
        unique.setdefault((r.job_id, r.start if r.start is not None else (r.source, r.lineno)), r)
    by_job: dict[str, list[SlurmRun]] = {}
    for r in unique.values():
        by_job.setdefault(r.job_id, []).append(r)
    max_restart: dict[str, int] = {}
    for job, restart in scan.runs:
        max_restart[job] = max(restart, max_restart.get(job, 0))

    interruptions: list[Interruption] = []
    exposure = 0.0
    matched: set[tuple[str, int]] = set()
    no_time = 0
    for job, runs in by_job.items():
        runs.sort(key=lambda r: (r.start is None, r.start or 0.0, r.lineno))
        offset = max(0, max_restart.get(job, -1) + 1 - len(runs)) if job in max_restart else 0
        for i, r in enumerate(runs):
            restart = i + offset
            cls, detail = classify_slurm(r.state, r.exit_code)
            ev = scan.runs.get((job, restart))
            if ev is not None:
                matched.add((job, restart))
                if cls in (OTHER, RUNNING):
                    ecls, edetail = classify_event_run(ev)
                    if ecls != RUNNING:
                        cls, detail = ecls, f"{edetail}; Slurm: {r.state} {r.exit_code}".rstrip()
            if r.duration_s is None:
                no_time += 1
            else:
                exposure += r.duration_s
            if cls in CLASSES:
                outcome = "restarted" if i < len(runs) - 1 else "ended"
                interruptions.append(Interruption(cls, outcome, job, restart, r.end, detail, r.source, r.lineno))
    if no_time:
        notes.append(f"{no_time} Slurm record(s) without Start/End or Elapsed: not counted in the observed time")

    for (job, restart), ev in sorted(scan.runs.items()):
        if (job, restart) in matched:
            continue
        exposure += max(0.0, ev.last_ts - ev.first_ts)
        cls, detail = classify_event_run(ev)
        later = (job, restart + 1) in scan.runs
        if cls == RUNNING and later:
            cls, detail = OTHER, "run ended without a fail_stop or job_end event (killed from outside?)"
        if cls in CLASSES:
            src = (ev.terminal or {}).get("_path", "events")
            interruptions.append(Interruption(cls, "restarted" if later else "ended", job, restart,
                                              ev.last_ts, detail, src))
    interruptions.extend(scan.repairs.values())
    interruptions.sort(key=lambda i: (i.ts is None, i.ts or 0.0))

    gaps = []
    for (job, restart), ev in scan.runs.items():
        nxt = scan.runs.get((job, restart + 1))
        if nxt is not None and nxt.resume_ts is not None and nxt.resume_ts > ev.last_ts:
            gaps.append(nxt.resume_ts - ev.last_ts)
    step_samples, step_src = (scan.step_s, "median step_s of step events") if scan.step_s else (
        scan.step_gaps, "median time between step events")
    costs = {
        "step_time_s": _measured(step_samples, step_src),
        "checkpoint_cost_s": _measured(scan.checkpoint_s, "median blocking time of checkpoint events ("
                                       + "/".join(CHECKPOINT_COST_FIELDS) + ")"),
        "restart_cost_s": _measured(gaps, "median time from a run's last event to the next run's resume"),
        "repair_s": _measured(scan.repair_s, "median total_s of repair events"),
        "rejection_s": _measured(scan.decision_s, "median decision_s of fail_stop events"),
        "age_steps": _measured(scan.ages, "median frontier - newest verified step at faults"),
    }
    return History(interruptions, exposure, len(unique) + len(scan.runs) - len(matched), costs, notes)


# --------------------------------------------------------------------------- helpers


def _lines(path: str, bad: list[BadLine]) -> Iterable[tuple[int, str]]:
    """The non-empty lines of a Slurm log, decoded; bounded and never blocking (:func:`read_lines`)."""
    if not os.path.exists(path):
        bad.append(BadLine(path, 0, "no such file"))
        return
    for lineno, raw in read_lines(path, bad, follow=True):  # a log the operator names: a link to it is fine
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            bad.append(BadLine(path, lineno, "not UTF-8"))
            continue
        if line.strip():
            yield lineno, line


def _slurm_time(text: str) -> float | None:
    """Slurm's local ``YYYY-MM-DDTHH:MM:SS``; ``Unknown``/``None``/empty mean not known."""
    text = text.strip()
    if not text or text in ("Unknown", "None", "N/A"):
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()
    except (ValueError, OverflowError, OSError):  # timestamp() of year 1 or 9999 fails on some platforms
        raise ValueError(f"bad time {text[:40]!r} (want YYYY-MM-DDTHH:MM:SS)") from None


def _elapsed(text: str) -> float | None:
    """Slurm's ``[D-]HH:MM:SS``, ``HH:MM:SS``, ``MM:SS`` or ``MM:SS.mmm``; what Slurm never writes is a ValueError."""
    text = text.strip()
    if not text or text in ("Unknown", "INVALID"):
        return None
    m = _ELAPSED_RE.fullmatch(text)
    if not m:
        raise ValueError(f"bad elapsed time {text[:40]!r} (want [D-]HH:MM:SS)")
    days, hours, minutes, seconds, fraction = m.groups()
    # Each of these was once read as a time: 99-99:99:99.5 as 103 days.
    if days is not None and (hours is None or int(hours) >= 24):
        raise ValueError(f"bad elapsed time {text!r} (after D- Slurm writes HH:MM:SS with HH < 24)")
    if int(minutes) >= 60 or int(seconds) >= 60:
        raise ValueError(f"bad elapsed time {text!r} (minutes and seconds must be < 60)")
    if fraction and hours is not None:
        raise ValueError(f"bad elapsed time {text!r} (Slurm writes a fraction only as MM:SS.mmm)")
    total = ((int(days or 0) * 24 + int(hours or 0)) * 60 + int(minutes)) * 60 + int(seconds)
    if total > MAX_ELAPSED_S:
        raise ValueError(f"bad elapsed time {text[:40]!r} (over {MAX_ELAPSED_S // 86_400} days: a corrupt record)")
    return total + float(fraction or 0.0)


def _exit_status(exit_code: str) -> int | None:
    """The exit status of Slurm's ``STATUS:SIGNAL``; None when it is not a few ASCII digits.

    ``str.isdigit`` accepts "²" and 5,000 digits, both of which ``int`` refuses.
    """
    head = exit_code.split(":", 1)[0].strip()
    return int(head) if re.fullmatch(r"[0-9]{1,9}", head) else None


def _num(value: Any) -> float | None:
    """A finite number, else None: ``1e400`` reads as inf and would poison every median and sum."""
    return finite_number(value)


def _int(value: Any) -> int | None:
    """An integer (or integral float) a float can hold, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and abs(value) <= _MAX_COUNT:
        return value
    return None


def _measured(samples: list[float], source: str) -> Measured:
    if not samples:
        return Measured(None, 0, source)
    return Measured(float(statistics.median(samples)), len(samples), source)
