"""The replay check of a resumed snapshot, on the user's own training path.

When a run takes snapshot S, the update that follows it (S + 1) is recorded: rank 0 writes a ``replay_ref`` event with
the job's mean loss of that update and every rank's fingerprint of its parameter, reduced-gradient and optimizer-state
shards at the update's vote, right before ``optimizer.step`` (:func:`fingerprint`; they determine the step).  A later
start that loads S runs the same update S + 1 from the same state: it must reproduce both bitwise, else the snapshot
(or its extra state) does not hold the state it claims: it is rejected (:func:`reject_loaded`) and the start fails
stop; the next start falls back to the next older snapshot.

The fingerprints are compared only under the layout (nodes x ranks per node) that recorded them, the loss whenever
both runs reported one at the same world size (with another number of ranks the update is another computation: the
check is ``unconfirmed``, and the resume's equality is the loaded state's, see docs/checkpoints.md).  No reference
recorded (S was the run's last act): ``unconfirmed``, said in the event log.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from typing import Any, Iterable, Mapping, Sequence

import torch

from accelpact_slurm.core.config import JobConfig
from accelpact_slurm.core.events import EventLog
from accelpact_slurm.core.rank import RankContext
from accelpact_slurm.runtime.state.buffers import buffer_items
from accelpact_slurm.runtime.state.restore import reject_copy, same_bits
from ckpt_service.index import read_record
from ckpt_service.layout import node_dir, shared_dir, step_dirname

log = logging.getLogger(__name__)


def fingerprint(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """SHA-256 over this rank's local shards of the parameters, their reduced gradients, the optimizer
    state and the rank's persistent buffers (batch-norm statistics, after the update's forward): per tensor, the float64 sum and a position-weighted sum (a permutation or cancelling changes inside a
    shard move the second).  Taken at the update's vote, before its step: these determine the step exactly.
    Cheap, and exact for the same bits."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            _hash_local(h, name, p)
            if p.grad is not None:
                _hash_local(h, f"{name}.grad", p.grad)
        if optimizer is not None:
            names = {id(p): n for n, p in model.named_parameters()}
            for p, state in optimizer.state.items():
                for k in sorted(state, key=str):
                    v = state[k]
                    if isinstance(v, torch.Tensor):
                        _hash_local(h, f"{names.get(id(p), '?')}.{k}", v)
        for name, buf in buffer_items(model):
            _hash_local(h, f"buffer:{name}", buf)
    return FP_VERSION + h.hexdigest()


#: Written before every fingerprint: one recorded by another way of computing it is not compared.
FP_VERSION = "fp3:"
#: Elements per chunk: the weighted sum runs over one cached weight vector of this length, in cache.
_CHUNK = 1 << 20
_weights: dict[Any, torch.Tensor] = {}


def _chunk_weights(device: torch.device) -> torch.Tensor:
    """Position weights in [1, 2) for one chunk (made once per device)."""
    if device not in _weights:
        idx = torch.arange(_CHUNK, dtype=torch.int64, device=device)
        _weights[device] = 1.0 + ((idx * 2654435761) % 65536).double() / 65536.0
    return _weights[device]


def _hash_local(h: "hashlib._Hash", name: str, t: torch.Tensor) -> None:
    """Per chunk of 2**20 elements: the float64 sum and the position-weighted sum (a permutation or cancelling
    changes inside the chunk move the second), hashed with the chunk's place.  Chunked so that the casts and
    the weights stay in cache: a pass over the state at memory speed."""
    local = (t.to_local() if hasattr(t, "to_local") else t).detach().reshape(-1)
    h.update(name.encode())
    if not local.numel():
        h.update(b"-")
        return
    w = _chunk_weights(local.device)
    for start in range(0, local.numel(), _CHUNK):
        v = local[start:start + _CHUNK].double()
        h.update(f"{start}:{float(v.sum()).hex()}:{float(torch.dot(v, w[:v.numel()])).hex()};".encode())


#: The fields of a ``replay_ref`` event its MAC covers.
REF_FIELDS = ("snapshot", "step", "loss", "fingerprints", "layout")


def ref_mac(key: bytes, record: Mapping[str, Any]) -> str:
    """HMAC-SHA256 under the run's key of a ``replay_ref`` record's :data:`REF_FIELDS` (canonical JSON)."""
    body = {k: record.get(k) for k in REF_FIELDS}
    blob = json.dumps(body, sort_keys=True, separators=(",", ":"),
                      default=lambda o: o.item() if hasattr(o, "item") else str(o)).encode()
    return hmac.new(key, blob, hashlib.sha256).hexdigest()


