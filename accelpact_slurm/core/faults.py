"""Fault injection for tests: one object, read from the environment once per process, passed in everywhere.

This is the one module that reads the test-only ``ACCELPACT_TEST_*`` / ``ACCELPACT_CKPT*`` variables
(subprocess tests cannot hand objects to a process they start).  Production modules never read them:
they receive a :class:`TestFaults` (``TestFaults()`` injects nothing) from their ``main``.

Production code never branches on a switch: a switch that breaks a step is one method here (``at_update_start``,
``reported_frontier``, ``slow_forward``), or in :mod:`ckpt_service.faults` for the checkpoint service, called where
the fault belongs and doing nothing on ``NO_FAULTS``; a switch that turns a guarantee off (a negative control) picks
another collaborator where the object is built (e.g. :func:`accelpact_slurm.runtime.state.buffers.forward_state`).
``tests/test_layers.py`` holds the tree to that. ``docs/fault-injection.md`` lists every switch and what it does.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Mapping

from accelpact_slurm.core.errors import ConfigError

log = logging.getLogger(__name__)

FRONTIER_SKEW = "ACCELPACT_TEST_FRONTIER_SKEW"
SKIP_RELOAD_CHECK = "ACCELPACT_TEST_SKIP_RELOAD_CHECK"
SKIP_REBIND = "ACCELPACT_TEST_SKIP_REBIND"
NO_RESTORE_COPY = "ACCELPACT_TEST_NO_RESTORE_COPY"
SKIP_DISCARD = "ACCELPACT_TEST_SKIP_DISCARD"
SKIP_REDO_RNG = "ACCELPACT_TEST_SKIP_REDO_RNG"
SKIP_EXTRA_RESTORE = "ACCELPACT_TEST_SKIP_EXTRA_RESTORE"
SKIP_BUFFER_RESTORE = "ACCELPACT_TEST_SKIP_BUFFER_RESTORE"
SKIP_RANK_BUFFERS = "ACCELPACT_TEST_SKIP_RANK_BUFFERS"
PAUSE_AT = "ACCELPACT_CKPTD_PAUSE_AT"
KILL_AFTER_STAGED = "ACCELPACT_CKPT_KILL_AFTER_STAGED"
CORRUPT_CAPTURE = "ACCELPACT_CKPT_CORRUPT_CAPTURE"
EXIT_AFTER_VERIFIED = "ACCELPACT_CKPT_EXIT_AFTER_VERIFIED"
SLOW_VERIFY = "ACCELPACT_CKPTD_SLOW_VERIFY"
CRASH_AT = "ACCELPACT_TEST_CRASH_AT"
HANG_AT = "ACCELPACT_TEST_HANG_AT"
SLOW_AT = "ACCELPACT_TEST_SLOW_AT"
PACE = "ACCELPACT_TEST_PACE"
NO_DETECTOR = "ACCELPACT_TEST_NO_DETECTOR"
BUG_RESTARTS = "ACCELPACT_TEST_BUG_RESTARTS"
KILL_NODE = "ACCELPACT_TEST_KILL_NODE"
DEAD_PEER_AS_BUG = "ACCELPACT_TEST_DEAD_PEER_AS_BUG"
RETRY_REPEATED = "ACCELPACT_TEST_RETRY_REPEATED"
NO_LAUNCHER_PORT = "ACCELPACT_TEST_NO_LAUNCHER_PORT"
#: Where ``ACCELPACT_TEST_KILL_NODE`` may kill: as the forward or the backward of update STEP begins, at its vote,
#: in its ``optimizer.step`` (``step``: after the vote decided the update commits, before the rank stepped), the
#: capture proof of snapshot STEP, the snapshot's hand-off to the daemon, the restore of snapshot STEP (after the
#: start's first restore round).
NODE_KILL_PHASES = ("forward", "backward", "vote", "step", "proof", "handoff", "restore")
CKPTD_KILL_AT = "ACCELPACT_CKPTD_KILL_AT"
#: One part a heal leaves out or breaks (the heal's negative controls): see :data:`HEAL_FAULTS`.
HEAL_FAULT = "ACCELPACT_TEST_HEAL_FAULT"
#: ``skip_transfer``: no shard is sent (the spare keeps its fresh weights); ``skip_packet``: the spare never applies
#: the dead rank's per-rank packet; ``tamper_manifest``: the source changes its manifest after signing it;
#: ``skip_vote_packet``: every rank hands its per-rank packet at each commit only, none at the vote (a rank lost
#: in the optimizer step leaves no packet of the update the survivors commit); ``no_standby``: the job's store gets
#: no standby (node 0's loss takes the store with it).
HEAL_FAULTS = ("skip_transfer", "skip_packet", "tamper_manifest", "skip_vote_packet", "no_standby")


@dataclass(frozen=True)
class TestFaults:
    """What a test asked this process to break; the default breaks nothing."""

    __test__ = False  # not a pytest test class

    frontier_skew: tuple[int, int] | None = None
    skip_reload_check: bool = False
    skip_rebind: bool = False
    no_restore_copy: bool = False
    skip_discard: bool = False
    skip_redo_rng: bool = False
    skip_extra_restore: bool = False
    skip_buffer_restore: bool = False
    skip_rank_buffers: bool = False
    pause_at: tuple[str, int | None] | None = None
    kill_after_staged: tuple[int, int] | None = None
    corrupt_capture: tuple[int, int] | None = None
    exit_after_verified: int | None = None
    slow_verify: tuple[str, float] | None = None
    crash_at: tuple[int, int] | None = None
    hang_at: tuple[int, int] | None = None
    slow_at: tuple[int, int, str] | None = None
    pace_s: float = 0.0
    no_detector: bool = False
    bug_restarts: bool = False
    kill_node: tuple[tuple[str, int, int], ...] = ()  # (phase, step, node) of this start
    dead_peer_as_bug: bool = False
    retry_repeated: bool = False
    no_launcher_port: bool = False
    ckptd_kill_at: tuple[str, int, str | None] | None = None
    heal_fault: str | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "TestFaults":
        env = os.environ if environ is None else environ
        first_start = int(env.get("SLURM_RESTART_COUNT") or 0) == 0
        pause = None
        if env.get(PAUSE_AT):
            phase, _, step = env[PAUSE_AT].partition(":")
            pause = (phase, _int(PAUSE_AT, step) if step else None)
        slow = None
        if env.get(SLOW_VERIFY) and first_start:
            node, _, secs = env[SLOW_VERIFY].rpartition(":")
            slow = (node, float(secs))
        exit_after = _int(EXIT_AFTER_VERIFIED, env[EXIT_AFTER_VERIFIED]) if env.get(EXIT_AFTER_VERIFIED) else None
        crash = None
        if env.get(CRASH_AT):
            step, rank, *always = env[CRASH_AT].split(":")
            if first_start or always == ["always"]:
                crash = (_int(CRASH_AT, step), _int(CRASH_AT, rank))
        slow_at = None
        if env.get(SLOW_AT) and first_start:
            step, rank, secs = env[SLOW_AT].split(":")
            slow_at = (_int(SLOW_AT, step), _int(SLOW_AT, rank), secs)
        pace = 0.0
        if env.get(PACE) and first_start:
            pace = _float(PACE, env[PACE])
        heal = env.get(HEAL_FAULT) or None
        if heal is not None and heal not in HEAL_FAULTS:
            raise ValueError(f"{HEAL_FAULT}={heal!r}: one of {', '.join(HEAL_FAULTS)}")
        return cls(
            heal_fault=heal,
            kill_node=_kill_node(env),
            dead_peer_as_bug=env.get(DEAD_PEER_AS_BUG) == "1",
            retry_repeated=env.get(RETRY_REPEATED) == "1",
            no_launcher_port=env.get(NO_LAUNCHER_PORT) == "1",
            pace_s=pace,
            hang_at=_pair(env, HANG_AT) if first_start else None,
            slow_at=slow_at,
            no_detector=env.get(NO_DETECTOR) == "1",
            bug_restarts=env.get(BUG_RESTARTS) == "1",
            frontier_skew=_pair(env, FRONTIER_SKEW),
            skip_reload_check=env.get(SKIP_RELOAD_CHECK) == "1",
            skip_rebind=env.get(SKIP_REBIND) == "1",
            no_restore_copy=env.get(NO_RESTORE_COPY) == "1",
            skip_discard=env.get(SKIP_DISCARD) == "1",
            skip_redo_rng=env.get(SKIP_REDO_RNG) == "1",
            skip_extra_restore=env.get(SKIP_EXTRA_RESTORE) == "1",
            skip_buffer_restore=env.get(SKIP_BUFFER_RESTORE) == "1",
            skip_rank_buffers=env.get(SKIP_RANK_BUFFERS) == "1",
            pause_at=pause,
            kill_after_staged=_pair(env, KILL_AFTER_STAGED),
            corrupt_capture=_pair(env, CORRUPT_CAPTURE),
            exit_after_verified=exit_after if first_start else None,
            slow_verify=slow,
            crash_at=crash,
            ckptd_kill_at=_kill_point(env.get(CKPTD_KILL_AT)) if first_start else None,
        )

    # ------------------------------------------------------------------ injection points

    def at_update_start(self, step: int, rank: int) -> None:
        """As update ``step`` begins on ``rank``: a crash (SIGKILL, as the OOM killer's) or a hang (SIGSTOP: alive,
        silent) when the test asked for one there; nothing otherwise."""
        if self.crash_at == (step, rank):
            log.warning("fault injection: rank %d crashes (SIGKILL) as update %d begins", rank, step)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.pace_s:
            time.sleep(self.pace_s)  # a slower model, not a synchronisation: the update's work is unchanged
        if self.hang_at == (step, rank):
            log.warning("fault injection: rank %d stops itself (SIGSTOP) as update %d begins", rank, step)
            os.kill(os.getpid(), signal.SIGSTOP)

    def kill_node_at(self, phase: str, step: int | None, node: int) -> None:
        """Every rank of the node the test named SIGKILLs itself here (``phase`` of ``step``); nothing otherwise."""
        if (phase, step, node) in self.kill_node:
            log.warning("fault injection: node %d loses this rank (SIGKILL) in %s of %s at %.6f", node, phase, step,
                        time.time())
            os.kill(os.getpid(), signal.SIGKILL)

    def reported_frontier(self, rank: int, step: int, frontier: int) -> int:
        """The frontier ``rank`` reports in the vote of update ``step`` (one ahead where the test skews it)."""
        return frontier + 1 if self.frontier_skew == (rank, step) else frontier

    def slow_forward(self, rank: int) -> tuple[int, str] | None:
        """``(update, seconds)`` this rank computes longer in that update's forward, or None."""
        if self.slow_at and self.slow_at[1] == rank:
            return self.slow_at[0], self.slow_at[2]
        return None


