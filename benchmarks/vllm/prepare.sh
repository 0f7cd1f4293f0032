#!/usr/bin/env bash
# Builds a slim, real vLLM 0.26.0 for the lent GPU machine (Python 3.12, torch 2.11.0+cu130, which vLLM
# 0.20.0-0.26.0 pin) and cuts it into parts that fit what a GPU call carries: vl_part_aa, vl_part_ab, ...
# of at most 55 MB, one in each of the ignored folders .xferV1/, .xferV2/, ...
# Usage (from the project root): bash benchmarks/vllm/prepare.sh
#   VLLM_WHEELS=DIR  a folder already holding vllm-0.26.0-*.whl (default /tmp/vllmdl2; else from PyPI)
# On the device, carry the folders on back-to-back calls (the machine keeps /tmp while warm):
#   run(carry=[".xferV1"], command="source benchmarks/device_env.sh")   # and so on to the last one
# benchmarks/device_env.sh unpacks them into /tmp/vlsite once VL_PARTS parts have arrived, and writes
# /tmp/vlsite/python: set rollout.vllm.python to it (it puts /tmp/vlsite before SGLang's /tmp/sgsite on
# the server's PYTHONPATH).
#
# What goes in: what vLLM 0.26.0 needs that the machine's image lacks (gpu-machine-packages.txt of
# benchmarks/sglang) and SGLang's slim install (/tmp/sgsite, sglang-slim-packages.txt here: the exact
# versions inside benchmarks/sglang/prepare.sh's parts) does not hold at a version vLLM takes; the
# resolution prefers SGLang's versions. So vLLM runs with PYTHONPATH=/tmp/vlsite:/tmp/sgsite: the SGLang
# parts must be there too. Left out: torch, triton and the CUDA wheels (the image's), FlashAttention 2
# (_vllm_fa2_C, 305 MB: Hopper runs FlashAttention 3), the MoE kernels (_moe_C, 47 MB: dense models only,
# vLLM imports them under contextlib.suppress), the Rust front end (vllm-rs), the sm100 FMHA and DeepGEMM
# sources, and the optional kernel, video, tracing-export and CLI packages (skip below).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd); root=$(git -C "$here" rev-parse --show-toplevel); cd "$root"
git check-ignore -q .xferV1/ || { echo "prepare: .xferV1/ is not ignored (.gitignore: /.xfer*/)"; exit 1; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
wheels=${VLLM_WHEELS:-/tmp/vllmdl2}
printf 'vllm==0.26.0\ntorch==2.11.0\n' > "$work/req.in"
compile=(uv pip compile -q "$work/req.in" --python-version 3.12 --python-platform x86_64-manylinux_2_34)
# dated.txt: the versions of vLLM 0.26.0's release (2026-07-25); sg.txt: the same, SGLang's versions
# preferred where vLLM's pins take them (uv keeps an output file's versions where it can)
"${compile[@]}" --exclude-newer 2026-07-26T00:00:00Z -o "$work/dated.txt"
cp "$here/sglang-slim-packages.txt" "$work/sg.txt"
"${compile[@]}" -o "$work/sg.txt"
python3 - "$work" "$root/benchmarks/sglang/gpu-machine-packages.txt" "$here/sglang-slim-packages.txt" <<'PY'
import re, sys
from packaging.version import Version
work, image, slim = sys.argv[1:]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
have = {norm(line.strip()) for line in open(image) if line.strip()}
sg = {norm(line.split("==")[0]): line.split("==")[1].strip() for line in open(slim) if "==" in line}


def pins(path):
    found = (re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line) for line in open(path))
    return {norm(m[1]): m[2] for m in found if m}


preferred = pins(f"{work}/sg.txt")
skip = re.compile(
    r"^(torch|torchvision|torchaudio|torchcodec|triton|nvidia-.*|cuda-.*|tilelang|humming-kernels|quack-kernels"
    r"|tokenspeed-.*|kernels|z3-solver|pynvvideocodec|opencv-python-headless|fastsafetensors|flashinfer-python"
    r"|apache-tvm-ffi|torch-c-dlpack-ext|fastapi-cli|fastapi-cloud-cli|rich-toolkit|rignore|sentry-sdk|fastar"
    r"|opentelemetry-exporter-.*|opentelemetry-proto|googleapis-common-protos|grpcio|supervisor)$"
)
need, reused = [], []
for name, version in pins(f"{work}/dated.txt").items():
    if name in have or skip.match(name):
        continue
    # SGLang's copy serves when vLLM's pins take it and it is no older than vLLM's release had (openai
    # 2.6.1, SGLang's, lacks what vLLM 0.26.0 imports from openai.types.responses), or older but used
    # only for structured output (xgrammar 0.2.1 for 0.2.3: 114 MB unpacked)
    recent = name == "xgrammar" or Version(sg.get(name, "0")) >= Version(version)
    ok = name in sg and preferred.get(name) == sg[name] and recent
    (reused if ok else need).append(f"{name}=={version}")
open(f"{work}/need.txt", "w").write("\n".join(need) + "\n")
print(f"prepare: {len(need)} packages in the parts, {len(reused)} taken from SGLang's slim install")
print("prepare: beyond SGLang's:", " ".join(need))
PY
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do plat+=(--platform "$p"); done
links=(); [ -d "$wheels" ] && links=(--find-links "$wheels")
python3 -m pip download -q --no-deps "${plat[@]}" "${links[@]}" -d "$work/w" -r "$work/need.txt" \
  2> "$work/pip.err" || { grep -v 'is ignored: it is neither' "$work/pip.err"; exit 1; }
python3 - "$work" <<'PY'
import glob, os, re, sys, zipfile
work = sys.argv[1]
drop = re.compile(
    r"^vllm/(vllm_flash_attn/_vllm_fa2_C\.abi3\.so|_moe_C_stable_libtorch\.abi3\.so|vllm-rs"
    r"|third_party/(fmha_sm100|deep_gemm)/)"
)
for w in sorted(glob.glob(f"{work}/w/*.whl")):
    with zipfile.ZipFile(w) as z:
        for n in z.namelist():
            if drop.match(n) or (".data/" in n and "/scripts/" in n) or "/__pycache__/" in n:
                continue
            z.extract(n, f"{work}/site")
PY
rm -rf .xferV[0-9]*
(cd "$work/site" && tar cf - . | xz -T0 -6) | split -b 55000000 - "$work/vl_part_"
i=0; for part in "$work"/vl_part_*; do i=$((i + 1)); mkdir -p ".xferV$i"; mv "$part" ".xferV$i/"; done
du -sh "$work/site" | sed 's/\t.*/ unpacked/'; ls -l .xferV*/vl_part_*
echo "prepare: $i parts; on the device VL_PARTS=$i (benchmarks/device_env.sh)"
