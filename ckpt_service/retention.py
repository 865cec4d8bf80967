"""Pure retention decision: which snapshots of a node directory to delete.

Rules (torchtitan's ``keep_latest_k``, with the guarantees the design asks for):

1. keep the newest ``keep_last`` snapshots that are not rejected;
2. keep every milestone (step divisible by ``milestone_every`` when it is > 0) that is not rejected;
3. never delete the newest verified snapshot (it is what a restart loads);
4. never delete a committed snapshot newer than the newest verified one (its verification is pending);
5. a rejected snapshot stays visible while it is newer than the oldest snapshot kept by rule 1,
   then goes.

Every decision comes with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Snap:
    step: int
    state: str  # committed | verified | rejected


def is_milestone(step: int, milestone_every: int) -> bool:
    return milestone_every > 0 and step > 0 and step % milestone_every == 0


def plan_retention(snaps: Iterable[Snap], keep_last: int, milestone_every: int = 0
                   ) -> tuple[list[tuple[int, str]], str]:
    """Return ``([(step, why deleted)], summary reason)``; the input is not modified."""
    if keep_last < 2:
        raise ValueError("keep_last must be >= 2: with one kept snapshot a crash while writing the next "
                         "leaves nothing verified to resume from")
    ordered: Sequence[Snap] = sorted(snaps, key=lambda s: s.step)
    live = [s for s in ordered if s.state != "rejected"]
    window = {s.step for s in live[-keep_last:]}
    verified = [s.step for s in ordered if s.state == "verified"]
    newest_verified = verified[-1] if verified else None
    oldest_window = min(window) if window else None
    deletions: list[tuple[int, str]] = []
    for s in ordered:
        if s.step in window:
            continue
        if s.state == "rejected":
            if oldest_window is not None and s.step > oldest_window:
                continue
            deletions.append((s.step, "rejected and older than the retention window"))
            continue
        if is_milestone(s.step, milestone_every):
            continue
        if s.step == newest_verified:
            continue
        if s.state == "committed" and (newest_verified is None or s.step > newest_verified):
            continue
        deletions.append((s.step, f"outside the newest {keep_last} and not a milestone"))
    kept = len(ordered) - len(deletions)
    if not deletions:
        return [], f"nothing to delete: {kept} snapshot(s) within the rules"
    return deletions, f"delete {len(deletions)} of {len(ordered)}, keep {kept}"
