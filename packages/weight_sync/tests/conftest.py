from __future__ import annotations

from ppo_testsupport import skip_gpu_tests_without_cuda

pytest_collection_modifyitems = skip_gpu_tests_without_cuda(
    "needs CUDA (run benchmarks/gpu.sh on the GPU machine)"
)
