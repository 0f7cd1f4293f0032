"""One local Ray instance for the whole suite, and the gpu marker's skip rule."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

# Under `uv run`, Ray would start every worker through `uv run` as well (slow on a small machine);
# the workers share this interpreter's environment anyway. Read when ray is imported.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import pytest
import ray
import torch

from ppo_testsupport import skip_gpu_tests_without_cuda

HERE = Path(__file__).resolve().parent


pytest_collection_modifyitems = skip_gpu_tests_without_cuda("needs CUDA")


PYTHONPATH = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    torch.set_num_threads(1)
    gpus = torch.cuda.device_count()
    for attempt in range(3):
        try:
            ray.init(
                num_cpus=4,
                num_gpus=gpus,
                object_store_memory=256 * 1024**2,
                include_dashboard=False,
                log_to_driver=False,
                # Workers unpickle the test modules' remote classes by module name: let them import them.
                runtime_env={"env_vars": {"PYTHONPATH": PYTHONPATH}},
            )
            break
        except Exception:
            # Ray gives its raylet a fixed 30 s to register; a loaded CI machine can miss that.
            ray.shutdown()
            if attempt == 2:
                raise
    yield
    ray.shutdown()
