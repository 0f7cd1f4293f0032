"""Expandable segments: what the process uses, and who decides (CPU: the settings, not the segments)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ppo_lifecycle import PinnedHostBackend
from ppo_lifecycle.memory import allocator


@pytest.fixture(autouse=True)
def clean_allocator_setting(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(allocator, "_set_here", None)
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    before = getter() if getter is not None else None
    yield
    allocator._apply(False)
    if before is not None:
        torch._C._accelerator_setAllocatorSettings(before or "expandable_segments:False")


def test_enable_switches_the_allocator_on() -> None:
    assert allocator.enable_expandable_segments() is True
    assert allocator.expandable_segments_enabled() is True
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        assert "expandable_segments:True" in getter()


def test_an_explicit_false_in_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:False")
    assert allocator.enable_expandable_segments() is False
    assert allocator.expandable_segments_enabled() is False


def test_the_environment_is_read_when_nothing_was_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    assert allocator.expandable_segments_enabled() is False
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert allocator.expandable_segments_enabled() is True


def test_set_decides_until_set_again() -> None:
    allocator.set_expandable_segments(True)
    assert allocator.expandable_segments_enabled() is True
    allocator.set_expandable_segments(False)
    assert allocator.expandable_segments_enabled() is False


def test_pinned_backend_frees_while_copying_follows_the_setting_unless_told() -> None:
    backend = PinnedHostBackend("cuda:0")  # constructing needs no GPU; copying would
    allocator.set_expandable_segments(True)
    assert backend.frees_while_copying is True
    allocator.set_expandable_segments(False)
    assert backend.frees_while_copying is False
    assert PinnedHostBackend("cuda:0", free_while_copying=True).frees_while_copying is True


def test_pinned_backend_rejects_a_group_size_of_zero() -> None:
    with pytest.raises(ValueError, match="free_group_bytes must be positive"):
        PinnedHostBackend("cuda:0", free_group_bytes=0)


def test_torch_memory_saver_backend_refuses_expandable_segments() -> None:
    from ppo_lifecycle import TorchMemorySaverBackend

    allocator.set_expandable_segments(True)
    with pytest.raises(ValueError, match=r"expandable segments.*PinnedHostBackend"):
        TorchMemorySaverBackend()


def test_switching_keeps_the_users_other_allocator_settings() -> None:
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is None:
        pytest.skip("this torch has no allocator settings getter")
    # torch resets every key a settings string leaves out: the others must be passed again
    others = "max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2]"
    torch._C._accelerator_setAllocatorSettings(others)
    allocator.enable_expandable_segments()
    assert getter() == f"{others},expandable_segments:True"
    allocator.set_expandable_segments(False)
    assert getter() == f"{others},expandable_segments:False"
