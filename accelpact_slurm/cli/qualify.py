"""``accelpact-qualify CONFIG``: earn (or refuse) the envelope entry for L1 Preserve on this platform.

One uninterrupted reference run of the job, then N trial runs that each inject a real fault in the phase qualified
(--phase): ``committed`` (a rank withholds its part of the replication collective at an update's committed
boundary), ``backward`` (it withholds every replication all-reduce of an update's backward; the update runs again), or
``all`` (both, after one shared reference run: what an unqualified release's start-up warning asks for).  A trial
succeeds when the run repairs in process (a ``repair`` event, no ``fail_stop``), exits 0 and ends with the reference
run's ``final_state_digest``.  The key <platform, profile, phase, objective> comes from the job itself (the reference
run's ``protected`` event); the objective is ``exact``.

The entry and its evidence (trials, successes, date, torch and backend versions, each failed trial's reason) go to
--envelope FILE, else $ACCELPACT_ENVELOPE, else $XDG_CONFIG_HOME/accelpact/envelope.yaml
(~/.config/accelpact/envelope.yaml), which the runtime layers over the shipped envelope for the user's next job.  All
trials passing qualifies the key (preserve, restart); the first failed trial ends the qualification and records
restart only, which overrides a shipped entry for that key.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from typing import Sequence

from accelpact_slurm.core import settings
from accelpact_slurm.core.config import load_config
from accelpact_slurm.core.errors import EXIT_USAGE, AccelpactError
from accelpact_slurm.launch.qualify import (ALL_PHASES, DEFAULT_PHASE, EXIT_CODES, PHASES, check_envelope_file,
                                            check_job, envelope_target, qualify)
from accelpact_slurm.runtime.job import envelope as env_mod

EPILOG = "\n\n".join(__doc__.split("\n\n")[1:]).replace("``", "") + "\n\nexit codes:\n" + "\n".join(
    f"  {code}  {text}" for code, text in sorted(EXIT_CODES.items())) + \
    "\n\ndocumentation: docs/l1-backward.md#which-faults-take-this-path, docs/detection.md#every-stop-says-why"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="accelpact-qualify", description=__doc__.split("\n\n")[0].replace("``", ""),
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", metavar="CONFIG",
                   help="job file whose platform, topology and FSDP flavour are qualified (its faults list must be "
                        "empty: the trials inject their own)")
    p.add_argument("--trials", type=int, default=env_mod.MIN_TRIALS, metavar="N",
                   help=f"fault-and-repair trials, at least {env_mod.MIN_TRIALS} (default {env_mod.MIN_TRIALS}, "
                        f"the minimum that qualifies a key)")
    p.add_argument("--envelope", metavar="FILE",
                   help=f"envelope file to update (default: ${settings.ENVELOPE} if set, else "
                        f"$XDG_CONFIG_HOME/accelpact/envelope.yaml or ~/.config/accelpact/envelope.yaml, which the "
                        f"runtime layers over the shipped envelope); created if missing")
    p.add_argument("--steps", type=int, default=12, metavar="N",
                   help="updates per run, at least 3 (default 12)")
    p.add_argument("--phase", choices=[*sorted(PHASES), ALL_PHASES], default=DEFAULT_PHASE,
                   help="the failure phase to qualify: committed (a fault at the guard's collective; default), "
                        "backward (a replication fault during backward: the update is discarded and runs again), "
                        f"or {ALL_PHASES} (each in turn, after one shared reference run)")
    p.add_argument("--work-dir", metavar="DIR",
                   help="folder under which a fresh folder holds the runs' directories (default: the system's "
                        "temporary folder); they are kept for inspection")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config)
        check_job(cfg, args.trials, args.steps)
        path, field, note = envelope_target(args.envelope, os.environ)
        check_envelope_file(path, field)
        if args.work_dir:
            os.makedirs(args.work_dir, exist_ok=True)
        # A fresh folder every time: a trial must never reload an earlier run's snapshots.
        work = tempfile.mkdtemp(prefix="accelpact-qualify-", dir=args.work_dir)
    except (AccelpactError, OSError) as exc:
        print(f"accelpact-qualify: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    stop: dict[str, int | None] = {"signal": None}

    def on_signal(signum, frame):  # only records it: the wait for the running run sees it and stops that run
        stop["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return qualify(args.config, cfg, envelope_path=path, note=note, trials=args.trials, steps=args.steps,
                       work=work, phase=list(PHASES) if args.phase == ALL_PHASES else args.phase, stop=stop)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
