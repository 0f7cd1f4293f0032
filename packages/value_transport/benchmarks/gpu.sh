#!/usr/bin/env bash
# GPU checks and benchmarks of ppo-value-transport, in one go. Needs 2 GPUs, torch, ray and numpy
# (pytest optional: without it the GPU checks run as a plain script) and packages/*/src on
# PYTHONPATH. Under 4 minutes: the timeouts below add up to 235 s, and each benchmark starts no new
# cell once its budget is spent, still printing its table. Exits non-zero if any step failed.
set -uo pipefail
status=0
PY="${PYTHON:-python}"
export PYTHONUNBUFFERED=1
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PKG="$(dirname "$HERE")"
export PYTHONPATH="$PKG/src${PYTHONPATH:+:$PYTHONPATH}"
cd "$PKG"

echo "== gpu tests =="
if "$PY" -c "import pytest" 2>/dev/null; then
    # only the GPU module: the CPU suite also needs hypothesis and pytest-timeout
    timeout 50 "$PY" -m pytest tests/test_gpu.py -q -m gpu -p no:cacheprovider -o addopts="-ra" || status=1
else
    timeout 50 "$PY" tests/test_gpu.py || status=1
fi

echo "== handoff, GPU 0 (critic) -> GPU 1 (actor), values start and end on the GPU =="
timeout 110 "$PY" benchmarks/bench_handoff.py --device cuda --grid full --repeats 3 --budget-s 80 || status=1

echo "== handoff, CPU tensors, same node =="
timeout 75 "$PY" benchmarks/bench_handoff.py --device cpu --grid full --repeats 3 --budget-s 50 || status=1

echo "gpu.sh done, status $status"
exit $status
