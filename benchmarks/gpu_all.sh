#!/usr/bin/env bash
# Every test marked `gpu` in every package, on the machine's GPUs: each package's pytest run, one
# after another in this one call (as the packages' nox sessions run them: each package's tests have
# their own conftest, so one pytest process over all of them does not collect). Exits non-zero when
# any run fails, after running the rest. Tests that need two GPUs skip themselves on one.
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
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader || true
failed=()
packages=()
for tests in "$ROOT"/packages/*/tests; do
  pkg="$(basename "$(dirname "$tests")")"
  if [[ -n "${PACKAGES:-}" && " $PACKAGES " != *" $pkg "* ]]; then continue; fi
  # a decorator or a module's pytestmark at a line's start: not a test's string that holds the marker
  if grep -rqsE '^\s*(@pytest\.mark\.gpu|pytestmark\s*=.*pytest\.mark\.gpu)' "$tests"; then packages+=("$pkg"); fi
done
if ((${#packages[@]} == 0)); then echo "gpu_all: no package with gpu tests matches PACKAGES='${PACKAGES:-}'"; exit 1; fi
for pkg in "${packages[@]}"; do
  limit="${PER_PACKAGE_S:-$(scaled "${LIMIT_H200[$pkg]:-300}")}"
  echo "== $pkg: pytest -m gpu ($(date -u +%T), limit ${limit} s) =="
  # exit 5 (every test deselected) is a failure too: a package listed here has gpu tests;
  # exit 124: the limit ran out (said as such, not as a test failure)
  (cd "$ROOT/packages/$pkg" && timeout -k 10 "$limit" "$PY" -m pytest "${ARGS[@]}" tests)
  rc=$?
  if ((rc == 124 || rc == 137)); then echo "FAILED: $pkg ran past its ${limit} s limit"; failed+=("$pkg");
  elif ((rc != 0)); then echo "FAILED: $pkg (exit $rc)"; failed+=("$pkg"); fi
done
if ((${#failed[@]})); then echo "gpu_all: FAILED: ${failed[*]}"; exit 1; fi
echo "gpu_all: every gpu test passed (${packages[*]})"
