#!/usr/bin/env bash
# The real SGLang on one GPU: the seeds' colocated scenario, learning through it, LoRA adapter-only
# updates, the recorded HTTP exchanges, and the built-in engine beside it. From the repository root on
# the GPU machine, once the parts arrived (benchmarks/sglang/README.md says how):
#   source benchmarks/device_env.sh && bash benchmarks/sglang/gpu_sglang.sh
# STEPS="record colocated" runs those steps only (the list: version record lora colocated learn_both
# learn_sglang learn_builtin speed; learn_both runs the two learning runs at once on the GPU).
# Each step's limit is an H200's times CARD_SCALE (benchmarks/card.sh). Outputs: $OUT/<step>.txt and what
# each step writes under $OUT; exits non-zero when any step failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$(mktemp -d)}"
MODEL="${MODEL:-/tmp/models/smollm2}"
LEARN_STEPS="${LEARN_STEPS:-60}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 OUT MODEL PY LEARN_STEPS CHECK_ROWS="${CHECK_ROWS:-16}" COLOCATED_SET="${COLOCATED_SET:-}" LEARN_SET="${LEARN_SET:-}"
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
    --set rollout.sglang.check_rows="$CHECK_ROWS" $COLOCATED_SET
  rc=$?
  kill "$sampler"
  "$PY" benchmarks/sglang/gpu_memory.py summary "$OUT/colocated_memory.csv" || rc=1
  return "$rc"
}

learn() {  # learn CONFIG NAME: a PPO run of SmolLM2 on held-out arithmetic, accuracy before and after
  OUT="$OUT/$2" "$PY" packages/ppo_driver/benchmarks/real_model.py --model "$MODEL" --config "$1" \
    --set train.steps="$LEARN_STEPS" $LEARN_SET
}

step version 60 "$PY" -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"
step record 240 "$PY" benchmarks/sglang/record.py --out "$OUT/recorded" --lora
learn_both() {  # both runs at once on the one GPU (accuracy at equal steps; their wall times overlap)
  learn configs/smollm2-sglang-ppo-1gpu.yaml learn-sglang > "$OUT/learn_sglang.txt" 2>&1 &
  local sglang=$! rc=0
  learn configs/smollm2-ppo-1gpu.yaml learn-builtin > "$OUT/learn_builtin.txt" 2>&1 || rc=1
  wait "$sglang" || rc=1
  tail -12 "$OUT/learn_sglang.txt" "$OUT/learn_builtin.txt"
  return "$rc"
}

export -f colocated learn learn_both  # run under timeout by a child bash
step lora 150 "$PY" benchmarks/sglang/lora_equal.py --logs "$OUT/lora-logs"
step colocated 300 bash -c colocated
step learn_both 420 bash -c learn_both
step learn_sglang 360 bash -c "learn configs/smollm2-sglang-ppo-1gpu.yaml learn-sglang"
step learn_builtin 240 bash -c "learn configs/smollm2-ppo-1gpu.yaml learn-builtin"
step speed 300 "$PY" benchmarks/sglang/speed.py --sizes "${SPEED_SIZES:-smollm2-135m}" --out "$OUT/speed.md" \
  --logs "$OUT/speed-logs"
exit "$failed"