NO_FAULTS = TestFaults()


def _int(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(name, text, "must be an integer") from None


def _float(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):  # also refuses nan
        raise ConfigError(name, text, "must be a number of seconds, 0 or more")
    return value


def _kill_node(env: Mapping[str, str]) -> tuple[tuple[str, int, int], ...]:
    """``ACCELPACT_TEST_KILL_NODE``'s (phase, step, node) points of this start."""
    out = []
    for item in filter(None, (env.get(KILL_NODE) or "").split(",")):
        parts = item.split(":")
        if len(parts) not in (3, 4) or parts[0] not in NODE_KILL_PHASES:
            raise ConfigError(KILL_NODE, item, f"must be PHASE:STEP:NODE[:RESTART], PHASE one of "
                                               f"{', '.join(NODE_KILL_PHASES)}")
        restart = _int(KILL_NODE, parts[3]) if len(parts) == 4 else 0
        if restart == int(env.get("SLURM_RESTART_COUNT") or 0):
            out.append((parts[0], _int(KILL_NODE, parts[1]), _int(KILL_NODE, parts[2])))
    return tuple(out)


def _kill_point(text: str | None) -> tuple[str, int, str | None] | None:
    """``PHASE:STEP[:NODE]`` of ``ACCELPACT_CKPTD_KILL_AT``."""
    if not text:
        return None
    phase, _, rest = text.partition(":")
    step, _, node = rest.partition(":")
    return phase, _int(CKPTD_KILL_AT, step), node or None


def _pair(env: Mapping[str, str], name: str) -> tuple[int, int] | None:
    v = env.get(name)
    if not v:
        return None
    a, _, b = v.partition(":")
    return _int(name, a), _int(name, b)
