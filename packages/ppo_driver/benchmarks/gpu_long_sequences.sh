#!/usr/bin/env bash
# One call on one H200 (about 10 minutes at most): where long, uneven responses spend a step's time.
#   1. the colocated step budget at 0.82B with long-tailed responses (gpu_budget.py: 32 prompts x 8
#      samples, lognormal lengths of median 512 and max 2048 tokens; 2 steps to fit the call, the
#      script's own default of 3 in a call of its own; needs Ray);
#   2. the train phases at 0.82B with 2048-token samples (packed within a 16384-token budget, and
#      with compile_layers);
#   3. the train phases at 135M with 2048-token samples, 2 mini-batches of 32k tokens: token budgets
#      of 16k and 32k (two micro-batches a mini-batch, or one), each also compiled, with
#      inductor's caches in a fresh folder; then the compiled variant again with the same folder (the
#      compile with warm caches: its first-call seconds).
# Runs from the repository root with PYTHONPATH holding every packages/*/src (and whatever PYTHONPATH
# already holds: Ray where the machine lacks it). Where pydantic does not import, the wheels in .gpuw/
# are installed to /tmp/site first. Each step has its own time limit; outputs go to $OUT
# (budget.md and budget-colocate-1gpu.md, budget.txt, train082.txt, train135.txt, train135-warm.txt);
# exits non-zero if any step failed. PARTS (default "budget train082 train135") picks the parts to run.
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"  # absolute: the trainer steps run from packages/trainer
PY="${PYTHON:-python3}"
[[ "$PY" == */* ]] && PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # a path: absolute too
if ! "$PY" -c "import pydantic" 2> /dev/null && compgen -G ".gpuw/*.whl" > /dev/null; then
  mkdir -p /tmp/site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpuw/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$(ls -d "$PWD"/packages/*/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
failed=0
PARTS="${PARTS:-budget train082 train135}"
step() {  # step NAME SECONDS COMMAND...: output to $OUT/NAME.txt, its tail here
  local name=$1 limit=$2
  shift 2
  [[ " $PARTS " == *" ${name%-warm} "* ]] || return 0
  echo "== $name $(date +%T) (limit ${limit} s)"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "rc=$rc" >> "$OUT/$name.txt"
  grep -v '^\[bench\]' "$OUT/$name.txt" | tail -40
  [ "$rc" = 0 ] || { echo "== $name FAILED (exit $rc)"; failed=1; }
}
# The run folders (the model's weights among them) stay on the machine; the tables go to $OUT.
RUNS="$(mktemp -d /tmp/budget-runs.XXXX)"
# startup.warm_up=false: the engine's warm-up captures its decode graphs up to the full KV capacity
# (256 rows x 2,112 columns: about 70 GB at 0.82B) while the trainers set up, which does not fit beside
# them on one H200; without it the first generate takes that memory once the trainers are asleep.
step budget 250 "$PY" packages/ppo_driver/benchmarks/gpu_budget.py --scenario colocate-1gpu \
  --response-median 512 --response-max 2048 --steps 2 --set startup.warm_up=false --out "$RUNS"
cp "$RUNS"/budget*.md "$RUNS"/budget.json "$OUT"/ 2> /dev/null
cd packages/trainer
# --threads 16 (the H200 host's cores): the trainers initialise their random weights on the CPU
# (0.82B: 6 trainers a run).
# Fresh inductor cache folders: each first compiled call is a cold compile, whatever the machine ran.
step train082 180 "$PY" benchmarks/bench_train_phase.py --device cuda --threads 16 --size 0.82b --samples 24 \
  --sample-tokens 2048 --max-tokens 16384 --variants packed-budget,compiled --warmup 1 --repeats 2 \
  --compile-cache "$(mktemp -d /tmp/inductor-082.XXXX)"
CACHE135="$(mktemp -d /tmp/inductor-135m.XXXX)"
step train135 130 "$PY" benchmarks/bench_train_phase.py --device cuda --threads 8 --size 135m --samples 32 \
  --sample-tokens 2048 --mini-batches 2 --max-tokens 16384,32768 --variants packed-budget,compiled \
  --warmup 2 --repeats 3 \
  --compile-cache "$CACHE135"
step train135-warm 40 "$PY" benchmarks/bench_train_phase.py --device cuda --threads 8 --size 135m --samples 32 \
  --sample-tokens 2048 --mini-batches 2 --max-tokens 32768 --variants compiled --warmup 1 --repeats 2 \
  --compile-cache "$CACHE135"
exit "$failed"
