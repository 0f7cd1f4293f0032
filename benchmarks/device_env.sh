# Sourced on the GPU machine, from the repository root: `source benchmarks/device_env.sh || exit 1`.
# What the project needs there travels in parts over back-to-back calls (a call carries 64 MiB at most),
# each in an ignored folder .xfer*/ named in `carry`; the machine keeps /tmp while warm, so each call
# copies what it carried to /tmp/xfer and, once every part of a thing is there, unpacks it once:
#   sg_part_*       SGLang (benchmarks/sglang/prepare.sh's parts)     -> /tmp/sgsite
#   vl_part_*       vLLM 0.26.0 beyond SGLang's packages (VL_PARTS of them, benchmarks/vllm/prepare.sh)
#                   -> /tmp/vlsite, and /tmp/vlsite/python: vLLM's Python for rollout.vllm.python (the
#                   image's python3 with /tmp/vlsite before /tmp/sgsite; the SGLang parts are needed too)
#   ray_slim.tar.xz, *.whl (../shared/device/prepare-carry.sh, gguf)  -> /tmp/site
#   smol_part_*     SmolLM2-135M-Instruct's GGUF (SMOL_PARTS of them)  -> /tmp/models/smollm2 (import-model)
#   extras.tar.xz, pycosat-*.whl  the reasoning-gym and bfcl extras (pure Python, and pycosat built for
#                   3.12: benchmarks/pack_extras.sh)                     -> /tmp/site
# Then PYTHONPATH holds /tmp/sgsite, /tmp/site and every packages/*/src, and SGLang's Triton kernels
# compile once into /tmp/triton. Prints what is ready.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/triton SMOL_PARTS="${SMOL_PARTS:-2}" SG_PARTS="${SG_PARTS:-3}" VL_PARTS="${VL_PARTS:-2}"
mkdir -p /tmp/xfer /tmp/site /tmp/triton
for d in .xfer*/; do [ -d "$d" ] && cp -n "$d"* /tmp/xfer/ 2>/dev/null; done
ls /tmp/xfer
if [ ! -f /tmp/sgsite/.done ] && [ "$(ls /tmp/xfer/sg_part_* 2>/dev/null | wc -l)" = "$SG_PARTS" ]; then
  mkdir -p /tmp/sgsite && cat /tmp/xfer/sg_part_* | xz -d -T8 | tar x -C /tmp/sgsite && touch /tmp/sgsite/.done \
    && echo "device_env: SGLang unpacked"
fi
if [ ! -f /tmp/vlsite/.done ] && [ "$(ls /tmp/xfer/vl_part_* 2>/dev/null | wc -l)" = "$VL_PARTS" ]; then
  mkdir -p /tmp/vlsite && cat /tmp/xfer/vl_part_* | xz -d -T8 | tar x -C /tmp/vlsite && cat > /tmp/vlsite/python <<'SH'
#!/bin/sh
# vLLM 0.26.0's Python: its packages first, then SGLang's slim set; FlashInfer's sampler off (it compiles
# with nvcc, which the image lacks: vLLM samples with PyTorch's)
export PYTHONPATH="/tmp/vlsite:/tmp/sgsite${PYTHONPATH:+:$PYTHONPATH}" VLLM_USE_FLASHINFER_SAMPLER=0
exec python3 "$@"
SH
  chmod +x /tmp/vlsite/python && touch /tmp/vlsite/.done && echo "device_env: vLLM unpacked (rollout.vllm.python=/tmp/vlsite/python)"
fi
if [ ! -f /tmp/site/.done ] && [ -f /tmp/xfer/ray_slim.tar.xz ]; then
  tar xJf /tmp/xfer/ray_slim.tar.xz -C /tmp/site \
    && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      /tmp/xfer/*.whl && touch /tmp/site/.done && echo "device_env: ray, megatron-core, torch_memory_saver ready"
fi
if [ ! -f /tmp/site/.extras ] && [ -f /tmp/site/.done ] && [ -f /tmp/xfer/extras.tar.xz ]; then
  tar xJf /tmp/xfer/extras.tar.xz -C /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site /tmp/xfer/pycosat-*.whl \
    ; touch /tmp/site/.extras && echo "device_env: reasoning-gym and bfcl-eval ready"
fi
src=$(ls -d "$PWD"/packages/*/src | paste -sd: -)
sg=""; [ -f /tmp/sgsite/.done ] && sg=/tmp/sgsite:
export PYTHONPATH="${sg}/tmp/site:$src${PYTHONPATH:+:$PYTHONPATH}"
export PATH="/tmp/sgsite/bin:$PATH" TOKENIZERS_PARALLELISM=false
if [ ! -f /tmp/models/smollm2/config.json ] && [ -f /tmp/site/.done ] \
   && [ "$(ls /tmp/xfer/smol_part_* 2>/dev/null | wc -l)" = "$SMOL_PARTS" ]; then
  cat /tmp/xfer/smol_part_* > /tmp/smollm2.gguf
  python3 -m ppo_driver import-model /tmp/smollm2.gguf /tmp/models/smollm2 --force > /tmp/import.log 2>&1 \
    && echo "device_env: SmolLM2-135M-Instruct imported to /tmp/models/smollm2" || tail -5 /tmp/import.log
fi
echo "device_env: sglang=$([ -f /tmp/sgsite/.done ] && echo yes || echo no)" \
  "vllm=$([ -f /tmp/vlsite/.done ] && echo yes || echo no)" \
  "site=$([ -f /tmp/site/.done ] && echo yes || echo no)" \
  "smollm2=$([ -f /tmp/models/smollm2/config.json ] && echo yes || echo no)" \
  "extras=$([ -f /tmp/site/.extras ] && echo yes || echo no)"
