#!/usr/bin/env bash
# GPU check of the driver on 2 GPUs: the 2-GPU example configs, 12 steps each, then the per-phase
# time table of each run. Runs from the repository root with PYTHONPATH holding every packages/*/src.
# Prints each run's summary (reward first/last steps, "engines hold the actor's final weights: match")
# and the tables. Total well under 4 minutes on 2 H200.
set -euo pipefail
failed=0  # set by any failing step; the script exits non-zero after running the rest
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="$(ls -d packages/*/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$(mktemp -d)}"
PY="${PYTHON:-python}"
for cfg in 2gpu-colocate 2gpu-disaggregate; do
  echo "=== $cfg"
  timeout 150 "$PY" -m ppo_driver validate "configs/$cfg.yaml" | tail -12 || { echo "=== $cfg validate FAILED"; failed=1; }
  timeout 150 "$PY" -m ppo_driver train --config "configs/$cfg.yaml" --run-dir "$OUT/$cfg" \
    --set train.steps=12 --set checkpoint.interval=6 --set logging.progress=false \
    || { echo "=== $cfg FAILED (exit $?)"; failed=1; }
done
for cfg in 2gpu-colocate 2gpu-disaggregate; do
  [ -f "$OUT/$cfg/metrics.jsonl" ] && "$PY" packages/ppo_driver/benchmarks/step_breakdown.py "$OUT/$cfg"
done
exit "$failed"
