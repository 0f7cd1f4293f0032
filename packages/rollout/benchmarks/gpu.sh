#!/usr/bin/env bash
# GPU tests and benchmarks of ppo-rollout, in one go (under 8 minutes on an H200: the four
# timeouts below add up to 440 s).
# Run from the repository root: bash packages/rollout/benchmarks/gpu.sh
set -uo pipefail
status=0
export PYTHONUNBUFFERED=1
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
for src in "$ROOT"/packages/*/src; do PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"; done
export PYTHONPATH
PY="${PYTHON:-python3}"
cd "$ROOT/packages/rollout"
echo "== GPU tests"
# faulthandler_timeout: a test still running after 60 s dumps every thread's stack (it is not stopped).
timeout 140 "$PY" -m pytest tests/test_gpu.py -v -s -m gpu -p no:cacheprovider \
    -o faulthandler_timeout=60 || status=1
echo "== bench_generate: tiny model on GPU (float32)"
timeout 30 "$PY" benchmarks/bench_generate.py --device cuda --preset tiny --repeats 3 || status=1
echo "== bench_generate: small model on GPU (bfloat16)"
timeout 70 "$PY" benchmarks/bench_generate.py --device cuda --preset small --dtype bfloat16 --repeats 3 || status=1
echo "== gpu_generate: the engine against generate at 0.22B and 0.82B (bfloat16), with exactness checks"
timeout 200 "$PY" benchmarks/gpu_generate.py || status=1
exit $status
