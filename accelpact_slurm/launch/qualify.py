"""``accelpact-qualify``'s work: the reference run and the fault trials that earn (or refuse) an envelope entry.

:func:`qualify` launches the job with ``accelpact-run`` (one uninterrupted reference run, then the trials of
each phase, each injecting a real fault), judges every trial (:func:`judge_trial`) and writes the entry each
phase earns with its evidence (:func:`_qualify_phase`).  ``accelpact_slurm.cli.qualify`` (the command) parses
the flags, checks the job and the envelope file with :func:`check_job`, :func:`envelope_target` and
:func:`check_envelope_file`, and calls :func:`qualify`; its help describes the trials and the exit codes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any, Mapping, Sequence

from accelpact_slurm.core import settings
from accelpact_slurm.core.config import JobConfig
from accelpact_slurm.core.errors import EXIT_OK, EXIT_USAGE, ConfigError
from accelpact_slurm.core.events import parse_json, read_events, read_file
from accelpact_slurm.core.safeopen import open_regular, open_writable
from accelpact_slurm.runtime.job import envelope as env_mod

#: accelpact-qualify's exit codes (a trial run's own exit code is accelpact-run's and only goes into its line).
EXIT_QUALIFIED = EXIT_OK
EXIT_NOT_QUALIFIED = 1
EXIT_CODES = {
    EXIT_QUALIFIED: "qualified: every trial repaired in process; the entry allows preserve",
    EXIT_NOT_QUALIFIED: "not qualified: a trial failed (restart only is recorded for the key),\n"
                        "     or the reference run failed (nothing is written)",
    EXIT_USAGE: "bad input: job file, flag or envelope file (nothing is run)",
}

#: The failure phases accelpact-qualify can earn an entry for: phase -> (the fault PHASE each trial injects,
#: what that fault is).
PHASES: dict[str, tuple[str, str]] = {
    "committed": ("boundary", "a rank withholds its part of the replication collective at the committed boundary "
                              "after update STEP"),
    "backward": ("backward", "a rank withholds every replication all-reduce FSDP issues in the backward of update "
                             "STEP; the update is discarded and runs again"),
}
DEFAULT_PHASE = "committed"
#: ``--phase all``: every phase of PHASES, in this order, after one reference run.
ALL_PHASES = "all"
#: A trial's output (launcher and rank 0) goes to this file in its run directory.
OUTPUT_FILE = "accelpact-run.out"
#: How often a wait for a run looks at its deadline and at a stop request.
POLL_S = 0.2


def trial_faults(phase: str, trials: int, steps: int, world: int) -> list[str]:
    """The fault each trial injects (``PHASE:STEP:RANK``): varying updates and ranks, rank 1 first."""
    if phase not in PHASES:
        raise ConfigError("phase", phase, f"accelpact-qualify qualifies the phase(s) {', '.join(PHASES)}")
    kind = PHASES[phase][0]
    return [f"{kind}:{1 + (i * 3) % (steps - 1)}:{(i + 1) % world}" for i in range(trials)]


def judge_trial(rc: int | None, events: list[dict[str, Any]], summary: dict[str, Any] | None,
                reference_digest: str, timeout_s: float) -> tuple[bool, str]:
    """Did a trial repair in process and end in the reference state?  ``(ok, reason)``; ``rc`` None: timed out."""
    if rc is None:
        return False, f"timed out after {timeout_s:g} s (stopped)"
    first = next((i for i, e in enumerate(events) if e.get("event") == "fail_stop"), None)
    if first is not None:
        s = events[first]
        reason = " ".join(str(s.get("reason")).split())
        at = s.get("frontier")
        if not isinstance(at, int):  # none of its own: the newest update committed before it
            at = next((e["step"] for e in reversed(events[:first]) if e.get("event") == "step"
                       and isinstance(e.get("step"), int)), None)
        where = f"at F={at}" if isinstance(at, int) else "before any committed update"
        return False, f"fail-stop {where} (phase {s.get('phase')}): {reason} (exit {rc})"
    if rc != 0:
        return False, f"the run exited {rc} without a fail-stop event"
    repairs = [e for e in events if e.get("event") == "repair"]
    if not repairs:
        return False, "no repair event: the injected fault was not repaired in process"
    if summary is None:
        return False, "the run exited 0 but wrote no summary.json"
    if summary.get("final_state_digest") != reference_digest:
        return False, "its final_state_digest differs from the reference run's: the repair changed the training state"
    r = repairs[0]
    return True, (f"repaired at F={r.get('frontier')} (generation {r.get('generation')}), final state equal to "
                  f"the reference run's")


def envelope_target(flag: str | None, environ: Mapping[str, str]) -> tuple[str, str, str]:
    """``(file to write, the setting that chose it, a note for the user)``: flag > ``ACCELPACT_ENVELOPE`` > the
    user's file."""
    configured = settings.envelope_path(environ)
    if flag:
        read = configured or env_mod.user_path(environ)
        jobs_read = [read] if configured else [read, env_mod.SHIPPED]
        if os.path.abspath(flag) in {os.path.abspath(p) for p in jobs_read}:
            return flag, "--envelope", "named with --envelope"
        how = f"${settings.ENVELOPE}" if configured else "layered over the shipped one"
        return flag, "--envelope", (f"named with --envelope; note: jobs read {read} ({how}), so they use this "
                                    f"entry only with {settings.ENVELOPE}={flag}")
    if configured:
        return configured, settings.ENVELOPE, f"${settings.ENVELOPE}, the file jobs read"
    return env_mod.user_path(environ), "envelope", ("the default in your configuration directory; jobs read it "
                                                    "layered over the shipped envelope")


