#!/usr/bin/env bash
# Colocated (CUDA IPC) benchmark and the one-GPU tests of ppo-weight-sync (IPC, the finite scan): the benchmark first, then
# the tests (each bounded); exits non-zero when either fails, after running both.
# Run from anywhere: bash packages/weight_sync/benchmarks/gpu_ipc.sh [bench args]
# BENCH_TIMEOUT_S / TEST_TIMEOUT_S bound the two steps; OUT (optional) receives bench_ipc.json.
set -uo pipefail
export PYTHONUNBUFFERED=1
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PKG="$(dirname "$HERE")"
ROOT="$(cd "$PKG/../.." && pwd)"
for src in "$ROOT"/packages/*/src; do PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"; done
export PYTHONPATH
PY="${PYTHON:-python3}"
failed=0
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
echo "== GPU benchmark: colocated IPC vs raw IPC pipeline =="
timeout -k 5 "${BENCH_TIMEOUT_S:-400}" "$PY" "$HERE/bench_ipc.py" --json "${OUT:-/tmp}/bench_ipc.json" "$@" \
    || { echo "GPU BENCHMARK FAILED (exit $?)"; failed=1; }
echo "== GPU tests: colocated IPC =="
if "$PY" -m pytest --version >/dev/null 2>&1; then
    (cd "$PKG" && timeout -k 5 "${TEST_TIMEOUT_S:-300}" "$PY" -m pytest tests/test_ipc_update_gpu.py \
        tests/test_ipc_gpu.py tests/test_ipc_tp_gpu.py tests/test_finite_gpu.py -v -s -x -p no:cacheprovider -o addopts="" -o faulthandler_timeout=100 -rA) \
        || { echo "GPU TESTS FAILED (exit $?)"; failed=1; }
else
    echo "GPU TESTS NOT RUN: pytest is not installed here"; failed=1
fi
exit "$failed"
