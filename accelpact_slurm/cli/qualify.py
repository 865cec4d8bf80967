"""``accelpact-qualify CONFIG``: earn (or refuse) the envelope entry for L1 Preserve on this platform.

Runs one uninterrupted reference run, then N runs that each inject a real boundary
fault (a rank withholds its part of the replication collective) with Preserve
attempted.  A trial succeeds when the run repairs in process (a ``repair`` event,
no fail-stop) and ends with the reference run's ``final_state_digest``.  The
entry for <platform, profile, committed, exact> is written with the evidence
(trials, successes, date, torch and backend versions) into the envelope file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Sequence

from accelpact_slurm.runtime import envelope as env_mod
from accelpact_slurm.core.config import load_config
from accelpact_slurm.core.errors import EXIT_USAGE, AccelpactError
from accelpact_slurm.core.events import read_events


def _run(config: str, run_dir: str, extra: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, dict | None]:
    cmd = [sys.executable, "-m", "accelpact_slurm.cli.run", config, "--run-dir", run_dir, *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    try:
        with open(os.path.join(run_dir, "summary.json")) as fh:
            return proc.returncode, json.load(fh)
    except FileNotFoundError:
        return proc.returncode, None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="accelpact-qualify", description=__doc__.split("\n\n")[0],
                                epilog=" ".join(__doc__.split("\n\n")[1].split()))
    p.add_argument("config", metavar="CONFIG", help="job file whose topology and FSDP flavour are qualified")
    p.add_argument("--trials", type=int, default=env_mod.MIN_TRIALS, metavar="N",
                   help=f"fault-and-repair trials (default {env_mod.MIN_TRIALS}, the minimum that qualifies)")
    p.add_argument("--envelope", metavar="FILE", default=env_mod.SHIPPED,
                   help="envelope file to update (default: the one shipped in the package)")
    p.add_argument("--steps", type=int, default=12, metavar="N", help="updates per trial run (default 12)")
    p.add_argument("--work-dir", metavar="DIR", help="where trial run directories go (default: a temporary dir)")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except AccelpactError as exc:
        print(f"accelpact-qualify: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.trials < 1 or args.steps < 3:
        print("accelpact-qualify: error: --trials must be >= 1 and --steps >= 3", file=sys.stderr)
        return EXIT_USAGE
    import torch

    from accelpact_slurm.core import settings

    work = args.work_dir or tempfile.mkdtemp(prefix="accelpact-qualify-")
    env = dict(os.environ)
    env.pop(settings.QUALIFYING, None)
    timeout = 60 + args.steps * 10
    print(f"[qualify] {args.trials} trials of {args.steps} updates in {work}", flush=True)
    rc, ref = _run(args.config, os.path.join(work, "reference"), ["--steps", str(args.steps)], env, timeout)
    if rc != 0 or ref is None:
        print(f"accelpact-qualify: error: the uninterrupted reference run failed (exit {rc})", file=sys.stderr)
        return 1
    # The key comes from the job itself: the platform and the wrapping its entry point chose.
    protected = [e for e in read_events(os.path.join(work, "reference", "events.jsonl")) if e["event"] == "protected"]
    if not protected:
        print("accelpact-qualify: error: the reference run never called job.protect", file=sys.stderr)
        return 1
    key = env_mod.Key(protected[0]["platform"], protected[0]["profile"], "committed")
    print(f"[qualify] key {key}", flush=True)
    env[settings.QUALIFYING] = "1"
    world = cfg.world_size
    successes = 0
    for i in range(args.trials):
        step, rank = 1 + (i * 3) % (args.steps - 1), (i + 1) % world
        run_dir = os.path.join(work, f"trial-{i}")
        rc, summary = _run(args.config, run_dir, ["--steps", str(args.steps), "--inject-fault",
                                                  f"boundary:{step}:{rank}"], env, timeout)
        repaired = any(e["event"] == "repair" for e in read_events(os.path.join(run_dir, "events.jsonl")))
        ok = rc == 0 and repaired and summary is not None and \
            summary["final_state_digest"] == ref["final_state_digest"]
        successes += ok
        print(f"[qualify] trial {i + 1}/{args.trials}: boundary fault after update {step} on rank {rank}: "
              f"{'repaired, digest equal' if ok else f'FAILED (exit {rc}, repaired={repaired})'}", flush=True)
    envelope = env_mod.load(args.envelope)
    evidence = {"trials": args.trials, "successes": successes, "date": env_mod.today(),
                "torch": str(torch.__version__), "backend": "gloo", "steps": args.steps}
    actions = (env_mod.PRESERVE, env_mod.RESTART) if successes == args.trials else (env_mod.RESTART,)
    envelope.upsert(env_mod.Entry(key, actions, evidence))
    env_mod.save(envelope, args.envelope)
    verdict = "qualified" if successes == args.trials and args.trials >= env_mod.MIN_TRIALS else "NOT qualified"
    print(f"[qualify] {successes}/{args.trials} successful: Preserve {verdict} for {key}; wrote {args.envelope}")
    return 0 if successes == args.trials else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
