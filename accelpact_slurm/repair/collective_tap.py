"""The collective tap: every collective issued through ``ProcessGroup``'s Python methods, seen by the detector.

Patches methods of torch's ``ProcessGroup`` class by name (:data:`TAPPED_METHODS`, torch 2.13's): when torch renames
one, :func:`install_collective_tap` says so (``allreduce`` missing) and ``tests/repair/test_torch_compat.py`` fails.
Re-exported by :mod:`accelpact_slurm.repair.torch_compat`, the one place of the repair's reach into torch.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

#: The ``ProcessGroup`` methods through which ``torch.distributed``'s Python collectives reach a backend, over the
#: supported releases: torch 2.13's, and ``gather_single`` / ``gather_into_tensor`` that 2.14.1 added (what
#: ``dist.gather_into_tensor`` calls); a name a release lacks is skipped.  Point-to-point calls are left out.
#: (2.14.1's ``ProcessGroup.register_pre_hook`` / ``register_post_hook`` see a call but not the wait on its work,
#: which is what the detector watches, and 2.13 has neither: the class methods stay patched on every release.)
TAPPED_METHODS = (
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "all_gather_single", "_allgather_base",
    "allgather_into_tensor_coalesced", "all_gather_single_coalesced", "reduce_scatter", "reduce_scatter_single",
    "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced", "broadcast",
    "barrier", "reduce", "gather", "gather_single", "gather_into_tensor", "scatter", "alltoall", "all_to_all_single",
    "alltoall_base",
)
_tap_lock = threading.Lock()
#: name -> the class's own attribute before the tap (its raw descriptor; None: it was inherited).
_tap_originals: dict[str, object] = {}


def install_collective_tap(on_call) -> list[str]:
    """Route every collective issued through ``ProcessGroup``'s Python methods through ``on_call``.

    ``on_call(pg, method, original, args, kwargs)`` must call ``original(pg, *args, **kwargs)`` (or stand in for it)
    and return what the caller gets (the ``Work``, or an object with its ``wait``/``is_completed``).  Every
    ``torch.distributed`` collective (``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ...)
    calls one of :data:`TAPPED_METHODS` on the group and then waits on the returned work itself (sync) or hands it to
    the caller (``async_op=True``, as FSDP2 does), so a tap sees every collective FSDP issues from Python, on any
    backend.  Collectives issued from C++ (functional collectives, DTensor redistribution) pass it by.  The methods
    are patched on the class, once per process; a second call replaces ``on_call``.  Returns the methods patched.
    """
    cls = dist.ProcessGroup
    with _tap_lock:
        remove_collective_tap()
        for name in TAPPED_METHODS:
            original = getattr(cls, name, None)  # bound on call as original(pg, ...)
            if original is None:
                continue
            _tap_originals[name] = cls.__dict__.get(name)

            def tapped(self, *args, __name=name, __original=original, **kwargs):
                return on_call(self, __name, __original, args, kwargs)

            tapped.__name__ = name
            tapped.__wrapped__ = original  # type: ignore[attr-defined]
            setattr(cls, name, tapped)
        if "allreduce" not in _tap_originals:
            raise RuntimeError("torch.distributed.ProcessGroup has no allreduce method: the collective tap needs "
                               "a new name list")
        return sorted(_tap_originals)


def remove_collective_tap() -> None:
    """Put back every method :func:`install_collective_tap` patched, as it was (idempotent)."""
    cls = dist.ProcessGroup
    for name, raw in list(_tap_originals.items()):
        if raw is None:
            delattr(cls, name)
        else:
            setattr(cls, name, raw)
    _tap_originals.clear()
