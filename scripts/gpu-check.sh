#!/usr/bin/env bash
# GPU check for a machine with NVIDIA GPUs, never needed by the tests (scripts/gpu_check.py --help):
#   examples  both examples on one GPU: snapshots from GPU memory, an L2 restart, the replay check, digest equality
#   qualify   accelpact-qualify --phase backward on one GPU: L1 repairs on NCCL (replace, rebind, validate,
#             background abort of the retired communicators), per-phase timings
#   floor     one NCCL communicator built + first all-reduce (what a repair is compared with), its abort
#   multigpu  pytest -m multigpu: L1 on NCCL with a real fault between two GPUs (skipped on one GPU)
#   staging, slot, comm   D2H staging bandwidth, the client's pinned slot, NCCL create/destroy/abort/split
# Runs in under 8 minutes with the machine's own python3 + torch (CUDA build) and the project's dependencies
# importable (PYTHONPATH); writes JSON to $OUT/gpu-check.json when OUT is set, else runs/gpu-check.json
# (summarized into benchmarks/summaries/ by python -m benchmarks.harness.run --gpu-check FILE). Extra arguments go to scripts/gpu_check.py. GPU_CHECK_TIMEOUT_S: the
# wall-clock limit (default 540).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export PYTHONUNBUFFERED=1
export PYTHONPATH="$(dirname "$here")${PYTHONPATH:+:$PYTHONPATH}"
exec timeout --kill-after=10 "${GPU_CHECK_TIMEOUT_S:-540}" "$PY" "$here/gpu_check.py" "$@"
