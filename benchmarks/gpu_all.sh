#!/usr/bin/env bash
# Every test marked `gpu` in every package, on the machine's GPUs: each test file with gpu tests in a
# pytest process of its own (a package's tests have their own conftest, and one module's process-wide
# state -- megatron-core's parallel groups and seeds, torch's backend flags, the CUDA caching
# allocator -- must not reach the next module: one H100 run saw test_gpu_packing's varlen case fail
# after the megatron tests in the same process and pass alone). Exits non-zero when any run fails,
# after running the rest. Tests that need two GPUs skip themselves on one.
# Run from anywhere: bash benchmarks/gpu_all.sh   (on the GPU machine: source .carry/setup.sh first)
# PACKAGES="trainer weight_sync" runs those packages only. Each package's run is bounded by its own
# limit (below: about twice what it took on one H200), times CARD_SCALE (benchmarks/card.sh: 1.5 on an
# H100); PER_PACKAGE_S replaces every limit. A device call runs 600 s at most: where the limits of the
# packages chosen add up past it on your card, split them over calls with PACKAGES=.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
for src in "$ROOT"/packages/*/src; do PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"; done
export PYTHONPATH PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
# seconds on one H200, about twice the package's GPU tests' own time there (trainer: 258 s on an H100)
declare -A LIMIT_H200=([trainer]=360 [rollout]=240 [ppo_driver]=300 [lifecycle]=120 [weight_sync]=120 \
  [value_transport]=120 [placement]=120 [testsupport]=120)
source "$ROOT/benchmarks/card.sh"
ARGS=(-m gpu -q -p no:cacheprovider -o addopts="" -rfEs -o faulthandler_timeout=120)
# a decorator or a module's pytestmark at a line's start: not a test's string that holds the marker
GPU_MARK='^\s*(@pytest\.mark\.gpu|pytestmark\s*=.*pytest\.mark\.gpu)'
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader || true
failed=()
packages=()
for tests in "$ROOT"/packages/*/tests; do
  pkg="$(basename "$(dirname "$tests")")"
  if [[ -n "${PACKAGES:-}" && " $PACKAGES " != *" $pkg "* ]]; then continue; fi
  if grep -rqsE "$GPU_MARK" "$tests"; then packages+=("$pkg"); fi
done
if ((${#packages[@]} == 0)); then echo "gpu_all: no package with gpu tests matches PACKAGES='${PACKAGES:-}'"; exit 1; fi
for pkg in "${packages[@]}"; do
  limit="${PER_PACKAGE_S:-$(scaled "${LIMIT_H200[$pkg]:-300}")}"
  echo "== $pkg: pytest -m gpu, one process per file ($(date -u +%T), limit ${limit} s for them all) =="
  # exit 5 (every test deselected) is a failure too: each file listed here has gpu tests;
  # exit 124: the limit ran out (said as such, not as a test failure)
  deadline=$((SECONDS + limit))
  rc=0
  for file in $(cd "$ROOT/packages/$pkg" && grep -rlsE "$GPU_MARK" tests --include='test_*.py' | sort); do
    left=$((deadline - SECONDS))
    if ((left <= 0)); then rc=124; break; fi
    echo "-- $file (${left} s left)"
    (cd "$ROOT/packages/$pkg" && timeout -k 10 "$left" "$PY" -m pytest "${ARGS[@]}" "$file")
    file_rc=$?
    if ((file_rc == 124 || file_rc == 137)); then rc=124; break; fi
    ((file_rc != 0)) && rc=$file_rc
  done
  if ((rc == 124 || rc == 137)); then echo "FAILED: $pkg ran past its ${limit} s limit"; failed+=("$pkg");
  elif ((rc != 0)); then echo "FAILED: $pkg (exit $rc)"; failed+=("$pkg"); fi
done
if ((${#failed[@]})); then echo "gpu_all: FAILED: ${failed[*]}"; exit 1; fi
echo "gpu_all: every gpu test passed (${packages[*]})"
