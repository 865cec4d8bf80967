#!/usr/bin/env bash
# GPU check for a machine with one NVIDIA GPU: D2H staging bandwidth into pinned memory against a plain
# copy, and NCCL communicator create/destroy/abort/split time against one all-reduce. Never needed by
# the tests. Runs in under 5 minutes with the machine's own python3 + torch (CUDA build); writes JSON to
# $OUT/gpu-check.json when OUT is set, else benchmarks/results/gpu-check.json. Extra arguments go to
# scripts/gpu_check.py (see --help).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export PYTHONUNBUFFERED=1
exec timeout --kill-after=10 290 "$PY" "$here/gpu_check.py" "$@"
