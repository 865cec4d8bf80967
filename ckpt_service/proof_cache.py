"""Which capture plans this job has proven: the capture proof runs once per job and plan, not on every start.

The capture proof (:mod:`.proof`) shows that a plan's mapping (which boxes of which tensors a rank stages
where) reproduces the framework's own state dict.  It needs ``get_state_dict``, a collective, and a pass over
every element: on a 110M-parameter model 16-30 s, on the first snapshot of every start, so after every
restart.  The mapping is a function of the plan alone: a plan whose description (keys, shapes, dtypes, boxes and
their places in the slot), torch release and place in the world equal those of one proven earlier in the job
maps the same way (its plain part's tensors by path, shape and dtype included).  So the first snapshot of a start skips the proof when every rank's plan signature is in
this record; a new model, wrapping, world size or torch release proves again.

The record (``capture-proven.json`` in the run directory) is signed with the run's key
(:mod:`.auth`): a record someone else wrote, or one from another run, is ignored, and the proof runs.

Who calls: :class:`ckpt_service.client.SnapshotClient`, rank 0 reading it before the first snapshot's exchange
and writing it after a proof every node passed.  Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any, Iterable

from accelpact_slurm.core.atomic import write_json_atomic

from ckpt_service import auth
from ckpt_service.index import read_json

log = logging.getLogger(__name__)

FILE = "capture-proven.json"
#: At most this many signatures are kept (the newest): a job that keeps changing its plan proves each anew.
KEEP = 256


def signature(plan: Any, rank: int, world_size: int) -> str:
    """A plan's signature: its description, the rank's place and the torch release, hashed (pure but for torch's
    version)."""
    import torch

    from ckpt_service.proof import plain_tensors

    # the plain part's tensors by path, shape and dtype (not their values): a plan that gained or lost a buffer
    # proves again
    plain = [[path, list(t.shape), str(t.dtype)] for path, t in plain_tensors(getattr(plan, "plain", None))]
    blob = json.dumps({"entries": plan.describe(), "plain": plain, "source": plan.source, "rank": rank,
                       "world": world_size, "torch": torch.__version__}, sort_keys=True,
                      separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def proven(run_dir: str) -> set[str]:
    """The signatures an earlier proof of this job passed (none when the record is missing, foreign or torn)."""
    doc = read_json(os.path.join(run_dir, FILE))
    if not isinstance(doc, dict):
        return set()
    try:
        key = auth.load_key(run_dir)
    except Exception as exc:  # noqa: BLE001 - no usable key: nothing is trusted, the proof runs
        log.info("capture proofs not reused: %s", exc)
        return set()
    ok, why = auth.authenticate(doc, key)
    if not ok:
        log.warning("%s ignored (%s): the capture proof runs", os.path.join(run_dir, FILE), why)
        return set()
    plans = doc.get("plans")
    return {s for s in plans if isinstance(s, str)} if isinstance(plans, dict) else set()


def record(run_dir: str, signatures: Iterable[str], step: int, restart: int) -> None:
    """Add the signatures a proof just passed (at snapshot ``step`` of start ``restart``); best effort."""
    try:
        key = auth.load_or_create_key(run_dir)
        doc = read_json(os.path.join(run_dir, FILE))
        plans: dict[str, Any] = {}
        if isinstance(doc, dict) and auth.authenticate(doc, key)[0] and isinstance(doc.get("plans"), dict):
            plans = dict(doc["plans"])
        for sig in signatures:
            plans[str(sig)] = {"step": step, "restart": restart}
        if len(plans) > KEEP:
            plans = dict(list(plans.items())[-KEEP:])
        write_json_atomic(os.path.join(run_dir, FILE), auth.sign({"version": 1, "plans": plans}, key))
    except Exception as exc:  # noqa: BLE001 - a read-only run directory: the next start proves again
        log.warning("capture proof not recorded: %s", exc)
