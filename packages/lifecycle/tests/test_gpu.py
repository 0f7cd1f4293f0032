"""CUDA backends on several GB of state (marked gpu; skipped without CUDA)."""

from __future__ import annotations

import pytest
from gpu_checks import HAVE_TMS, check_pinned_backend, check_tms_backend

from ppo_lifecycle import TorchMemorySaverBackend


@pytest.mark.gpu
def test_pinned_backend_frees_and_restores_several_gb() -> None:
    check_pinned_backend()


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TMS, reason="torch_memory_saver is not installed")
@pytest.mark.parametrize("backup", ["pinned", "retain"])
def test_torch_memory_saver_backend_frees_and_restores_several_gb(backup: str) -> None:
    check_tms_backend(backup, f"state_{backup}")


@pytest.mark.skipif(HAVE_TMS, reason="torch_memory_saver is installed")
def test_torch_memory_saver_missing_is_a_clear_error() -> None:
    with pytest.raises(ImportError, match="memory-saver"):
        TorchMemorySaverBackend()
