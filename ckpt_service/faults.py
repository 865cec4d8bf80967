"""Fault-injection points for the kill -9 tests (the one place this package reads ``ACCELPACT_CKPT*``).

- ``ACCELPACT_CKPTD_PAUSE_AT=PHASE[:STEP]`` makes the daemon write ``<node dir>/.paused-PHASE`` and block
  (up to 600 s) when it reaches PHASE, so that a test can SIGKILL it at exactly that point.  Phases:
  ``staging`` (first rank's shards received, snapshot not complete), ``writing`` (shard files written,
  no ``.metadata`` yet), ``written`` (complete and durable under the temporary name, not renamed),
  ``renamed`` (renamed into ``step-N``, state not recorded).
- ``ACCELPACT_CKPT_KILL_AFTER_STAGED=STEP:RANK``: that rank SIGKILLs itself once the daemon
  acknowledged its staged step STEP.
- ``ACCELPACT_CKPT_CORRUPT_CAPTURE=STEP:RANK``: that rank flips one element of its first weight box in
  the slot after copying snapshot STEP (a wrong capture: what the live-loss proof must catch).
- ``ACCELPACT_CKPT_EXIT_AFTER_VERIFIED=STEP``: every rank waits until its node's snapshot STEP is
  verified, then the job exits with the "requeue me" code (used to stop a run after a verified snapshot).
- ``ACCELPACT_CKPTD_SLOW_VERIFY=NODE:SECONDS``: the daemon of node NODE holds every verification SECONDS
  longer (first start only), so that one node settles a snapshot well after the others.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Mapping

log = logging.getLogger(__name__)

PAUSE_AT = "ACCELPACT_CKPTD_PAUSE_AT"
KILL_AFTER_STAGED = "ACCELPACT_CKPT_KILL_AFTER_STAGED"
EXIT_AFTER_VERIFIED = "ACCELPACT_CKPT_EXIT_AFTER_VERIFIED"
CORRUPT_CAPTURE = "ACCELPACT_CKPT_CORRUPT_CAPTURE"
SLOW_VERIFY = "ACCELPACT_CKPTD_SLOW_VERIFY"
PHASES = ("staging", "writing", "written", "renamed")
PAUSE_LIMIT_S = 600.0


def pause_point(phase: str, ndir: str, step: int | None = None, environ: Mapping[str, str] | None = None) -> None:
    """Block here when ``ACCELPACT_CKPTD_PAUSE_AT`` is ``PHASE`` or ``PHASE:STEP`` and matches."""
    environ = os.environ if environ is None else environ
    want = (environ.get(PAUSE_AT) or "").split(":")
    if want[0] != phase or (len(want) > 1 and step is not None and int(want[1]) != step):
        return
    marker = os.path.join(ndir, f".paused-{phase}")
    with open(marker, "w") as fh:
        fh.write(f"{os.getpid()}\n")
    log.warning("fault injection: paused at %s (marker %s)", phase, marker)
    threading.Event().wait(PAUSE_LIMIT_S)


def kill_after_staged(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    environ = os.environ if environ is None else environ
    v = environ.get(KILL_AFTER_STAGED)
    if not v:
        return None
    step, rank = v.split(":")
    return int(step), int(rank)


def corrupt_capture(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    environ = os.environ if environ is None else environ
    v = environ.get(CORRUPT_CAPTURE)
    if not v:
        return None
    step, rank = v.split(":")
    return int(step), int(rank)


def exit_after_verified(environ: Mapping[str, str] | None = None) -> int | None:
    """The step after whose verification the ranks exit 75 (first start only, like every injected fault)."""
    environ = os.environ if environ is None else environ
    v = environ.get(EXIT_AFTER_VERIFIED)
    if not v or int(environ.get("SLURM_RESTART_COUNT") or 0) > 0:
        return None
    return int(v)


def slow_verify(node: str, environ: Mapping[str, str] | None = None) -> None:
    """Hold this verification when ``ACCELPACT_CKPTD_SLOW_VERIFY`` names this node (first start only)."""
    environ = os.environ if environ is None else environ
    v = environ.get(SLOW_VERIFY)
    if not v or int(environ.get("SLURM_RESTART_COUNT") or 0) > 0:
        return
    host, seconds = v.rsplit(":", 1)
    if host == node:
        log.warning("fault injection: verification on %s held %s s", node, seconds)
        threading.Event().wait(float(seconds))
