#!/usr/bin/env bash
# GPU tests and the sleep/wake benchmarks of ppo-lifecycle, in one go (about 4-5 minutes on an H200).
# Run from the repository root or anywhere: bash packages/lifecycle/benchmarks/gpu.sh
set -uo pipefail  # run every part even if one fails; each prints its own result
failed=0  # set by any failing step; the script exits non-zero after running the rest
export PYTHONUNBUFFERED=1
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
for src in "$ROOT"/packages/*/src; do PYTHONPATH="$src:${PYTHONPATH:-}"; done
export PYTHONPATH
PY="${PYTHON:-python}"
cd "$HERE"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
"$PY" -c "import torch_memory_saver" 2>/dev/null && echo "torch_memory_saver: installed" \
  || echo "torch_memory_saver: NOT installed (its tests and benchmark rows will be skipped/failed)"

echo "== GPU tests (4 GiB of state per backend)"
if "$PY" -c "import pytest" 2>/dev/null; then
  "$PY" -m pytest tests/test_gpu.py -m gpu -q -p no:cacheprovider -o addopts="" -s || { echo "GPU TESTS FAILED (exit $?)"; failed=1; }
else
  "$PY" tests/gpu_checks.py || { echo "GPU CHECKS FAILED (exit $?)"; failed=1; }
fi

echo "== sleep/wake benchmark, 16 GiB of state"
"$PY" benchmarks/sleep_wake.py --gib 16 --cycles 3 --tms-default-gib 16 --tms-default-cycles 2 \
  || { echo "BENCHMARK FAILED (exit $?)"; failed=1; }
echo "== where a 9.87 GB sleep goes: copy, frees, allocator (ordinary and expandable segments)"
"$PY" benchmarks/sleep_breakdown.py --cycles 4 || { echo "BREAKDOWN FAILED (exit $?)"; failed=1; }
echo "== destroying and rebuilding 20 NCCL subgroups, separate against shared"
"$PY" benchmarks/groups_reload.py --backend nccl --world 1 --groups 20 --cycles 2 \
  || { echo "GROUPS BENCHMARK FAILED (exit $?)"; failed=1; }
exit "$failed"
