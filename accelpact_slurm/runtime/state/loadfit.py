"""Verified means loadable: whether a snapshot can be restored into this job's model, and why not, on one line.

Who calls: :func:`accelpact_slurm.runtime.state.restore.reload` (through
:class:`~accelpact_slurm.runtime.state.restore.StateIO`), on every rank, for each candidate that passed its checksums.

Checksums prove the bytes are the ones written, not that the model can take them.  Two checks close the gap:

- :func:`model_fit` (before the load): every key of the model's state dict against the snapshot's DCP metadata.  A
  key the model asks for and the snapshot lacks, a key the snapshot holds and the model lacks (DCP would ignore it),
  a changed shape, or a dtype the copy would narrow or change the kind of (DCP would cast; an exact widening,
  :func:`widens`, is loadable) makes it unloadable.  Every rank answers the same from the same metadata and model,
  before any rank enters the load's collectives (one rank failing inside them would leave the others waiting);
- :func:`load_failure` (around the load): what the load raised, classified: ``snapshot`` (DCP's planner,
  ``load_state_dict`` or a ``Stateful`` refuses it, the extra document lacks a field) or ``environment`` (files
  changed after their re-check, a disk, a peer or the control plane failed: the start ends, nothing is rejected).

:func:`no_snapshot_line` is the one line of the stop when no candidate can be restored.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from accelpact_slurm.core.errors import AccelpactError, CheckpointError, ConfigError
from accelpact_slurm.core.torch_warnings import quiet_state_dict_calls
from ckpt_service.verified import unpickle_metadata, verified_metadata_bytes

#: The snapshot's top-level key of the model's tensors (``runtime.state.appstate.load`` loads ``{"model": ..., ...}``).
MODEL = "model"
#: At most this many keys are named per kind of difference (the count of the rest is said).
NAMED = 3
#: At most this many hosts are named per reason.
MAX_HOSTS_NAMED = 4
#: At most this many characters of one exception's message go into a reason.
MAX_MESSAGE = 300

SNAPSHOT, ENVIRONMENT = "snapshot", "environment"
#: Words of a transport's error raised as a plain ``RuntimeError`` (Gloo's "Connection closed by peer"): a link's
#: failure inside the load's collectives is the environment's, never the snapshot's.
_LINK_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket")


def expected(model: Any) -> dict[str, tuple[tuple[int, ...], str] | None]:
    """``{"model.<fqn>": (global shape, dtype name)}`` of every tensor the model's state dict asks a load for
    (``None``: an object, not a tensor).

    Collective on some wrappings (the same call the load makes); every rank calls it at the same point.  FSDP1
    (``use_orig_params=True``): read from its flat parameters (:func:`ckpt_service.capture.fsdp1_plan`, the plan the
    snapshot was written from, whose tensors a capture proof matched with the state dict's), since FSDP1's sharded
    state dict unshards and copies every parameter: at 300M parameters that was 6.7 s of a 17 s reload.
    """
    from ckpt_service.capture import fsdp1_plan

    plan = fsdp1_plan(model, None)
    if plan is not None:
        got: dict[str, tuple[tuple[int, ...], str] | None] = {}
        for e in plan.entries:
            got[f"{MODEL}.{e.key[1]}"] = (tuple(int(n) for n in e.shape), str(e.dtype).removeprefix("torch."))
        for fqn, buf in plan.plain["model"].items():
            got[f"{MODEL}.{fqn}"] = (tuple(int(n) for n in buf.shape), str(buf.dtype).removeprefix("torch."))
        return got
    return expected_from_state_dict(model)


def expected_from_state_dict(model: Any) -> dict[str, tuple[tuple[int, ...], str] | None]:
    """:func:`expected` from the model's state dict (every wrapping)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    with quiet_state_dict_calls():
        msd = get_model_state_dict(model)
        out: dict[str, tuple[tuple[int, ...], str] | None] = {}
        for fqn, value in msd.items():  # an object (a module's extra state): its presence only
            shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
            out[f"{MODEL}.{fqn}"] = None if shape is None or dtype is None else \
                (tuple(int(n) for n in shape), str(dtype).removeprefix("torch."))
    return out


def snapshot_tensors(metadata: Any) -> dict[str, tuple[tuple[int, ...], str] | None]:
    """``{"model.<fqn>": (shape, dtype name)}`` the snapshot's DCP metadata holds (``None``: not a tensor there)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out: dict[str, tuple[tuple[int, ...], str] | None] = {}
    for key, md in getattr(metadata, "state_dict_metadata", {}).items():
        if not key.startswith(MODEL + "."):
            continue
        if isinstance(md, TensorStorageMetadata):
            out[key] = (tuple(int(n) for n in md.size), str(md.properties.dtype).removeprefix("torch."))
        else:
            out[key] = None
    return out


def differences(want: Mapping[str, tuple[tuple[int, ...], str] | None],
                have: Mapping[str, tuple[tuple[int, ...], str] | None]) -> str:
    """One line naming how the snapshot's model tensors differ from the model's; empty when they agree.  Pure."""
    objects = tuple(k + "." for k in want if want[k] is None)  # DCP flattens an object that is a dict into keys

    def inside(k: str, keys: Any) -> bool:
        return k in keys or (want[k] is None and any(h.startswith(k + ".") for h in keys))

    missing = sorted(k for k in want if not inside(k, have))
    unexpected = sorted(k for k in have if k not in want and not k.startswith(objects))
    parts = []
    if missing:
        parts.append(f"missing {_some(missing)} (the model has them, the snapshot does not)")
    if unexpected:
        parts.append(f"unexpected {_some(unexpected)} (the snapshot has them, the model does not)")
    both = [k for k in sorted(want) if want[k] is not None and have.get(k) is not None]  # tensors on both sides
    shapes = [k for k in both if have[k][0] != want[k][0]]
    for k in shapes[:NAMED]:
        parts.append(f"shape of {k}: snapshot {list(have[k][0])}, model {list(want[k][0])}")
    if len(shapes) > NAMED:
        parts.append(f"{len(shapes) - NAMED} more shape(s) differ")
    dtypes = [k for k in both if k not in shapes and not widens(have[k][1], want[k][1])]
    for k in dtypes[:NAMED]:
        parts.append(f"dtype of {k}: snapshot {have[k][1]}, model {want[k][1]}")
    if len(dtypes) > NAMED:
        parts.append(f"{len(dtypes) - NAMED} more dtype(s) differ")
    nontensor = [k for k in sorted(want) if want[k] is not None and k in have and have[k] is None]
    if nontensor:
        parts.append(f"{_some(nontensor)} saved as an object, the model holds a tensor")
    return "; ".join(parts)


def widens(saved: str, model: str) -> bool:
    """Whether DCP's copy of a tensor saved as ``saved`` into one of ``model`` (dtype names) is exact: the same
    dtype, or a widening of the same kind (``bfloat16`` -> ``float32``: FSDP1 with a ``MixedPrecision``
    ``buffer_dtype`` holds buffers narrower than its state dict asks for).  A narrowing or a change of kind
    (``float32`` -> ``bfloat16``, ``int64`` -> ``float32``) would change the values silently."""
    if saved == model:
        return True
    import torch

    a, b = getattr(torch, saved, None), getattr(torch, model, None)
    if not isinstance(a, torch.dtype) or not isinstance(b, torch.dtype):
        return False
    if (a.is_floating_point, a.is_complex, a == torch.bool) != (b.is_floating_point, b.is_complex, b == torch.bool):
        return False
    return torch.promote_types(a, b) == b


def model_fit(want: Mapping[str, tuple[tuple[int, ...], str] | None], path: str, key: bytes | None) -> tuple[bool, str]:
    """``(ok, reason)``: whether the snapshot at ``path`` holds exactly the model's tensors (:func:`expected`).

    The metadata is read as the load reads it: authenticated under ``key`` (``None``: the test-only unchecked
    path, stock ``FileSystemReader``).  A metadata that cannot be read is the environment's (raised).
    """
    if key is not None:
        metadata = unpickle_metadata(verified_metadata_bytes(path, key)[1])
    else:
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(path).read_metadata()
    diff = differences(want, snapshot_tensors(metadata))
    if not diff:
        return True, "the snapshot holds every tensor of the model, same shapes and dtypes"
    return False, f"the model's state differs from the snapshot's: {diff}"


def load_failure(exc: BaseException) -> tuple[str, str]:
    """``(kind, one line)`` of what a snapshot's load raised: :data:`SNAPSHOT` or :data:`ENVIRONMENT` (module doc)."""
    inner = _inner(exc)
    env = (OSError, MemoryError, TimeoutError, CheckpointError)
    try:
        from torch.distributed import DistError
        env = (*env, DistError)
    except ImportError:  # pragma: no cover - every supported torch has it
        pass
    text = " ".join(str(inner).split()) or "(no message)"
    if isinstance(inner, env) or (isinstance(inner, AccelpactError) and not isinstance(inner, ConfigError)) \
            or any(word in text.lower() for word in _LINK_WORDS):
        kind = ENVIRONMENT
    else:
        kind = SNAPSHOT
    if len(text) > MAX_MESSAGE:
        text = text[:MAX_MESSAGE] + "..."
    return kind, f"the load raised {type(inner).__name__}: {text}"


def no_snapshot_line(unloadable: Mapping[int, str], model_change: bool) -> str:
    """The stop's line when no candidate could be restored (``unloadable``: ``{step: why}``, newest first).  Pure."""
    steps = sorted(unloadable, reverse=True)
    groups: dict[str, list[int]] = {}  # one reason once, with every step it holds for (newest first)
    for s in steps:
        groups.setdefault(unloadable[s], []).append(s)
    parts = [f"step{'s' if len(g) > 1 else ''} {', '.join(map(str, g))}: {why}" for why, g in groups.items()]
    if len(parts) > NAMED:
        parts = parts[:NAMED] + [f"{len(parts) - NAMED} more reason(s) for older steps"]
    if model_change:
        fix = ("did the model change since these snapshots were taken? run with the model they were taken with, or "
               "start the new model in a new run directory (--run-dir); if the model did not change, the snapshots "
               "lack state the model holds: start a new run directory")
    else:
        fix = ("the snapshots stay as they were (none is marked rejected): fix what refused them and start again, "
               "or start a new run directory (--run-dir)")
    return f"no snapshot can be restored: {'; '.join(parts)}; {fix}; not requeued (a restart would fail the same way)"


def load_agreed(rank: int, step: int, path: str, copy_id: str | None, io: Any, control: Any,
                hosts: Sequence[str], timeout_s: float | None,
                parts: dict[str, Any] | None = None) -> tuple[str, list[tuple[int, str, str]], bool] | None:
    """Collective: check that the snapshot fits the model, then load it; ``None`` when every rank loaded it, else
    ``(reason, [(rank, copy, why)], the model's keys differ)``.

    Two rounds, so that every rank takes the same way: the fit (:mod:`runtime.state.loadfit`: every rank answers
    from the same metadata and model, before any rank enters the load's collectives), then the load's outcome.
    A failure that is the environment's (a disk, a link, the files replaced after their re-check) ends the
    start on every rank: the rank that met it raises its exception, the others a :class:`CheckpointError`
    naming it; the snapshot is not rejected.  ``parts`` gets the seconds of this rank's fit and load (``fit_s``,
    ``restore_s``, the load's own parts under ``restore``) and of each round (``fit_round_s``, ``load_round_s``).
    """
    fits = getattr(io, "fits", None)
    parts = {} if parts is None else parts
    for name in ("reload-fit", "reload-load"):
        res: list[Any] = [True, "", copy_id, None]
        error: BaseException | None = None
        t0 = time.monotonic()
        try:
            if name == "reload-load":
                inner = io.load(path)
                parts["restore_s"] = round(time.monotonic() - t0, 4)
                if isinstance(inner, Mapping):
                    parts["restore"] = dict(inner)
            elif fits is not None:
                ok, why = fits(path)
                res = [ok, why, copy_id, None if ok else "model"]
                parts["fit_s"] = round(time.monotonic() - t0, 4)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException: a crash, not a decision
            error = exc
            kind, why = load_failure(exc)
            res = [False, why, copy_id, kind]
        got = control.all_gather(name, res, timeout_s=timeout_s)
        parts[f"{name.removeprefix('reload-')}_round_s"] = round(time.monotonic() - t0, 4)
        env = [(r, g) for r, g in enumerate(got) if isinstance(g, list) and len(g) == 4 and not g[0]
               and g[3] == ENVIRONMENT]
        if env:
            if error is not None and res[3] == ENVIRONMENT:
                raise error
            r, g = env[0]
            raise CheckpointError(f"step {step}: restoring it failed on {hosts[r]} (not the snapshot's fault, it "
                                  f"is not rejected): {g[1]}")
        bad = [(r, str(g[2]), str(g[1])) for r, g in enumerate(got) if isinstance(g, list) and len(g) == 4
               and not g[0]]
        if bad:
            whys = _distinct(why for _r, _c, why in bad)
            where = {why: _distinct(hosts[r] for r, _c, w in bad if w == why) for why in whys}
            reason = "; ".join(f"{why} (on {', '.join(where[why][:MAX_HOSTS_NAMED])})" for why in whys[:2])
            return reason, bad, any(isinstance(g, list) and len(g) == 4 and g[3] == "model" for g in got)
    return None


def _distinct(items: Any) -> list[str]:
    return list(dict.fromkeys(items))


def _some(keys: list[str]) -> str:
    return ", ".join(keys[:NAMED]) + (f" (+{len(keys) - NAMED} more)" if len(keys) > NAMED else "")


def _inner(exc: BaseException) -> BaseException:
    """The first rank's exception inside DCP's ``CheckpointException`` (``failures``: exception or (exception,
    traceback)), else ``exc`` itself."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[sorted(failures)[0]]
        inner = first[0] if isinstance(first, tuple) and first else first
        if isinstance(inner, BaseException):
            return inner
    return exc
