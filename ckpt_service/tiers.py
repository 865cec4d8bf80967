"""The shared tier: verified snapshots copied asynchronously and atomically to the job's shared directory.

What goes there (pure :func:`should_upload`, asked by the daemon once a snapshot is verified): every
``checkpoint.shared_every``-th snapshot, **once per job** (snapshot ``n = step // every_steps`` when
``n % shared_every == 0``, copied by node ``(n // shared_every) % num_nodes``: the uploader rotates, so no node's disk
or link carries every copy); every milestone (``checkpoint.milestone_every``), by every node.

The copy (:func:`copy_to_shared`) of the node's *verified* copy, its ``state.json`` with it, goes to
``<shared>/.tmp-step-N-<node>-<pid>``, every file and the directory fsynced, then is renamed to ``<shared>/step-N``:
the first rename wins, the others discard theirs, and a half-copied snapshot is never visible.  The uploader then
prunes the tier (:func:`prune_shared`, rules in :func:`ckpt_service.retention.plan_shared_retention`): rename to
``.del-...`` first, then remove, so two daemons pruning at once never list or load a half-deleted snapshot.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat

from ckpt_service.index import fsync_dir, scan
from ckpt_service.layout import DEL_PREFIX, STEP_PREFIX, TMP_PREFIX, step_dirname
from ckpt_service.retention import Snap, is_milestone, plan_shared_retention
from ckpt_service.safeio import NotRegular, entries, kind, open_regular

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- pure decision


def should_upload(step: int, *, every_steps: int, shared_every: int, milestone_every: int,
                  node_index: int | None, num_nodes: int | None) -> tuple[bool, str]:
    """Whether this node copies its verified snapshot of ``step`` to the shared tier, and why.  Pure.

    Who calls: the daemon's verifier, once per verified snapshot.  ``every_steps`` <= 0 counts every
    step as a snapshot.  Without a usable ``node_index``/``num_nodes`` every node copies a due snapshot
    and the first rename wins (the same result, at the cost of the other copies).
    """
    if is_milestone(step, milestone_every):
        return True, f"step {step} is a milestone (every {milestone_every}): every node copies it, the first wins"
    if shared_every <= 0:
        return False, "checkpoint.shared_every is 0: only milestones go to the shared tier"
    every = every_steps if every_steps > 0 else 1
    n = step // every
    if n % shared_every:
        return False, f"snapshot number {n} (step {step} // {every}) is not a multiple of shared_every {shared_every}"
    if node_index is None or not num_nodes or not 0 <= node_index < num_nodes:
        return True, (f"snapshot number {n} is due; node index {node_index} of {num_nodes} nodes is unknown or out "
                      f"of range, so every node copies it and the first wins")
    turn = (n // shared_every) % num_nodes
    if turn != node_index:
        return False, f"snapshot number {n} is due, uploaded by node index {turn} of {num_nodes}, not this one"
    return True, f"snapshot number {n} is due (every {shared_every}), node index {turn} of {num_nodes} uploads it"


# --------------------------------------------------------------------------- I/O


def _copy_flat(src: str, dst: str) -> None:
    """Copy the regular files of the snapshot directory ``src`` into the new directory ``dst``.

    A snapshot is one flat directory of regular files.  Anything else in it (a link to ``/usr``, a FIFO, a
    sub-directory) refuses the copy: it is no file of this service, and following it would copy whatever it
    names (another user's folder, the system's tree) into the shared tier.

    Raises:
        NotRegular: naming the entry and what it is.
    """
    os.mkdir(dst)
    for name, st in entries(src):
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(errno.EINVAL, f"{os.path.join(src, name)}:", f"{name} is {kind(st.st_mode)}, not a "
                                                                         f"regular file: the snapshot is not copied")
        fd, _st = open_regular(os.path.join(src, name))
        try:
            with os.fdopen(fd, "rb", closefd=False) as fin, \
                    open(os.path.join(dst, name), "xb") as fout:
                shutil.copyfileobj(fin, fout, 4 << 20)
                fout.flush()
                os.fsync(fout.fileno())
        finally:
            os.close(fd)


def copy_to_shared(src: str, shared: str, node: str) -> tuple[str | None, str]:
    """Copy the snapshot ``src`` into ``shared``; return ``(path or None, reason)``.

    Raises:
        OSError: the copy failed (:class:`ckpt_service.safeio.NotRegular` when ``src`` holds anything but
            regular files); nothing is left in ``shared``.
    """
    name = os.path.basename(src.rstrip("/"))
    final = os.path.join(shared, name)
    if os.path.exists(final):
        return None, f"{final} already exists (another node copied it)"
    os.makedirs(shared, exist_ok=True)
    tmp = os.path.join(shared, f"{TMP_PREFIX}{name}-{node}-{os.getpid()}")
    try:
        _copy_flat(src, tmp)  # every file fsynced as it is written
        fsync_dir(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if os.path.exists(final):
                shutil.rmtree(tmp, ignore_errors=True)
                return None, f"{final} appeared meanwhile (another node copied it)"
            raise
        fsync_dir(shared)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final, f"copied to {final}"


def drop_dead_copies(shared: str, node: str) -> list[str]:
    """Remove ``node``'s half-made copies (``<shared>/.tmp-step-N-<node>-<pid>``) whose daemon is dead; return them.

    Who calls: the embedded default's launcher at the end of every start
    (:func:`accelpact_slurm.launch.daemons.drop_leftover_staging`), on the host that ran the daemon (the pid is
    that host's).  A daemon killed during an
    upload cannot remove its copy, and nothing else would: a live daemon's copy is left alone."""
    removed: list[str] = []
    prefix = f"{TMP_PREFIX}{STEP_PREFIX}"
    try:
        names = os.listdir(shared)
    except OSError:
        return removed
    for name in sorted(names):
        rest, _, pid = name.rpartition("-")
        if not name.startswith(prefix) or not rest.endswith(f"-{node}") or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # its daemon lives: the copy is in progress
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's process: not ours to judge
        path = os.path.join(shared, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed


def prune_shared(shared: str, shared_keep: int, milestone_every: int, node: str) -> list[tuple[int, str]]:
    """Delete what :func:`plan_shared_retention` says of ``shared``; return ``[(step, why)]`` actually deleted.

    Who calls: the daemon that has just uploaded (``ckptd-tier`` thread).  Each deletion renames the
    snapshot to ``.del-step-N-<node>-<pid>`` first: a restore scanning the tier meanwhile never sees half of
    one, and when two daemons prune at once the second rename fails (the first took it) and is skipped.
    Leftover ``.del-`` directories (a daemon killed while removing one) are removed too.
    """
    snaps = [Snap(r.step, r.state) for r in scan(shared, milestone_every)]
    plan, why = plan_shared_retention(snaps, shared_keep, milestone_every)
    done: list[tuple[int, str]] = []
    for step, reason in plan:
        src = os.path.join(shared, step_dirname(step))
        aside = os.path.join(shared, f"{DEL_PREFIX}{step_dirname(step)}-{node}-{os.getpid()}")
        try:
            os.rename(src, aside)
        except FileNotFoundError:  # another daemon pruned it first
            continue
        except OSError:
            log.warning("could not delete shared step %d", step, exc_info=True)
            continue
        shutil.rmtree(aside, ignore_errors=True)
        done.append((step, reason))
        log.info("deleted shared step %d: %s", step, reason)
    try:
        leftovers = [n for n in os.listdir(shared) if n.startswith(DEL_PREFIX)]
    except OSError:
        leftovers = []
    for n in leftovers:
        shutil.rmtree(os.path.join(shared, n), ignore_errors=True)
    if done:
        fsync_dir(shared)
    log.debug("shared tier retention: %s", why)
    return done
