"""Pure retention decisions: which snapshots of a node directory, and of the shared tier, to delete.

Node directory (:func:`plan_retention`; torchtitan's ``keep_latest_k``, with the guarantees the design asks for):

1. keep the newest ``keep_last`` snapshots that are not rejected;
2. keep every milestone (step divisible by ``milestone_every`` when it is > 0) that is not rejected;
3. never delete the newest verified snapshot (it is what a restart loads);
4. never delete a committed snapshot newer than the newest verified one (its verification is pending);
5. a rejected snapshot stays visible while it is newer than the oldest snapshot kept by rule 1, then goes;
6. never delete a step in ``protect`` (unless it is rejected here): the daemon passes the newest step verified on
   every node (:func:`newest_common`, from the other nodes' published indexes), so a node whose writes keep failing
   (a full disk) still shares one step with every other node.

Shared tier (:func:`plan_shared_retention`): milestones stay for good; of the others the newest ``shared_keep``
verified ones stay, and the newest verified one is never deleted.  Every decision comes with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence


@dataclass(frozen=True)
class Snap:
    step: int
    state: str  # committed | verified | rejected


def is_milestone(step: int, milestone_every: int) -> bool:
    return milestone_every > 0 and step > 0 and step % milestone_every == 0


def plan_retention(snaps: Iterable[Snap], keep_last: int, milestone_every: int = 0, protect: Iterable[int] = ()
                   ) -> tuple[list[tuple[int, str]], str]:
    """Return ``([(step, why deleted)], summary reason)``; the input is not modified.

    ``protect``: steps never deleted unless rejected, whatever the other rules say (rule 6: the daemon passes
    the newest common step, :func:`newest_common`).
    """
    if keep_last < 2:
        raise ValueError("keep_last must be >= 2: with one kept snapshot a crash while writing the next "
                         "leaves nothing verified to resume from")
    ordered: Sequence[Snap] = sorted(snaps, key=lambda s: s.step)
    live = [s for s in ordered if s.state != "rejected"]
    window = {s.step for s in live[-keep_last:]}
    verified = [s.step for s in ordered if s.state == "verified"]
    newest_verified = verified[-1] if verified else None
    oldest_window = min(window) if window else None
    protected = set(protect)
    deletions: list[tuple[int, str]] = []
    for s in ordered:
        if s.step in window:
            continue
        if s.step in protected and s.state != "rejected":
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


def newest_common(verified_by_node: Mapping[str, Iterable[int]]) -> tuple[int | None, str]:
    """The newest step verified on every node (each node lists its verified steps), with the reason.  Pure.

    Who calls: the daemon before each retention pass, with its own verified steps and those of every other
    node that published an index; the step it returns goes to :func:`plan_retention` as ``protect``.
    """
    if not verified_by_node:
        return None, "no node has published an index"
    sets = {node: set(steps) for node, steps in verified_by_node.items()}
    empty = sorted(node for node, s in sets.items() if not s)
    if empty:
        return None, f"no verified step on {', '.join(empty)}: no step is common to every node"
    common = set.intersection(*sets.values())
    if not common:
        newest = {node: max(s) for node, s in sets.items()}
        return None, ("no step is verified on every node (newest verified: "
                      + ", ".join(f"{n} {s}" for n, s in sorted(newest.items())) + ")")
    best = max(common)
    return best, f"step {best} is the newest step verified on every one of {len(sets)} node(s)"


def plan_shared_retention(snaps: Iterable[Snap], shared_keep: int, milestone_every: int = 0
                          ) -> tuple[list[tuple[int, str]], str]:
    """Which snapshots of the shared tier to delete: ``([(step, why)], summary)``.  Pure.

    Rules: every milestone stays (kept for good); of the others, the newest ``shared_keep`` verified ones
    stay; the newest verified snapshot is never deleted; a committed or rejected one stays while it is newer
    than the oldest verified one kept (a copy being recorded, or a rejection still worth seeing), then goes.
    Who calls: the daemon that has just uploaded a snapshot (:mod:`.tiers`), after the upload.
    """
    if shared_keep < 1:
        raise ValueError("shared_keep must be >= 1: the shared tier must keep at least its newest verified copy")
    ordered: Sequence[Snap] = sorted(snaps, key=lambda s: s.step)
    verified = [s.step for s in ordered if s.state == "verified"]
    newest_verified = verified[-1] if verified else None
    kept_verified = set([s for s in verified if not is_milestone(s, milestone_every)][-shared_keep:])
    oldest_kept = min(kept_verified) if kept_verified else None
    deletions: list[tuple[int, str]] = []
    for s in ordered:
        if is_milestone(s.step, milestone_every) or s.step in kept_verified or s.step == newest_verified:
            continue
        if s.state == "verified":
            deletions.append((s.step, f"outside the newest {shared_keep} verified shared copies and not a milestone"))
        elif oldest_kept is None or s.step > oldest_kept:
            continue
        else:
            deletions.append((s.step, f"{s.state} and older than the verified shared copies kept"))
    kept = len(ordered) - len(deletions)
    if not deletions:
        return [], f"nothing to delete in the shared tier: {kept} snapshot(s) within the rules"
    return deletions, f"delete {len(deletions)} of {len(ordered)} shared snapshot(s), keep {kept}"
