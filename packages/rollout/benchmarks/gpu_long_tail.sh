#!/usr/bin/env bash
# One call on one H200 (under 10 minutes; limits scale by card: benchmarks/card.sh): the built-in engine at long, uneven responses.
#   1. the ranged attention kernel's GPU test (compiled, inside a CUDA graph);
#   2. gpu_generate.py at 0.82B: exactness in float32 for every decoder variant, then 256 samples x 256
#      tokens per variant (ranged, sdpa, matmul fused and unfused) against generate and the bound;
#   3. long_tail_generate.py at 0.82B, 128 requests of median 300 and max 2048 tokens, 64 slots:
#      continuous, static batches and transformers generate, with the bandwidth bound;
#   4. the same continuous run with matmul attention (over the KV bucket) for the kernel's share;
#   5. long_tail_generate.py at SmolLM2-135M's shape (bfloat16), 64 requests of median 300 and max
#      1024 tokens, 32 slots, with transformers generate.
# Run from the repository root with every packages/*/src importable (source .carry/setup.sh on the
# device machine). Outputs go to $OUT/<step>.txt; exits non-zero if any step failed.
# Each step's limit is an H200's times CARD_SCALE (benchmarks/card.sh); where the sum passes a call's 600 s
# (an H100), run it in two calls: STEPS="kernel generate" then STEPS="long_tail long_tail_matmul long_tail_135m".
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT="${OUT:-$(mktemp -d)}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$(ls -d "$PWD"/packages/*/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}"
source benchmarks/card.sh
failed=0
step() {  # step NAME SECONDS COMMAND...: output to $OUT/NAME.txt, its tail here (STEPS="a b": those only)
  if [[ -n "${STEPS:-}" && " $STEPS " != *" $1 "* ]]; then return; fi
  local name=$1 limit
  limit=$(scaled "$2")
  shift 2
  echo "== $name $(date +%T) (limit ${limit} s)"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "rc=$rc" >> "$OUT/$name.txt"
  grep -v '^info\|^ok ' "$OUT/$name.txt" | tail -25
  [ "$rc" = 0 ] || { echo "== $name FAILED (exit $rc)"; failed=1; }
}
B=packages/rollout/benchmarks
step kernel 60 "$PY" -m pytest -q -m gpu -p no:cacheprovider packages/rollout/tests/test_ranged_attention.py
step generate 170 "$PY" $B/gpu_generate.py --sizes 0.82B
# transformers generate stops at a projected 60 s x CARD_SCALE and reports the projection
HF_BUDGET=$(scaled 60)
step long_tail 170 "$PY" $B/long_tail_generate.py --size 0.82B --requests 128 --median 300 --max 2048 --slots 64 \
  --hf-budget-s "$HF_BUDGET"
step long_tail_matmul 60 "$PY" $B/long_tail_generate.py --size 0.82B --requests 128 --median 300 --max 2048 \
  --slots 64 --attention matmul --ways continuous
step long_tail_135m 100 "$PY" $B/long_tail_generate.py --size smollm2-135m --requests 64 --median 300 --max 1024 \
  --slots 32 --hf-budget-s "$HF_BUDGET"
exit "$failed"
