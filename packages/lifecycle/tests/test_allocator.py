"""Expandable segments: what the process uses, and who decides (CPU: the settings, not the segments)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ppo_lifecycle.memory import PinnedHostBackend, allocator


@pytest.fixture(autouse=True)
def clean_allocator_setting(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(allocator, "_set_here", None)
    monkeypatch.setattr(allocator, "_last_applied", None)
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
    from ppo_lifecycle.memory import TorchMemorySaverBackend

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


def test_without_a_getter_the_last_string_set_here_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch 2.11 has no settings getter; before CUDA starts, what this module set last is the truth.
    real_getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if real_getter is None:
        pytest.skip("this torch has no allocator settings getter to check the result with")
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    allocator.set_expandable_segments(True)
    assert real_getter() == "max_split_size_mb:128,expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.5")  # read once, at start
    allocator.set_expandable_segments(False)
    assert real_getter() == "max_split_size_mb:128,expandable_segments:False"


def test_without_a_getter_a_started_allocator_is_asked_through_its_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The snapshot stands in for a started CUDA allocator (no GPU here); tests/test_gpu.py's expandable
    # run and ppo-weight-sync's GPU test read the real one on torch 2.11.
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings", raising=False)
    snapshot = {"allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: snapshot)
    assert allocator.expandable_segments_enabled() is True
    snapshot["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:False"
    assert allocator.expandable_segments_enabled() is False
