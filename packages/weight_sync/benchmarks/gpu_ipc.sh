#!/usr/bin/env bash
# Colocated (CUDA IPC) GPU tests and benchmark of ppo-weight-sync, on one GPU. Exits non-zero when a
# test or the benchmark fails. Run from anywhere: bash packages/weight_sync/benchmarks/gpu_ipc.sh [bench args]
set -euo pipefail
export PYTHONUNBUFFERED=1
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PKG="$(dirname "$HERE")"
ROOT="$(cd "$PKG/../.." && pwd)"
for src in "$ROOT"/packages/*/src; do PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"; done
export PYTHONPATH
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
echo "== GPU tests: colocated IPC =="
(cd "$PKG" && timeout -k 5 300 "$PY" -m pytest tests/test_ipc_gpu.py tests/test_ipc_update_gpu.py -v -s -x -p no:cacheprovider \
    -o faulthandler_timeout=100 -rA)
echo "== GPU benchmark: colocated IPC vs raw IPC pipeline vs gloo =="
timeout -k 5 400 "$PY" "$HERE/bench_ipc.py" "$@"
