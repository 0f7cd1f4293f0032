#!/usr/bin/env bash
# GPU tests and the GPU benchmark of ppo-weight-sync, in one go (2 GPUs: trainer GPU 0, engine GPU 1).
# Run from the repository root or anywhere: bash packages/weight_sync/benchmarks/gpu.sh
# Bounded: tests at most 110 s (a test stuck for 60 s prints every thread's stack), benchmark at most
# 110 s (progress lines per size and mode as it goes); about 4 minutes at worst, much less when healthy.
set -euo pipefail
failed=0  # set by any failing step; the script exits non-zero after running the rest
export PYTHONUNBUFFERED=1
# NCCL's warnings (from both processes: the engine's output is forwarded with an "[engine" prefix).
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PKG="$(dirname "$HERE")"
ROOT="$(cd "$PKG/../.." && pwd)"
# Packages are not pip-installed on the GPU machine: every package's src goes on PYTHONPATH.
for src in "$ROOT"/packages/*/src; do PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"; done
export PYTHONPATH
PY="${PYTHON:-python}"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader || true

echo "== GPU tests (NCCL) =="
TIMEOUT_ARGS=()
if "$PY" -c "import pytest_timeout" 2>/dev/null; then TIMEOUT_ARGS=(--timeout=90); fi
(cd "$PKG" && timeout -k 5 110 "$PY" -m pytest tests/test_gpu.py -v -s -x -p no:cacheprovider -o addopts="" \
    -o faulthandler_timeout=60 ${TIMEOUT_ARGS[@]+"${TIMEOUT_ARGS[@]}"} -rA) || { echo "GPU TESTS FAILED (exit $?)"; failed=1; }

# Each row ends with where the update's time went (ms: scan, control before, transfer, control after,
# other; the sender's weight_sync/*_seconds), and each repetition's progress line prints the same split.
echo "== GPU benchmark: 1, 4, 16 GB bf16, 512 MiB buckets, trainer GPU 0 -> engine GPU 1 (with the split) =="
timeout -k 5 110 "$PY" "$HERE/bench_update.py" --backend nccl --sizes-gb 1 4 16 --bucket-mb 512 --reps 3 \
    --timeout-s 40 || { echo "GPU BENCHMARK FAILED (exit $?)"; failed=1; }
exit "$failed"
