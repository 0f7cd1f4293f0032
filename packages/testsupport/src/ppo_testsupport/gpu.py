"""The ``gpu`` marker's skip rule, one hook for every package's ``conftest.py``."""

from __future__ import annotations

from collections.abc import Callable

import pytest

Hook = Callable[[pytest.Config, list[pytest.Item]], None]


def _cuda_available() -> bool:
    try:
        import torch  # every package that marks GPU tests depends on torch; this one does not
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def skip_gpu_tests_without_cuda(reason: str = "needs CUDA (run on the GPU machine)") -> Hook:
    """A ``pytest_collection_modifyitems`` hook that skips tests marked ``gpu`` when CUDA is absent.

    In a ``conftest.py``: ``pytest_collection_modifyitems = skip_gpu_tests_without_cuda("needs CUDA")``.
    """

    def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
        if _cuda_available():
            return
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)

    return pytest_collection_modifyitems
