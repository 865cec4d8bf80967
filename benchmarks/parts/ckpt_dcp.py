"""Checkpoint benchmark, the baselines: stock DCP's save modes on the rank side (``benchmarks/parts/ckpt.py``).

``DcpModes`` is the base of the entry point's schedule (``ckpt_entry.CkptBench``); it uses its ``plan``,
``sched``, ``parts``, ``extra``, ``model`` and ``optimizer`` (the ones given to ``job.protect``):

    dcp_sync       dcp.save, every rank its shards, into a per-run directory
    dcp_thread     dcp.async_save, thread executor
    dcp_process    dcp.async_save, async_checkpointer_type=PROCESS
    dcp_stager     dcp.async_save + DefaultStager(StagingOptions(False, False, True, False))
    dcp_stager_shm dcp.async_save + DefaultStager(StagingOptions(False, True, True, False))

DefaultStager stages in a background thread while training goes on: for a consistent snapshot the next
``optimizer.step`` first waits for staging to finish (``wait_staging``, called by the entry point's update
right before ``optimizer.step``; counted in that step, ``staging_wait``).
"""

from __future__ import annotations

import os
import time
from typing import Any


class DcpModes:
    """The DCP side of the benchmark client: state dict, saves, futures, stagers, DCP's checkpoint process."""

    plan: dict[str, Any]
    sched: dict[int, tuple[int, str, int]]
    parts: dict[str, float]
    extra: dict[str, Any]
    model: Any
    optimizer: Any

    def _init_dcp(self) -> None:
        self.futures: list[tuple[int, Any, dict[str, Any]]] = []
        self.stagers: dict[str, Any] = {}
        self.staging_future = None
        self.staging_wait = 0.0

    def wait_staging(self) -> None:
        """Right before ``optimizer.step``: DefaultStager must never see a mutation of what it still copies."""
        if self.staging_future is not None:
            t = time.monotonic()
            self.staging_future.result()
            self.staging_wait += time.monotonic() - t
            self.staging_future = None

    def _path(self, mode: str, step: int) -> str:
        return os.path.join(self.plan["dcp_dir"], mode, f"step-{step:06d}")

    def _state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        t = time.monotonic()
        msd, osd = get_state_dict(self.model, self.optimizer)
        self.parts["state_dict"] = time.monotonic() - t
        return {"model": msd, "optim": osd}

    def _wait_prev(self) -> None:
        t = time.monotonic()
        for _step, fut, _rec in self.futures:
            fut.result()
        self.parts["wait_prev"] = time.monotonic() - t

    def _snap_dcp(self, mode: str, step: int) -> None:
        """One DCP snapshot in ``mode``: the blocking part here, the rest on its future (``futures``)."""
        import torch.distributed.checkpoint as dcp

        if mode == "dcp_sync":
            dcp.save(self._state_dict(), checkpoint_id=self._path(mode, step))
            return
        self._wait_prev()
        sd = self._state_dict()
        t0 = time.monotonic()
        rec: dict[str, Any] = {}
        if mode == "dcp_thread":
            fut = dcp.async_save(sd, checkpoint_id=self._path(mode, step))
        elif mode == "dcp_process":
            from torch.distributed.checkpoint.state_dict_saver import (
                AsyncCheckpointerType,
            )

            fut = dcp.async_save(sd, checkpoint_id=self._path(mode, step),
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        else:
            resp = dcp.async_save(sd, checkpoint_id=self._path(mode, step), async_stager=self._stager(mode))
            self.staging_future = resp.staging_completion
            resp.staging_completion.add_done_callback(
                lambda _f, rec=rec, t0=t0: rec.__setitem__("staged_after_s", time.monotonic() - t0))
            fut = resp.upload_completion
        fut.add_done_callback(lambda _f, rec=rec, t0=t0: rec.__setitem__("written_after_s", time.monotonic() - t0))
        self.futures.append((step, fut, rec))

    def _stager(self, mode: str):
        from torch.distributed.checkpoint.staging import (
            DefaultStager,
            StagingOptions,
        )

        if mode not in self.stagers:
            self.stagers[mode] = DefaultStager(StagingOptions(
                use_pinned_memory=False, use_shared_memory=(mode == "dcp_stager_shm"),
                use_async_staging=True, use_non_blocking_copy=False))
        return self.stagers[mode]

    def _drain_dcp(self) -> dict[str, Any]:
        """Wait for every async save and staging of the segment; its records by step."""
        for _s, fut, _rec in self.futures:
            fut.result()
        if self.staging_future is not None:
            self.staging_future.result()
            self.staging_future = None
        return {str(s): rec for s, _f, rec in self.futures}

    def _reset_dcp(self) -> None:
        """Between segments: forget the futures, close the stagers (a live stager keeps its last staged
        copy and caches resident)."""
        self.futures = []
        self.close_stagers()

    def close_stagers(self) -> None:
        for stager in self.stagers.values():
            stager.close()
        self.stagers.clear()

    def _prepare_next(self, step: int) -> None:
        """Untimed: start DCP's checkpoint process before a ``dcp_process`` segment, stop it after one.

        The process keeps the last staged copy resident (2.3 GiB over 4 ranks here) and this machine has
        no room for it next to our daemons, so it lives only for its own segments; its start-up is
        measured here and reported apart (a long job pays it once).
        """
        cur, nxt = self.sched.get(step), self.sched.get(step + 1)
        if cur is not None and cur[1] == "dcp_process" and (nxt is None or nxt[1] != "dcp_process"):
            from torch.distributed.checkpoint import _async_process_executor as ape

            proc, ape._CHECKPOINT_PROCESS = ape._CHECKPOINT_PROCESS, None
            if proc is not None:
                proc.__del__()  # sends TERMINATE and joins (what interpreter exit would do)
                del proc
        if nxt is not None and nxt[1] == "dcp_process" and (cur is None or cur[1] != "dcp_process"):
            self._warm_up_dcp()

    def _warm_up_dcp(self) -> None:
        """Start DCP's checkpoint process (a tiny state dict); the first-call cost is reported apart."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import (
            AsyncCheckpointerType,
        )

        t = time.monotonic()
        fut = dcp.async_save({"x": torch.zeros(4)}, checkpoint_id=os.path.join(self.plan["dcp_dir"], "warm-up"),
                             async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        call = time.monotonic() - t
        fut.result()
        self.extra.setdefault("dcp_process_start", []).append({"call_s": call, "done_s": time.monotonic() - t})
