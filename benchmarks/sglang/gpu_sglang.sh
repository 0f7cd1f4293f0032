#!/usr/bin/env bash
# The real SGLang on one GPU: the seeds' colocated scenario, learning through it, LoRA adapter-only
# updates, the recorded HTTP exchanges, and the built-in engine beside it. From the repository root on
# the GPU machine, once the parts arrived (benchmarks/sglang/README.md says how):
#   source benchmarks/device_env.sh && bash benchmarks/sglang/gpu_sglang.sh
# STEPS="record colocated" runs those steps only (the list: version record colocated learn lora speed).
# Each step's limit is an H200's times CARD_SCALE (benchmarks/card.sh). Outputs: $OUT/<step>.txt and what
# each step writes under $OUT; exits non-zero when any step failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$(mktemp -d)}"
MODEL="${MODEL:-/tmp/models/smollm2}"
LEARN_STEPS="${LEARN_STEPS:-90}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 OUT MODEL PY LEARN_STEPS COLOCATED_SET="${COLOCATED_SET:-}"
source benchmarks/card.sh
failed=0
step() {  # step NAME SECONDS COMMAND...: output to $OUT/NAME.txt, its tail here
  if [[ -n "${STEPS:-}" && " $STEPS " != *" $1 "* ]]; then return; fi
  local name=$1 limit
  limit=$(scaled "$2")
  shift 2
  echo "== $name $(date +%T) (limit ${limit} s)"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "rc=$rc" >> "$OUT/$name.txt"
  tail -30 "$OUT/$name.txt"
  [ "$rc" = 0 ] || { echo "== $name FAILED (exit $rc)"; failed=1; }
}

colocated() {  # a short PPO run through ppo-driver, weights read back after every update, memory sampled
  "$PY" benchmarks/sglang/gpu_memory.py sample "$OUT/colocated_memory.csv" &
  local sampler=$! rc
  "$PY" -m ppo_driver train --config configs/smollm2-sglang-ppo-1gpu.yaml --run-dir "$OUT/colocated" \
    --set model.path="$MODEL" --set train.steps=6 --set rollout.eval_interval=0 --set train.check_weights=true \
    $COLOCATED_SET
  rc=$?
  kill "$sampler"
  "$PY" benchmarks/sglang/gpu_memory.py summary "$OUT/colocated_memory.csv" || rc=1
  return "$rc"
}

learn() {  # the same PPO run through SGLang and through the built-in engine, held-out accuracy at equal steps
  OUT="$OUT/learn" "$PY" packages/ppo_driver/benchmarks/real_model.py --model "$MODEL" \
    --config configs/smollm2-sglang-ppo-1gpu.yaml --config configs/smollm2-ppo-1gpu.yaml \
    --set train.steps="$LEARN_STEPS"
}

step version 60 "$PY" -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"
step record 240 "$PY" benchmarks/sglang/record.py --out "$OUT/recorded" --lora
export -f colocated learn  # run under timeout by a child bash
step colocated 300 bash -c colocated
step learn 420 bash -c learn
step lora 150 "$PY" benchmarks/sglang/lora_equal.py
step speed 300 "$PY" benchmarks/sglang/speed.py --out "$OUT/speed.md"
exit "$failed"
