from __future__ import annotations

import torch

from ppo_testsupport import skip_gpu_tests_without_cuda

torch.set_num_threads(1)


pytest_collection_modifyitems = skip_gpu_tests_without_cuda(
    "needs CUDA (run on the GPU machine: benchmarks/gpu.sh)"
)
