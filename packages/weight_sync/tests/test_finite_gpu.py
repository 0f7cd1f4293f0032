"""The non-finite scan on a GPU: small tensors through the fused norm, large ones through their own sums on
side streams; both must see the weights as the caller's queued work leaves them, and name bad tensors
in the caller's order."""

from __future__ import annotations

import pytest
import torch

from ppo_weight_sync import non_finite_names
from ppo_weight_sync.finite import SCAN_SPLIT_BYTES, cuda_sums, start_finite_check

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    # "large": at least SCAN_SPLIT_BYTES (64 MiB) in bf16, so the default scan gives each its own sum;
    # more of them than side streams
    shapes = {"small_a": (64,), "large_a": (8192, 4096), "small_b": (3, 5), "large_b": (8192, 4097)}
    shapes |= {f"large_{i}": (8192, 4096 + i) for i in range(6)}
    return {
        name: torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
        for name, shape in shapes.items()
    }


def test_the_tensors_cover_both_ways() -> None:
    sizes = [t.nbytes for t in _tensors().values()]
    assert sum(n < SCAN_SPLIT_BYTES for n in sizes) == 2
    assert sum(n >= SCAN_SPLIT_BYTES for n in sizes) == 8


@pytest.mark.parametrize("streams", [1, 4])
def test_split_sums_equal_per_tensor_sums_in_the_callers_order(streams: int) -> None:
    tensors = list(_tensors().values())
    sums = cuda_sums(tensors, torch.float32, split_bytes=SCAN_SPLIT_BYTES, streams=streams)
    assert sums.shape == (len(tensors),)
    assert sums.dtype == torch.float32
    for i, t in enumerate(tensors):
        own = t.float().abs().sum() if t.nbytes < SCAN_SPLIT_BYTES else t.sum(dtype=torch.float32)
        assert float(sums[i]) == pytest.approx(float(own), rel=1e-3, abs=1e-2), i


def test_the_scan_sees_work_queued_just_before_it_and_names_bad_tensors_in_order() -> None:
    weights = _tensors()
    torch.cuda.synchronize()
    # Queue a long kernel, then the poisoning writes, on the caller's stream with no host sync: a scan on
    # side streams that did not wait for this stream would read the tensors before the NaN/inf land.
    busy = torch.randn(8192, 8192, device="cuda")
    for _ in range(20):
        busy = busy @ busy.T / 8192
    weights["large_3"].view(-1)[12345] = float("nan")
    weights["small_b"][2, 4] = float("inf")
    weights["large_a"].view(-1)[-1] = float("-inf")
    check = start_finite_check(list(weights.items()))
    assert check.result(timeout_s=60) == ["large_a", "small_b", "large_3"]
    torch.cuda.synchronize()
    weights["large_3"].view(-1)[12345] = 0.0
    weights["small_b"][2, 4] = 0.0
    weights["large_a"].view(-1)[-1] = 0.0
    assert non_finite_names(list(weights.items())) == []