def check_envelope_file(path: str, field: str) -> None:
    """Fail before minutes of trials, not after: the file must parse and its folder must be writable."""
    if os.path.isdir(path):
        raise ConfigError(field, path, "is a folder; name an envelope file (e.g. envelope.yaml in it)")
    env_mod.load_file(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise ConfigError(field, path, f"cannot create its folder ({exc.strerror or exc}); name another file "
                                        f"with --envelope") from None
    if not os.access(folder, os.W_OK):
        raise ConfigError(field, path, f"its folder {folder} is not writable; name another file with --envelope")


def check_job(cfg: JobConfig, trials: int, steps: int) -> None:
    if trials < env_mod.MIN_TRIALS:
        raise ConfigError("--trials", trials, f"a key qualifies only on at least {env_mod.MIN_TRIALS} trials; "
                                              f"pass --trials {env_mod.MIN_TRIALS} or more")
    if steps < 3:
        raise ConfigError("--steps", steps, "a run needs at least 3 updates (a fault, its repair, an update after "
                                            "it); pass --steps 3 or more")
    if cfg.faults:
        raise ConfigError("faults", [str(f) for f in cfg.faults],
                          "the reference run must be uninterrupted and each trial injects its own fault; "
                          "use a copy of the job file with faults: []")


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """Stop a run and everything it started (its own process group): SIGTERM, then SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # the launcher stops its ranks and daemons, then exits
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:  # whatever is left of the run (a launcher that did not stop, a rank it left behind)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=30)


def run_job(config: str, run_dir: str, extra: list[str], env: Mapping[str, str], timeout_s: float,
            grace_s: float, stop: Mapping[str, int | None]
            ) -> tuple[int | None, list[dict[str, Any]], dict[str, Any] | None]:
    """One ``accelpact-run`` of the job into ``run_dir``: ``(exit code, events, summary)``.

    The exit code is None when the run was stopped: past ``timeout_s``, or once ``stop["signal"]`` is set.
    """
    os.makedirs(run_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "accelpact_slurm.cli.run", config, "--run-dir", run_dir, *extra]
    deadline = time.monotonic() + timeout_s
    rc: int | None = None
    fd, _st = open_writable(os.path.join(run_dir, OUTPUT_FILE), mode=0o644)  # never through a link
    os.ftruncate(fd, 0)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        # Its own session: the terminal's Ctrl-C reaches only us, and a stopped run goes with every rank and
        # daemon it started (its process group), none left running on its own.
        proc = subprocess.Popen(cmd, env=dict(env), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while rc is None:
                try:
                    rc = proc.wait(timeout=POLL_S)
                except subprocess.TimeoutExpired:
                    if stop["signal"] is not None or time.monotonic() > deadline:
                        _stop(proc, grace_s)
                        break
        except BaseException:
            _stop(proc, grace_s)
            raise
    events = list(read_events(os.path.join(run_dir, "events.jsonl")))
    try:  # bounded, a regular file only (core.safeopen)
        summary = parse_json(read_file(os.path.join(run_dir, "summary.json")))
    except (OSError, ValueError):
        summary = None
    return rc, events, summary


def _last_line(path: str) -> str:
    try:
        fd, _st = open_regular(path)  # a regular file only, never through a link (core.safeopen)
        with open(fd, encoding="utf-8", errors="replace") as fh:
            lines = [line.strip() for line in fh if line.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _stopped(stop: Mapping[str, int | None]) -> int:
    signum = stop["signal"] or signal.SIGTERM
    print(f"accelpact-qualify: stopped by {signal.Signals(signum).name}: the running run was stopped; nothing "
          f"written", file=sys.stderr)
    return 128 + signum


def qualify(config: str, cfg: JobConfig, *, envelope_path: str, note: str, trials: int, steps: int,
            work: str, phase: str | Sequence[str] = DEFAULT_PHASE, environ: Mapping[str, str] | None = None,
            stop: Mapping[str, int | None] | None = None) -> int:
    """Run the reference, then the trials of each phase in ``phase`` (one phase or several: they share the reference
    run), write each phase's entry as it is decided, and return the exit code (qualified only when every phase is).

    ``stop["signal"]``, once set (by ``main``'s SIGINT/SIGTERM handler), stops the running run and returns
    128 + the signal; entries already decided stay written, the running phase's is not.
    """
    environ = os.environ if environ is None else environ
    stop = {"signal": None} if stop is None else stop
    phases = [phase] if isinstance(phase, str) else list(phase)
    for ph in phases:
        if ph not in PHASES:
            raise ConfigError("phase", ph, f"accelpact-qualify qualifies the phase(s) {', '.join(PHASES)}")
    env = dict(environ)
    env.pop(settings.QUALIFYING, None)
    timeout = cfg.timeouts.startup_s + 60 + steps * 10
    grace = cfg.timeouts.shutdown_s + 5
    for ph in phases:
        kind, what = PHASES[ph]
        print(f"[qualify] phase {ph}: each trial injects {kind}:STEP:RANK ({what}); Preserve is attempted",
              flush=True)
    print(f"[qualify] envelope file {envelope_path} ({note})", flush=True)
    print(f"[qualify] {trials} trials of {steps} updates per phase; runs in {work}", flush=True)
    ref_dir = os.path.join(work, "reference")
    rc, events, ref = run_job(config, ref_dir, ["--steps", str(steps)], env, timeout, grace, stop)
    if stop["signal"] is not None:
        return _stopped(stop)
    if rc != 0 or ref is None or not ref.get("final_state_digest"):
        why = f"timed out after {timeout:g} s" if rc is None else f"exit {rc}"
        last = _last_line(os.path.join(ref_dir, OUTPUT_FILE))
        print(f"accelpact-qualify: error: the uninterrupted reference run failed ({why}): {last or 'no output'} "
              f"(see {os.path.join(ref_dir, OUTPUT_FILE)}); nothing written", file=sys.stderr)
        return EXIT_NOT_QUALIFIED
    protected = [e for e in events if e["event"] == "protected"]
    if not protected:
        print("accelpact-qualify: error: the reference run never called job.protect, so it has no envelope key; "
              "nothing written", file=sys.stderr)
        return EXIT_NOT_QUALIFIED
    code = EXIT_QUALIFIED
    for ph in phases:
        key = env_mod.Key(protected[0]["platform"], protected[0]["profile"], ph)
        got = _qualify_phase(config, key, ref, env, trials=trials, steps=steps, world=cfg.world_size,
                             work=os.path.join(work, ph) if len(phases) > 1 else work, timeout=timeout,
                             grace=grace, stop=stop, envelope_path=envelope_path,
                             torch_version=_torch_version())
        if got != EXIT_QUALIFIED:
            if got != EXIT_NOT_QUALIFIED:
                return got
            code = got
    return code


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _qualify_phase(config: str, key: env_mod.Key, ref: dict[str, Any], env: dict[str, str], *, trials: int,
                   steps: int, world: int, work: str, timeout: float, grace: float,
                   stop: Mapping[str, int | None], envelope_path: str, torch_version: str) -> int:
    """The trials of ``key.phase`` against the reference run ``ref``, and the entry they earn, written."""
    print(f"[qualify] key {key}", flush=True)
    env = dict(env, **{settings.QUALIFYING: key.phase})
    failures: list[str] = []
    failed: list[str] = []
    for i, fault in enumerate(trial_faults(key.phase, trials, steps, world)):
        run_dir = os.path.join(work, f"trial-{i + 1}")
        rc, events, summary = run_job(config, run_dir, ["--steps", str(steps), "--inject-fault", fault], env,
                                      timeout, grace, stop)
        if stop["signal"] is not None:
            return _stopped(stop)
        ok, reason = judge_trial(rc, events, summary, ref["final_state_digest"], timeout)
        line = f"trial {i + 1}/{trials} {fault}: " + (f"ok: {reason}" if ok else
                                                     f"FAILED: {reason}; see {os.path.join(run_dir, OUTPUT_FILE)}")
        print(f"[qualify] {line}", flush=True)
        if not ok:
            failed.append(str(i + 1))
            failures.append(f"trial {i + 1} {fault}: {reason}")
            if i + 1 < trials:  # one failed trial decides the key: the others would only cost their minutes
                print(f"[qualify] the key cannot qualify any more: trial(s) {i + 2}-{trials} not run", flush=True)
            break
    ran = int(failed[-1]) if failed else trials
    successes = ran - len(failures)
    evidence: dict[str, Any] = {"trials": ran, "successes": successes, "date": env_mod.today(),
                                "torch": torch_version, "backend": key.platform.partition("/")[2], "steps": steps}
    if failures:
        evidence["failures"] = failures
    actions = (env_mod.RESTART,) if failures else (env_mod.PRESERVE, env_mod.RESTART)
    try:
        envelope = env_mod.load_file(envelope_path)  # again: another qualification may have written meanwhile
        envelope.upsert(env_mod.Entry(key, actions, evidence))
        env_mod.save(envelope, envelope_path)
    except (ConfigError, OSError) as exc:
        print(f"accelpact-qualify: error: cannot write {envelope_path} ({exc}); the entry was "
              f"{env_mod.Entry(key, actions, evidence).as_dict()}", file=sys.stderr)
        return EXIT_USAGE
    if failures:
        print(f"accelpact-qualify: {key} NOT qualified: trial(s) {', '.join(failed)} of {trials} failed "
              f"(reasons above); recorded restart only for it in {envelope_path}", file=sys.stderr)
        return EXIT_NOT_QUALIFIED
    print(f"[qualify] {key} qualified: {successes}/{trials} trials repaired in process; preserve recorded in "
          f"{envelope_path}", flush=True)
    return EXIT_QUALIFIED
