"""Module state a forward changes outside autograd: buffers (batch-norm running statistics and counters).

Two guarantees rest on it:

- **A redo starts where the discarded attempt started.**  :meth:`ForwardState.keep` copies every buffer as an update
  begins (into copies made once and reused); :meth:`ForwardState.restore` puts them back when an L1 repair discards
  the update, whose forward already moved them, a buffer the forward replaced (``self.buf = new``) included.
- **Per-rank buffers survive a restart.**  Each rank's batch-norm statistics differ, while the sharded state dict
  holds one copy of a buffer.  :meth:`ForwardState.per_rank` returns this rank's persistent buffers that training
  changed, saved in the rank's part of the snapshot and put back by :meth:`ForwardState.load` after the shared copy
  (a buffer that never changes, a rotary table, is not saved per rank).

Not covered (a script must not do it): other state changed inside an update outside ``state=`` (a module's Python
attribute, a global counter, a cache on disk); ``docs/api.md`` (What "exact" covers).  Names are the model's own
(wrapper prefixes removed), so the buffers load into the same model however it is wrapped.

Who calls: :class:`~accelpact_slurm.runtime.job.api.Run` on its own rank (nothing here is collective).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

#: Wrapper prefixes that are not part of the user's names (FSDP1's flat-parameter wrapper, activation
#: checkpointing's and ``torch.compile``'s).
_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """The model's own name of a buffer (wrapper prefixes removed; pure)."""
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def _buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str, torch.Tensor]]:
    """``(clean name, owning module, attribute name, tensor)`` of every buffer, persistent or not."""
    for mod_name, mod in model.named_modules(remove_duplicate=True):
        for name, buf in mod._buffers.items():
            if buf is not None:
                full = f"{mod_name}.{name}" if mod_name else name
                yield clean_name(full), mod, name, buf


def _persistent(mod: torch.nn.Module, name: str) -> bool:
    return name not in getattr(mod, "_non_persistent_buffers_set", ())


def buffer_items(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``model``'s persistent buffers by clean name, sorted (the state digest and the replay fingerprint)."""
    return sorted(((name, buf) for name, mod, attr, buf in _buffers(model) if _persistent(mod, attr)),
                  key=lambda item: item[0])


class ForwardState:
    """The buffers of one rank's model, kept as each update begins (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._kept: list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]] = []
        self._copies: dict[str, torch.Tensor] = {}
        #: Every persistent buffer as it was at the first update (after a restore): what differs from it since is
        #: this rank's own state.  Values, not version counters: batch-norm's kernel updates its running
        #: statistics in place without moving their version counter.
        self._base: dict[str, torch.Tensor] | None = None
        #: Buffers loaded from this rank's own saved copy: saved per rank from then on, changed or not.
        self._own: set[str] = set()

    def keep(self) -> None:
        """Copy every buffer (as the update begins); reuses the copies of the previous update."""
        kept = []
        with torch.no_grad():
            for name, mod, attr, buf in _buffers(self._model):
                copy = self._copies.get(name)
                if copy is None or copy.shape != buf.shape or copy.dtype != buf.dtype or copy.device != buf.device:
                    copy = self._copies[name] = torch.empty_like(buf, memory_format=torch.preserve_format)
                copy.copy_(buf)
                kept.append((mod, attr, buf, copy))
        self._kept = kept
        if self._base is None:
            self._base = {name: buf.detach().clone() for name, buf in buffer_items(self._model)}

    def restore(self) -> None:
        """Put back every buffer kept by :meth:`keep` (the update is discarded and runs again)."""
        with torch.no_grad():
            for mod, attr, buf, copy in self._kept:
                if mod._buffers.get(attr) is buf:
                    buf.copy_(copy)
                else:  # the forward replaced it: the module gets a tensor of the kept value back
                    mod._buffers[attr] = copy.clone()

    def per_rank(self) -> dict[str, torch.Tensor]:
        """This rank's persistent buffers that changed since the first update (copies), by clean name."""
        if self._base is None:
            return {}
        out = {}
        for name, buf in buffer_items(self._model):
            base = self._base.get(name)
            if name in self._own or base is None or not _same(base, buf):
                self._own.add(name)  # once this rank's own, always saved per rank
                out[name] = buf.detach().to("cpu", copy=True)
        return out

    def load(self, saved: dict[str, Any]) -> list[str]:
        """Put this rank's saved buffers in place (after the snapshot's shared copy); returns the names not found."""
        missing = []
        live = {name: (mod, attr, buf) for name, mod, attr, buf in _buffers(self._model)}
        with torch.no_grad():
            for name, value in saved.items():
                if name not in live:
                    missing.append(name)
                    continue
                mod, attr, buf = live[name]
                self._own.add(name)
                if buf.shape == value.shape and buf.dtype == value.dtype:
                    buf.copy_(value)
                else:
                    mod._buffers[attr] = value.to(buf.device)
        self._base = None  # measured again at the next update's start
        return missing

    def digest_items(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's persistent buffers by clean name, sorted (for the state digest)."""
        return buffer_items(self._model)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (the bytes, so that NaNs in the same places count as equal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8),
                            b.detach().to(a.device).contiguous().reshape(-1).view(torch.uint8)))


class _SkipRestore(ForwardState):
    """Test-only (``ACCELPACT_TEST_SKIP_BUFFER_RESTORE``): a redo runs over the buffers its discarded forward changed."""

    def restore(self) -> None:
        pass


class _NoRankBuffers(ForwardState):
    """Test-only (``ACCELPACT_TEST_SKIP_RANK_BUFFERS``): snapshots hold no per-rank buffers."""

    def per_rank(self) -> dict[str, torch.Tensor]:
        return {}


def forward_state(model: torch.nn.Module, faults: Any = None) -> ForwardState:
    """The :class:`ForwardState` of ``model``; a test's :class:`~accelpact_slurm.core.faults.TestFaults` picks a
    broken one (the negative controls), here and nowhere in the methods themselves."""
    if getattr(faults, "skip_buffer_restore", False):
        return _SkipRestore(model)
    if getattr(faults, "skip_rank_buffers", False):
        return _NoRankBuffers(model)
    return ForwardState(model)
