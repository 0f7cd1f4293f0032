#!/usr/bin/env bash
# The megatron backend through the driver on 2 GPUs (nvidia-h200-x2): a few steps of each 2-GPU config,
# then the driver's own check that the engines hold the actor's final weights ("match").
#   - 2gpu-colocate, tensor_parallel=2 (one model split over both GPUs, data parallel 1)
#   - 2gpu-colocate, tensor_parallel=1 (data parallel 2, megatron's distributed optimizer over 2 ranks)
#   - 2gpu-disaggregate, tensor_parallel=1 (one training GPU: TP=2 cannot divide it)
# Expects every packages/*/src on PYTHONPATH (or the workspace installed), megatron-core and 2 GPUs.
# Exits non-zero on the first run that fails or does not end with "match".
set -euo pipefail
export PYTHONUNBUFFERED=1
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0
PY="${PYTHON:-python3}"
ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
STEPS="${STEPS:-3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

run() {  # config tensor_parallel
    local name
    name="$(basename "$1" .yaml)-tp$2"
    echo "== $name: $STEPS steps, train.backend=megatron, train.tensor_parallel=$2 =="
    timeout -k 5 420 "$PY" -m ppo_driver train --config "$ROOT/$1" --run-dir "$work/$name" \
        --set train.steps="$STEPS" --set checkpoint.interval="$STEPS" \
        --set train.backend=megatron --set train.tensor_parallel="$2" | tee "$work/$name.log"
    grep -q "engines hold the actor's final weights: match" "$work/$name.log" \
        || { echo "FAIL: $name: the engines' weights differ from the actor's"; exit 1; }
}

run configs/2gpu-colocate.yaml 2
run configs/2gpu-colocate.yaml 1
run configs/2gpu-disaggregate.yaml 1
echo "all megatron 2-GPU runs match"
