#!/usr/bin/env python3
"""Checkpoint-service acceptance benchmark: our snapshot path against stock DCP, side by side in one job.

Part 1 (training-step cost).  One job on the embedded default (2 emulated nodes x 2 ranks, FSDP1
HYBRID_SHARD on the 2-D device mesh over Gloo, the decoder example's ``CausalDecoder`` at >= 100M
parameters with AdamW: a copy of ``examples/decoder/job.yaml`` whose ``params`` set the size).  Its ranks
run the real ``accelpact-run`` rank path (``accelpact_slurm.cli.run.main`` -> ``job.run_rank`` -> the job
file's entry point; ``job.protect``, ``run.batches``, ``with run.update()``: guard, commit, events),
started with the per-node checkpoint daemons by the library's own launcher (``launch_local``, through
``benchmarks/harness/common.py``).  The entry point is the benchmark's own (``benchmarks/parts/ckpt_entry.py``:
the example's model, optimizer, data and update body, plus the schedule): the run's ``SnapshotClient`` is
never due by itself (``checkpoint.every_steps`` is past the last update) and the schedule calls its
``snapshot(step)`` or DCP's save after an update.  After a few warm-up updates, every round runs one
*segment* per mode (``none`` twice, half a round apart), in an order rotated from round to round:

    none           no snapshots (the baseline)
    ours           SnapshotClient.snapshot() (boxes copied into a /dev/shm slot + daemon write/verify)
    dcp_sync       dcp.save, every rank its shards, into a per-run directory
    dcp_thread     dcp.async_save, thread executor
    dcp_process    dcp.async_save, async_checkpointer_type=PROCESS
    dcp_stager     dcp.async_save + DefaultStager(StagingOptions(False, False, True, False))
    dcp_stager_shm dcp.async_save + DefaultStager(StagingOptions(False, True, True, False))

A segment is ``--windows`` windows of K updates; the first update of each window takes a snapshot
(``S x x`` for K=3: one period of "a snapshot every K updates", with the K-1 updates that run while the
snapshot is written in the background).  After its last update the segment is drained *outside* the
timed updates (async futures, our daemons' write + verification, ``malloc_trim``), so the next segment
starts clean; how long that drain took is reported as the background work left over.  DefaultStagers
are closed and DCP's checkpoint process stopped between segments too: on this 24 GiB machine 4 ranks + 2
daemons otherwise ran out of memory.  Step time = time between the ends of two consecutive updates (each
followed by its snapshot, if any) on rank 0 (the ranks are in lock step), so it includes the blocking part.
DefaultStager stages in a background thread while training goes on: for a consistent snapshot the
next ``optimizer.step`` first waits for staging to finish (counted in that step).

Part 2 (write bandwidth).  One node's snapshot (the same model + AdamW, two ranks' shards) staged as
the client stages it, then the daemon's write path (``staging.read_descriptor`` + ``map_slot`` x2 +
``dcp_write.write_snapshot``: boxes as DCP chunks in parallel files, each hashed while written and fsynced,
manifest, rename) against ``dd if=/dev/zero bs=4M conv=fsync`` of the same size on the same filesystem, paired
and interleaved; the ratio is also reported per order.  The daemon's CPU seconds per GiB (write path,
verification) come from the same writes.  After every timed ``ours`` snapshot (outside the timed update) each
rank also times a plain copy of the same tensors' bytes into preallocated memory: the memcpy floor of the
blocking time.

Every figure is a ratio against a baseline measured in the same run (paired by round), reported as the
median of the paired ratios with min-max; absolute times are printed beside them for reference only.

Output: ``runs/bench/<date>/ckpt.json`` and the block between ``<!-- ckpt-bench -->`` markers of ``--markdown``
(default ``''``: none; ``make bench`` renders the docs from the parts' summaries).

The code is in ``benchmarks/parts/``: ``ckpt_setup`` (modes, schedule, job file, launch, machine watch),
``ckpt_entry`` (the job's entry point: our snapshot path and the schedule, rank side), ``ckpt_dcp`` (the DCP baselines),
``ckpt_bandwidth`` (the dd pair), ``ckpt_analysis`` and ``ckpt_report`` (result and markdown), ``ckpt_main``.

Usage: .venv/bin/python benchmarks/parts/ckpt.py [--rounds 3] [--every 3] [--windows 1] [--bw-pairs 6]
       .venv/bin/python benchmarks/parts/ckpt.py --render runs/bench/<date>/ckpt.json   (markdown only)

About 7 minutes here (110M parameters, 3 rounds, every mode but dcp_stager_shm; longer when the machine
is busy).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import common as harness  # noqa: E402

harness.add_paths()

from benchmarks.parts.ckpt_main import main, markdown  # noqa: E402

__all__ = ["main", "markdown"]  # bench_all.py renders with markdown

if __name__ == "__main__":
    sys.exit(main())
