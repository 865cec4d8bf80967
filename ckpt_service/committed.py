"""The newest step the job committed and verified, per node, signed: a start that loads an older one says so.

Anyone who can write where snapshots live could delete the newer ones, or put an authentic older snapshot where
a newer one was (its signed manifest names its own step, so it is not taken for a newer one:
:func:`ckpt_service.verify.check_checksums`).  What is left is a start that silently goes back.  Each node's daemon
keeps ``RUN_DIR/ckpt-index/<node>.committed.json``: the newest step it verified, only ever raised, with an HMAC
under the run's key over the node's name and the step.  The restore compares what it loads with the newest signed
step of every node (:func:`rollback`): loading an older one (every newer copy lost, removed or rejected) is one
``warning`` event naming both steps, beside the ``restart_load`` event's ``committed`` field.  A record without a
valid MAC is ignored, with its reason: a forged record can only cause a warning, never hide one.

Torch-free.  Who calls: the daemon's verifier (:func:`record`), the restore's rank 0 (:func:`newest`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from typing import Iterable

from accelpact_slurm.core.atomic import write_json_atomic
from ckpt_service.layout import INDEX_DIR
from ckpt_service.safeio import read_json_why

log = logging.getLogger(__name__)

SUFFIX = ".committed.json"


def path_of(run_dir: str, node: str) -> str:
    return os.path.join(run_dir, INDEX_DIR, f"{node}{SUFFIX}")


def _mac(key: bytes, node: str, step: int) -> str:
    blob = json.dumps({"node": node, "step": int(step)}, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, b"accelpact-committed\0" + blob, hashlib.sha256).hexdigest()


def read(path: str, key: bytes) -> tuple[int | None, str]:
    """``(step, why)`` of one node's record; ``None`` with the reason when it is missing or not authentic."""
    doc, why = read_json_why(path)
    if why is not None:
        return None, why
    if not isinstance(doc, dict) or not isinstance(doc.get("node"), str) or type(doc.get("step")) is not int:
        return None, f"{path}: not a record of a committed step"
    if not hmac.compare_digest(str(doc.get("mac", "")), _mac(key, doc["node"], doc["step"])):
        return None, f"{path}: its MAC does not match the run's key (not written by this run); ignored"
    if os.path.basename(path) != f"{doc['node']}{SUFFIX}":
        return None, f"{path}: signed for node {doc['node']!r}, found under another name; ignored"
    return doc["step"], "signed"


def record(run_dir: str, node: str, step: int, key: bytes) -> bool:
    """Raise this node's record to ``step`` (never lower it); True when it was written."""
    path = path_of(run_dir, node)
    have, _why = read(path, key)
    if have is not None and have >= step:
        return False
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json_atomic(path, {"node": node, "step": int(step), "mac": _mac(key, node, step)})
    return True


def newest(run_dir: str, key: bytes) -> tuple[int | None, str | None, list[str]]:
    """``(step, node, ignored)``: the newest signed committed step over every node's record, the node that
    recorded it, and why any record was ignored."""
    d = os.path.join(run_dir, INDEX_DIR)
    try:
        names = sorted(n for n in os.listdir(d) if n.endswith(SUFFIX))
    except OSError:
        return None, None, []
    best: tuple[int, str] | None = None
    ignored: list[str] = []
    for name in names:
        step, why = read(os.path.join(d, name), key)
        if step is None:
            ignored.append(why)
            continue
        node = name[:-len(SUFFIX)]
        if best is None or step > best[0]:
            best = (step, node)
    return (best[0], best[1], ignored) if best else (None, None, ignored)


def rollback(loaded: int | None, committed: int | None, node: str | None,
             skipped: Iterable[int] = ()) -> str | None:
    """The warning for a start that loads an older step than the job committed, else None (pure).

    ``skipped``: the newer steps this start found but did not take (rejected, unverified: the ``restart_load``
    event says why for each).
    """
    if committed is None or (loaded is not None and loaded >= committed):
        return None
    what = f"step {loaded}" if loaded is not None else "nothing (a start from step 0)"
    cause = (f"step {committed} was found but not taken (the restart_load event's skipped says why)"
             if committed in set(skipped) else
             f"no copy of step {committed} was found: lost with its node, removed, or not reachable from here")
    return (f"rollback: this start loads {what}, but the job committed and verified step {committed} "
            f"(the signed record of {node}): {cause}; the updates after {loaded if loaded is not None else 0} "
            f"are trained again")
