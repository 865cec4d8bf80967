#!/usr/bin/env python3
"""Earn the shipped envelope's CPU/Gloo keys with accelpact-qualify trials, on each torch release asked for.

    python3 scripts/earn_envelope.py --python .venv/bin/python --python VENV2/bin/python --write
    python3 scripts/earn_envelope.py --python .venv/bin/python           # earn and compare (exit 1 on a gap)

For each interpreter (one torch release each) and each HSDP wrapping the runtime supports (FSDP1 on
job.mesh, FSDP1 on job.groups, FSDP2 on job.mesh), this runs ``accelpact-qualify --phase all`` on the
decoder example shortened to a few updates: one reference run, then the minimum number of real
fault-and-repair trials for the committed phase and for the backward phase.  A batch-norm model (the vision
example's ``mobilenet``: running statistics per rank that every forward changes, and that a discarded update
must put back) goes through the same trials on the wrapping the README recommends (:data:`BATCHNORM`); a key
is earned only when its trials pass there too.  The entries it writes are the evidence:

* ``--write``: they replace that release's entries in the shipped envelope
  (``accelpact_slurm/data/envelope.yaml``); nothing in it is written by hand.
* without it: each earned key must be in the shipped envelope with the same actions, and a key the
  shipped envelope qualifies must have been earned again here; a difference exits 1, naming the
  release, the wrapping and the phase.

The test run does the comparison on every release it tests (``tests/e2e/test_envelope_earned.py``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from typing import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from accelpact_slurm.core import settings  # noqa: E402
from accelpact_slurm.runtime.job import envelope as env_mod  # noqa: E402

DECODER_JOB = os.path.join(REPO, "examples", "decoder", "job.yaml")
#: (fsdp, mesh) of each wrapping qualified: the profile key's ``fsdp1-device_mesh`` and so on.
WRAPPINGS = (("fsdp1", "device_mesh"), ("fsdp1", "group_pair"), ("fsdp2", "device_mesh"))
STEPS = 6
TRIALS = env_mod.MIN_TRIALS
VISION_JOB = os.path.join(REPO, "examples", "vision", "job.yaml")
#: (model, fsdp, mesh) of the batch-norm trials: the vision example with that model, tiny (4 channels, 8 x 8 images)
BATCHNORM = (("mobilenet", "fsdp1", "device_mesh"),)


def job_file(folder: str, fsdp: str, mesh: str, model: str | None = None) -> str:
    """The decoder example for ``(fsdp, mesh)`` (or the vision example with the batch-norm ``model``): a 2 s
    collective timeout, one start per run, no snapshots."""
    source = DECODER_JOB if model is None else VISION_JOB
    with open(source, encoding="utf-8") as fh:
        text = fh.read()
    text = re.sub(r"^entry: (\w+):(\w+)", lambda m: f"entry: {os.path.join(os.path.dirname(source), m[1])}"
                  f".py:{m[2]}", text, count=1, flags=re.M)
    if model is None:
        edits = (("every_steps: 10", "every_steps: 0"), ("fsdp: fsdp1 ", f"fsdp: {fsdp} "),
                 ("mesh: device_mesh ", f"mesh: {mesh} "))
    else:  # the vision example shards on job.mesh only
        edits = (("every_steps: 8", "every_steps: 0"), ("fsdp: fsdp2 ", f"fsdp: {fsdp} "),
                 ("model: vision ", f"model: {model} "), ("norm: group ", "norm: batch "),
                 ("channels: 16", "channels: 4"), ("image_size: 16", "image_size: 8"), ("accumulate: 2 ", "accumulate: 1 "))
    for old, new in (("collective_s: 5", "collective_s: 2"), ("max_restarts: 20", "max_restarts: 0"), *edits):
        if old not in text:
            raise SystemExit(f"earn_envelope: error: {source} no longer holds {old!r}; update WRAPPINGS/job_file")
        text = text.replace(old, new, 1)
    path = os.path.join(folder, f"job-{fsdp}-{mesh}{'-' + model if model else ''}.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path


def earn(python: str, work: str, *, out=sys.stdout, timeout_s: float = 900) -> tuple[str, env_mod.Envelope, list[str]]:
    """Qualify every wrapping on ``python``'s torch: ``(its release, the entries earned, failures)``."""
    release = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                             text=True, check=True, env=_env()).stdout.strip()
    folder = os.path.join(work, env_mod.release_of(release))
    os.makedirs(folder, exist_ok=True)
    earned = os.path.join(folder, "envelope.yaml")
    batchnorm = os.path.join(folder, "envelope-batchnorm.yaml")
    failures = []
    runs = [(fsdp, mesh, None, earned) for fsdp, mesh in WRAPPINGS]
    runs += [(fsdp, mesh, model, batchnorm) for model, fsdp, mesh in BATCHNORM]
    for fsdp, mesh, model, envelope in runs:
        job = job_file(folder, fsdp, mesh, model)
        name = f"{fsdp}-{mesh}" + (f"-{model}" if model else "")
        cmd = [python, "-m", "accelpact_slurm.cli.qualify", job, "--phase", "all", "--steps", str(STEPS),
               "--trials", str(TRIALS), "--envelope", envelope, "--work-dir", os.path.join(folder, name)]
        print(f"[earn] torch {release} {name}: {' '.join(cmd[1:3])} ... --phase all", file=out, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=_env(), cwd=REPO)
        for line in proc.stdout.splitlines():
            if line.startswith("[qualify] trial ") or " qualified: " in line or "NOT qualified" in line:
                print(f"  {line}", file=out, flush=True)
        if proc.returncode != 0:
            failures.append(f"torch {release} {name}: accelpact-qualify exited {proc.returncode}: "
                            f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    got = env_mod.load_file(earned)
    failures += batchnorm_gaps(release, got, env_mod.load_file(batchnorm) if os.path.exists(batchnorm) else None)
    return env_mod.release_of(release), got, failures


def batchnorm_gaps(release: str, earned: env_mod.Envelope, batchnorm: env_mod.Envelope | None) -> list[str]:
    """Where the batch-norm model's trials disagree with the decoder's: a key earned only if both earn it."""
    if batchnorm is None:
        return [f"torch {release}: the batch-norm model's trials wrote no entry"]
    gaps = []
    for b in batchnorm.entries:
        e = earned.find(b.key)
        if e is None or tuple(e.actions) != tuple(b.actions):
            gaps.append(f"torch {release}: the batch-norm model earned {'/'.join(b.actions)} for {b.key}, the "
                        f"decoder {'/'.join(e.actions) if e else 'nothing'}")
    return gaps


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop(settings.ENVELOPE, None)  # the trials' envelope is the one this script names
    env.pop(settings.QUALIFYING, None)
    return env


def compare(release: str, earned: env_mod.Envelope, shipped: env_mod.Envelope) -> list[str]:
    """What differs between the keys earned on ``release`` and the shipped envelope's for it."""
    platform = env_mod.platform_key(release, "gloo")
    gaps = []
    for e in earned.entries:
        s = shipped.find(e.key)
        if s is None:
            gaps.append(f"torch {release}: the shipped envelope has no entry for {e.key} (earned here: "
                        f"{'/'.join(e.actions)}); run scripts/earn_envelope.py --write on this release")
        elif tuple(s.actions) != tuple(e.actions):
            gaps.append(f"torch {release}: the shipped envelope says {'/'.join(s.actions)} for {e.key}, the trials "
                        f"here earned {'/'.join(e.actions)}")
    for s in shipped.entries:
        if s.key.platform == platform and earned.find(s.key) is None:
            gaps.append(f"torch {release}: the shipped entry {s.key} was not earned again here")
    return gaps


def merge(shipped: env_mod.Envelope, release: str, earned: env_mod.Envelope) -> env_mod.Envelope:
    """The shipped envelope with ``release``'s CPU/Gloo entries replaced by ``earned``, in a stable order."""
    kept = [e for e in shipped.entries if not _same_platform(e.key.platform, release)]
    return env_mod.Envelope(sorted(kept + list(earned.entries), key=_order), shipped.path)


def _same_platform(platform: str, release: str) -> bool:
    """``platform`` is ``release``'s CPU/Gloo key, in today's spelling or an older one with the build label."""
    head, _, backend = platform.partition("/")
    return backend == "gloo" and env_mod.release_of(head.removeprefix("torch-")) == release


def _order(e: env_mod.Entry):
    release = e.key.platform.partition("/")[0].removeprefix("torch-")
    nums = tuple(int(x) if x.isdigit() else 0 for x in release.split("."))
    return (nums, e.key.platform, e.key.profile, env_mod.QUALIFIABLE_PHASES.index(e.key.phase)
            if e.key.phase in env_mod.QUALIFIABLE_PHASES else 9)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]).replace("``", ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", action="append", required=True, metavar="PY",
                   help="an interpreter with one torch release and the project's requirements "
                        "(scripts/torch_venv.py builds one); repeat for each release")
    p.add_argument("--write", action="store_true", help="replace each release's entries in the shipped envelope")
    p.add_argument("--work-dir", help="where the runs go (default: a fresh temporary folder)")
    args = p.parse_args(argv)
    if args.work_dir:
        os.makedirs(args.work_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="accelpact-earn-", dir=args.work_dir)
    shipped = env_mod.load_file(env_mod.SHIPPED)
    problems = []
    for python in args.python:
        release, earned, failures = earn(python, work)
        problems += failures
        if args.write:
            if failures:
                print(f"[earn] torch {release}: not written (a qualification failed)", flush=True)
                continue
            shipped = merge(shipped, release, earned)
            env_mod.save(shipped, env_mod.SHIPPED)
            print(f"[earn] torch {release}: {len(earned.entries)} entries written to {env_mod.SHIPPED}", flush=True)
        else:
            problems += compare(release, earned, shipped)
    for line in problems:
        print(f"earn_envelope: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
