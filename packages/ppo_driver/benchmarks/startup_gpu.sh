#!/usr/bin/env bash
# One GPU call: start-up to the first step and the first step against a steady one, SmolLM2-135M PPO
# on one GPU, with startup.warm_up on and off, then with an 8,100-row chat dataset
# (startup_first_step.py). Runs from the repository root; sources .carry/setup.sh where it exists
# (Ray and the wheels the GPU machine lacks). The model: models/smollm2-135m-instruct when present,
# else random weights of SmolLM2's shape from SHAPE (default .gpuw/smollm2-shape: SmolLM2's config.json,
# generation_config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja). About 2.5 minutes
# on one H200; writes $OUT/startup.md; exits non-zero when a run fails or step 1 differs with warm-up.
set -uo pipefail
cd "$(dirname "$0")/../../.."
if [ -f .carry/setup.sh ]; then source .carry/setup.sh || exit 1; fi
export PYTHONUNBUFFERED=1
export PYTHONPATH="$(ls -d "$PWD"/packages/*/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-$(mktemp -d)}"
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
timeout 560 "$PY" packages/ppo_driver/benchmarks/startup_first_step.py \
  --model "${MODEL:-models/smollm2-135m-instruct}" --shape "${SHAPE:-.gpuw/smollm2-shape}" --out "$OUT"
