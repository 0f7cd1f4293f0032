#!/usr/bin/env bash
# GPU tests and the GPU benchmark of ppo-weight-sync, in one go (2 GPUs: trainer GPU 0, engine GPU 1).
# Run from the repository root or anywhere: bash packages/weight_sync/benchmarks/gpu.sh
set -euo pipefail
export PYTHONUNBUFFERED=1
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
if "$PY" -c "import pytest_timeout" 2>/dev/null; then TIMEOUT_ARGS=(--timeout=120); fi
(cd "$PKG" && timeout 150 "$PY" -m pytest tests/test_gpu.py -q -p no:cacheprovider -o addopts="" \
    ${TIMEOUT_ARGS[@]+"${TIMEOUT_ARGS[@]}"} -rA) || echo "GPU TESTS FAILED (exit $?)"

echo "== GPU benchmark: 1, 4, 16 GB bf16, 512 MiB buckets, trainer GPU 0 -> engine GPU 1 =="
timeout 170 "$PY" "$HERE/bench_update.py" --backend nccl --sizes-gb 1 4 16 --bucket-mb 512 --reps 3 \
    || echo "GPU BENCHMARK FAILED (exit $?)"
