#!/usr/bin/env bash
# GPU tests and benchmarks of ppo-trainer in one go (needs CUDA; two GPUs for the weight update).
# Bounded: each step runs under a timeout (about 30 minutes at worst, about 11 when healthy).
# Expects every packages/*/src on PYTHONPATH (or the packages installed). Prints Markdown tables.
set -euo pipefail
export PYTHONUNBUFFERED=1
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0
PY="${PYTHON:-python}"
cd "$(dirname "$0")/.."

echo "== actor and critic taking turns on one GPU (NCCL, memory backends), weight update to GPU 1 =="
timeout -k 5 240 "$PY" benchmarks/gpu_workers.py --steps 3

echo "== FSDP2 across sleep and wake on NCCL (2 GPUs) =="
timeout -k 5 240 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_sharding.py

echo "== replicated vs FSDP2 data parallelism, actor and critic taking turns on 2 GPUs =="
timeout -k 5 480 "$PY" benchmarks/gpu_fsdp.py --steps 3

echo "== train-step throughput, GPU =="
timeout -k 5 120 "$PY" benchmarks/bench_train_step.py --device cuda --repeats 5 --warmup 2

echo "== train-step throughput, CPU (same machine, 1 thread) =="
timeout -k 5 300 "$PY" benchmarks/bench_train_step.py --device cpu --repeats 3 --warmup 1

if "$PY" -c 'import megatron.core' 2>/dev/null; then
    echo "== megatron backend against the torch backend: parity, round trip, sleep/wake, train step, worker groups =="
    timeout -k 5 420 "$PY" benchmarks/gpu_megatron.py --workers
    echo "== megatron actor: sleep and wake per lifecycle step, against the torch backend =="
    timeout -k 5 300 "$PY" benchmarks/gpu_megatron_sleep.py
else
    echo "== megatron backend: megatron-core is not installed here, skipped =="
fi
