"""CUDA backends on several GB of state (marked gpu; skipped without CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_checks import HAVE_TMS, check_pinned_backend, check_tms_backend

from ppo_lifecycle.memory import TorchMemorySaverBackend


@pytest.mark.gpu
def test_pinned_backend_frees_and_restores_several_gb() -> None:
    check_pinned_backend()


@pytest.mark.gpu
def test_pinned_backend_under_expandable_segments_frees_while_copying() -> None:
    # Its own process: the allocator setting is process-wide and torch_memory_saver cannot share it.
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    code = "from gpu_checks import check_pinned_backend; check_pinned_backend(frees_while_copying=True)"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pinned: sleep" in proc.stdout
    print(proc.stdout.strip())


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TMS, reason="torch_memory_saver is not installed")
@pytest.mark.parametrize("backup", ["pinned", "retain"])
def test_torch_memory_saver_backend_frees_and_restores_several_gb(backup: str) -> None:
    check_tms_backend(backup, f"state_{backup}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TMS, reason="torch_memory_saver is not installed")
def test_a_process_that_used_torch_memory_saver_exits_cleanly() -> None:
    # torch_memory_saver 0.0.10's free hook ends the process with exit code 1 when a region's pool is
    # destroyed outside a region, as at interpreter exit; the backend lets that memory go at exit.
    code = (
        "import torch; from ppo_lifecycle.memory import TorchMemorySaverBackend\n"
        "backend = TorchMemorySaverBackend()\n"
        "with backend.region('weights'):\n"
        "    w = torch.ones(64 << 20, device='cuda')\n"
        "backend.track('weights', lambda: [w])\n"
        "backend.release(); backend.restore()\n"
        "assert int(w.sum()) == w.numel()\n"
        "print('used a region')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "used a region" in proc.stdout, proc.stderr[-3000:]
    assert "only support interesting region" not in proc.stderr + proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.skipif(HAVE_TMS, reason="torch_memory_saver is installed")
def test_torch_memory_saver_missing_is_a_clear_error() -> None:
    with pytest.raises(ImportError, match="memory-saver"):
        TorchMemorySaverBackend()


@pytest.mark.gpu
def test_pinned_buffers_exist_before_the_first_sleep_and_serve_host_copies() -> None:
    import torch

    from ppo_lifecycle.memory import PinnedHostBackend

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for p in model.parameters():  # AdamW's state made before tracking, as ppo-trainer's setup does
        optimizer.state[p] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    backend = PinnedHostBackend()
    backend.track("weights", lambda: [p.data for p in model.parameters()])
    backend.track("optimizer", lambda: [v for s in optimizer.state.values() for v in s.values() if v.is_cuda])
    tracked = 3 * sum(p.numel() * 4 for p in model.parameters())
    assert backend.pinned_bytes == tracked  # every buffer at setup
    weight = model[0].weight
    view = weight[3:7].t()  # a view of the same storage (made while resident), asked for with it
    expected = weight.detach().cpu()
    stats = backend.release()
    assert stats.bytes == tracked
    assert backend.pinned_bytes == tracked  # the first sleep allocated nothing
    copy, view_copy = backend.host_copies([weight, view])
    assert copy.device.type == "cpu"
    assert torch.equal(copy, expected)
    assert torch.equal(view_copy, expected[3:7].t())
    assert copy.untyped_storage().nbytes() == weight.numel() * 4  # its own storage, not the slab
    assert view_copy.untyped_storage().data_ptr() == copy.untyped_storage().data_ptr()  # one storage
    backend.restore()
    assert torch.equal(weight.detach().cpu(), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TMS, reason="torch_memory_saver is not installed")
def test_torch_memory_saver_pinned_backup_serves_host_copies() -> None:
    import torch

    backend = TorchMemorySaverBackend(backup="pinned")
    assert backend.keeps_host_copies
    with backend.region("weights"):
        weight = torch.randn(1024, 1024, device="cuda")
    with backend.region("optimizer"):
        moment = torch.randn(1024, 1024, device="cuda")
    backend.track("weights", lambda: [weight])
    backend.track("optimizer", lambda: [moment])
    view = weight[10:20].t()  # made while resident: a released tensor has no bytes to slice
    expected = weight.detach().cpu()
    backend.release(["weights"])
    copy, view_copy = backend.host_copies([weight, view])
    assert copy.device.type == "cpu"
    assert torch.equal(copy, expected)
    assert torch.equal(view_copy, expected[10:20].t())
    assert view_copy.untyped_storage().data_ptr() == copy.untyped_storage().data_ptr()  # one storage
    with pytest.raises(ValueError, match="its tag is resident; release its tag first"):
        backend.host_copies([moment])
    backend.restore()
    assert torch.equal(weight.detach().cpu(), expected)
