#!/usr/bin/env bash
# On the GPU machine, after .sglang-carry/setup.sh unpacked SGLang 0.5.17 into /tmp/sgsite (README.md):
# records every exchange of the adapter with a real server into $OUT/rec.tgz, the log into $OUT/record.log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
src=$(ls -d "$PWD"/packages/*/src | tr '\n' ':')
export PYTHONPATH="/tmp/sgsite:${src%:}"
export PATH="/tmp/sgsite/bin:$PATH" TOKENIZERS_PARALLELISM=false
out=${OUT:-/tmp/out}; mkdir -p "$out"; rm -rf /tmp/rec
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"
python3 benchmarks/sglang/record.py --out /tmp/rec --lora "$@" > "$out/record.log" 2>&1
rc=$?
(cd /tmp/rec && tar czf "$out/rec.tgz" *)
grep -E '^\[|^FAILED|server up|server stopped|no recording|all steps|step\(s\) failed|weight group' "$out/record.log" | tail -60
echo "record.py exit code $rc"
exit $rc
