#!/usr/bin/env bash
# train.lora.share_base on one GPU in one go (SmolLM2-135M's shape, random weights): the GPU test (the
# critic maps the actor's bfloat16 base over CUDA IPC; bit-identical after a step of each; the same
# scores as unshared; about one base less device memory; prints the figures), then the figures with
# the critic holding the reference (algorithm.kl_coef > 0). No Ray; every packages/*/src on PYTHONPATH.
# Bounded: each step under a timeout (4.5 minutes at worst, about 2 when healthy). Writes
# $OUT/shared_base_135m_kl.json when OUT is set. Run from the repository root:
#   bash packages/trainer/benchmarks/shared_base_gpu.sh
set -euo pipefail
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python}"
OUT="${OUT:-$(mktemp -d)}"
cd "$(dirname "$0")/.."

echo "== the GPU test: actor and critic sharing one base over CUDA IPC =="
timeout -k 5 180 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_shared_base.py -s

echo "== the same model, the critic holding the reference (algorithm.kl_coef > 0) =="
timeout -k 5 90 "$PY" benchmarks/shared_base_memory.py --preset 135m --device cuda --tokens 1024 \
    --kl-coef 0.05 --json "$OUT/shared_base_135m_kl.json"
