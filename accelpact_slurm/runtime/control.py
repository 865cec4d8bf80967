"""The control plane: every out-of-band agreement between ranks.

Built on its own ``TCPStore`` (never the data plane's groups, never the default
process group) with a ``PrefixStore`` per generation, so that an agreement of a
retired generation can never be mistaken for one of the current generation.
All calls block with a deadline and raise
:class:`~accelpact_slurm.core.errors.ControlPlaneTimeout` naming the ranks that did
not answer.

Who calls: every rank of the world, the same calls in the same order (like a
collective).  Values are JSON.
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from typing import Any, Sequence

import torch.distributed as dist

from accelpact_slurm.core.errors import ControlPlaneError, ControlPlaneTimeout

log = logging.getLogger(__name__)


class ControlPlane:
    """Key/value agreements over a dedicated store.

    Args:
        store: the control plane's own store (a ``TCPStore``).
        rank: this rank in the world.
        world_size: number of ranks.
        timeout_s: default deadline of every call.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float, generation: int = 0) -> None:
        self._base = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._seq: dict[str, int] = {}
        self.set_generation(generation)

    @property
    def generation(self) -> int:
        return self._generation

    def set_generation(self, generation: int) -> None:
        """Move to a fresh key space; every rank must do this at the same agreed point."""
        self._generation = generation
        self._store = dist.PrefixStore(f"cp/g{generation}", self._base)
        self._seq.clear()

    @property
    def base_store(self) -> dist.Store:
        """The control plane's own store, unprefixed (replacement groups take a fresh prefix of it)."""
        return self._base

    @property
    def store(self) -> dist.Store:
        """The current generation's prefixed store (for building replacement groups)."""
        return self._store

    # ------------------------------------------------------------------ primitives

    def all_gather(self, name: str, value: Any, ranks: Sequence[int] | None = None,
                   timeout_s: float | None = None) -> list[Any]:
        """Every rank in ``ranks`` (default: the world) contributes ``value``; all get the list in rank order.

        ``name`` must be used once per round; a sequence number is appended so a
        name may be reused (the n-th call with a name on every rank matches).
        Two round trips to the store: this rank's value (no answer awaited), then one
        blocking read of every member's value, bounded by the deadline.
        """
        ranks, key = self._enter(name, ranks)
        self._store.set(f"{key}/{self.rank}", json.dumps(value))
        keys = [f"{key}/{r}" for r in ranks]
        values = [json.loads(v) for v in self._read(keys, name, ranks, timeout_s)]
        n = self._seq[name] - 1
        if n >= 2:  # every member has finished round n-2 once round n-1 is complete
            try:
                self._store.delete_key(f"{name}#{n - 2}/{self.rank}")
            except Exception:  # pragma: no cover - cleanup is best effort
                log.debug("could not delete control key %s#%d/%d", name, n - 2, self.rank)
        return values

    def contribute(self, name: str, value: Any, ranks: Sequence[int] | None = None) -> None:
        """Take part in this round of the agreement ``name`` without waiting for the others.

        For a rank that is about to fail stop: the members' :meth:`all_gather` of the same round
        returns at once with ``value`` in this rank's place (e.g. why it failed), instead of waiting
        for the deadline.  The round counts as this rank's call of ``name``.
        """
        _, key = self._enter(name, ranks)
        self._store.set(f"{key}/{self.rank}", json.dumps(value))

    def _enter(self, name: str, ranks: Sequence[int] | None) -> tuple[list[int], str]:
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        if self.rank not in ranks:
            raise ControlPlaneError(f"rank {self.rank} is not a member of the agreement {name!r} over {ranks}")
        n = self._seq.get(name, 0)
        self._seq[name] = n + 1
        return ranks, f"{name}#{n}"

    def broadcast(self, name: str, value: Any = None, src: int = 0, timeout_s: float | None = None) -> Any:
        """Return ``src``'s value on every rank."""
        return self.all_gather(name, value if self.rank == src else None, timeout_s=timeout_s)[src]

    def barrier(self, name: str, ranks: Sequence[int] | None = None, timeout_s: float | None = None) -> None:
        self.all_gather(name, 1, ranks=ranks, timeout_s=timeout_s)

    def leave(self, name: str, timeout_s: float) -> list[int]:
        """Announce that this rank is leaving; the store's host (rank 0) waits, up to ``timeout_s``, for the others.

        Rank 0's process hosts the store: if it exited first, a peer still reading
        the last agreement would fail.  Returns the ranks that did not announce
        themselves in time (rank 0 only; they are probably dead).
        """
        self._store.set(f"leave/{name}/{self.rank}", "1")
        if self.rank != 0:
            return []
        keys = [f"leave/{name}/{r}" for r in range(self.world_size)]
        try:
            self._store.wait(keys, timedelta(seconds=timeout_s))
            return []
        except Exception:
            return [r for r, k in enumerate(keys) if not self._has(k)]

    def post(self, name: str) -> None:
        """Raise the flag ``name`` in this generation's store, once, for any rank to see (:meth:`wait_posted`)."""
        self._store.set(f"post/{name}", "1")

    def wait_posted(self, name: str, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the flag ``name``; False on the deadline or when the store is gone."""
        try:
            self._store.wait([f"post/{name}"], timedelta(seconds=timeout_s))
            return True
        except Exception:  # DistStoreError on the deadline, or the host (rank 0) has exited
            return self._has(f"post/{name}")

    def _read(self, keys: list[str], name: str, ranks: list[int], timeout_s: float | None) -> list[bytes]:
        """The values of ``keys``, once all are set: one blocking read (the store waits for missing keys up
        to its timeout, set here to this call's deadline for the read and put back after)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        before = self._base.timeout
        self._base.set_timeout(timedelta(seconds=timeout))  # local: no round trip
        try:
            return self._store.multi_get(keys)
        except Exception as exc:  # DistStoreError / RuntimeError on timeout or a lost store
            raise self._timeout(keys, name, ranks, timeout) from exc
        finally:
            self._base.set_timeout(before)

    def _timeout(self, keys: list[str], name: str, ranks: list[int], timeout: float) -> ControlPlaneTimeout:
        missing = [r for r, k in zip(ranks, keys) if not self._has(k)]
        return ControlPlaneTimeout(
            f"control-plane agreement {name!r} (generation {self._generation}) incomplete after "
            f"{timeout:g} s: no answer from rank(s) {missing}"
        )

    def _has(self, key: str) -> bool:
        try:
            return bool(self._store.check([key]))
        except Exception:
            return False
