#!/usr/bin/env bash
# Every test marked `gpu` in every package, on the machine's GPUs: each package's pytest run, one
# after another in this one call (as the packages' nox sessions run them: each package's tests have
# their own conftest, so one pytest process over all of them does not collect). Exits non-zero when
# any run fails, after running the rest. Tests that need two GPUs skip themselves on one.
# Run from anywhere: bash benchmarks/gpu_all.sh   (on the GPU machine: source .carry/setup.sh first)
# PACKAGES="trainer weight_sync" runs those packages only; PER_PACKAGE_S bounds each package's run.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
for src in "$ROOT"/packages/*/src; do PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"; done
export PYTHONPATH PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
PER_PACKAGE_S="${PER_PACKAGE_S:-300}"
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
  echo "== $pkg: pytest -m gpu ($(date -u +%T)) =="
  # exit 5 (every test deselected) is a failure too: a package listed here has gpu tests
  (cd "$ROOT/packages/$pkg" && timeout -k 10 "$PER_PACKAGE_S" "$PY" -m pytest "${ARGS[@]}" tests) \
    || { echo "FAILED: $pkg (exit $?)"; failed+=("$pkg"); }
done
if ((${#failed[@]})); then echo "gpu_all: FAILED: ${failed[*]}"; exit 1; fi
echo "gpu_all: every gpu test passed (${packages[*]})"