def find_reference(events: Iterable[Mapping[str, Any]], snapshot: int,
                   key: bytes | None = None) -> dict[str, Any] | None:
    """The newest ``replay_ref`` event recorded for ``snapshot`` whose MAC verifies under ``key`` (pure).

    The event log lies in the run directory: a line anyone appended there must not reject a good snapshot,
    so a ``replay_ref`` without a valid ``mac`` is ignored, with its reason logged.  ``key=None`` (tests of
    the selection only) takes every line.
    """
    found = None
    for e in events:
        if e.get("event") == "replay_ref" and e.get("snapshot") == snapshot:
            if key is not None:
                got = e.get("mac")
                if not isinstance(got, str) or not hmac.compare_digest(got, ref_mac(key, e)):
                    log.warning("ignoring a replay_ref line for snapshot %s: %s", snapshot,
                                "it carries no MAC" if not isinstance(got, str) else
                                "its MAC does not verify under this run's key (not written by this run)")
                    continue
            found = dict(e)
    return found


def judge(reference: Mapping[str, Any] | None, loss: float | None, fingerprints: Sequence[str | None],
          layout: Sequence[int]) -> tuple[str, str]:
    """``(match | mismatch | unconfirmed, reason)`` for the first update after a load (pure)."""
    if reference is None:
        return "unconfirmed", "no update after this snapshot was ever recorded (it was the last thing the run did)"
    checked = []
    want = reference.get("loss")
    recorded_world = len(reference.get("fingerprints") or [])
    if recorded_world and recorded_world != len(fingerprints):
        return "unconfirmed", (f"the update was recorded with {recorded_world} ranks and ran again with "
                               f"{len(fingerprints)}: another allocation computes another update (the data-parallel "
                               f"width changed), so there is nothing to compare bitwise")
    if want is not None and loss is not None:
        if not same_bits(loss, want):
            return "mismatch", f"replay mismatch at update {reference.get('step')}: loss {loss!r}, recorded {want!r}"
        checked.append(f"loss {loss!r}")
    recorded = reference.get("fingerprints") or []
    same_kind = all(str(f).startswith(FP_VERSION) for f in recorded if f is not None) and \
        all(str(f).startswith(FP_VERSION) for f in fingerprints if f is not None)
    if list(reference.get("layout") or []) == list(layout) and recorded and same_kind:
        bad = [r for r, (a, b) in enumerate(zip(fingerprints, reference["fingerprints"])) if a != b]
        if bad:
            return "mismatch", (f"replay mismatch at update {reference.get('step')}: the parameters of rank(s) "
                                f"{bad} differ from the recorded ones (weights, reduced gradients, optimizer "
                                f"state or buffers)")
        checked.append(f"parameters of all {len(fingerprints)} ranks")
    if not checked:
        return "unconfirmed", "the recorded update reported no loss and ran on another layout"
    return "match", f"update {reference.get('step')} reproduced bitwise: " + ", ".join(checked)


def reject_loaded(rt: RankContext, cfg: JobConfig, run_dir: str, snap: int, why: str, events: EventLog) -> None:
    """Reject every copy of ``snap`` this start could load: a replay mismatch cannot tell which copy held the wrong
    state, so none of them may be loaded again (a later start would otherwise take the shared tier's copy of the same
    step).  One writer per copy: a node's first rank for the node's own copy, rank 0 for the shared tier's."""
    ndir = node_dir(run_dir, rt.ctx.hostname, cfg.checkpoint.local_dir)
    shared = os.path.join(shared_dir(run_dir, cfg.checkpoint.shared_dir), step_dirname(snap))
    mine = [os.path.join(ndir, step_dirname(snap))] if rt.local_rank == 0 else []
    if rt.rank == 0:
        mine.append(shared)
    for path in mine:
        rec = read_record(path) if os.path.isdir(path) else None
        if rec is None or rec.state == "rejected":
            continue
        try:
            reject_copy(snap, path, f"replay check failed: {why}", run_dir, ndir, rt.ctx.hostname,
                        cfg.checkpoint.milestone_every, events, source="replay")
        except OSError as exc:  # a read-only shared tier: the rejection still holds for this start
            log.warning("could not record the rejection of %s: %s", path, exc)
