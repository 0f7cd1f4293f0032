"""CUDA paths: pinned staging on both sides, and a handoff from an actor on GPU 0 to one on GPU 1.

Runs under pytest (``-m gpu``) or alone (``python tests/test_gpu.py``) where pytest is missing.
"""

from __future__ import annotations

import sys

import ray
import torch

from ppo_value_transport import Box, pack, pack_fields, unpack, unpack_fields

try:
    import pytest
except ImportError:  # standalone run on a machine without pytest
    pytest = None  # type: ignore[assignment]

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]


def _make(dtype: torch.dtype, n: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool().to(device)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype).to(device)
    return torch.randint(0, 100, (n,), generator=g).to(dtype).to(device)


def check_cuda_round_trip_every_dtype() -> None:
    for i, dtype in enumerate(DTYPES):
        xs = [_make(dtype, n, i * 7 + n, "cuda") for n in (5, 0, 4099)]
        box = pack(xs)
        on_gpu = unpack(box, device="cuda")
        assert all(y.is_cuda and y.dtype == dtype for y in on_gpu), dtype
        assert all(torch.equal(x, y) for x, y in zip(xs, on_gpu, strict=True)), dtype
        on_cpu = unpack(box)
        assert all(torch.equal(x.cpu(), y) for x, y in zip(xs, on_cpu, strict=True)), dtype
    fields = unpack_fields(
        pack_fields({"ids": [torch.arange(3, device="cuda")], "v": [torch.ones(2, device="cuda")]}),
        device="cuda",
    )
    assert fields["ids"][0].tolist() == [0, 1, 2]
    assert fields["v"][0].is_cuda


def _bits_sum(t: torch.Tensor) -> int:
    """An exact checksum of a bfloat16 tensor's bits (a float sum could differ by reduction order)."""
    return int(t.view(torch.int16).long().sum().item())


@ray.remote(num_gpus=1, num_cpus=0)
class _Critic:
    def values(self, lengths: list[int]) -> tuple[Box, list[int]]:
        vs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in lengths]
        return pack(vs), [_bits_sum(v) for v in vs]

    def gpu(self) -> str:
        return torch.cuda.get_device_name() + str(ray.get_gpu_ids())


@ray.remote(num_gpus=1, num_cpus=0)
class _Actor:
    def receive(self, box: Box) -> tuple[list[str], list[int]]:
        got = unpack(box, device="cuda")
        torch.cuda.synchronize()
        return [str(t.device) for t in got], [_bits_sum(t) for t in got]

    def gpu(self) -> str:
        return torch.cuda.get_device_name() + str(ray.get_gpu_ids())


def check_gpu_to_gpu_handoff() -> None:
    critic, actor = _Critic.remote(), _Actor.remote()
    try:
        critic_gpu, actor_gpu = ray.get([critic.gpu.remote(), actor.gpu.remote()], timeout=120)
        assert critic_gpu != actor_gpu, "critic and actor must sit on different GPUs"
        lengths = [0, 1, 513, 4096]
        box, sent = ray.get(critic.values.remote(lengths), timeout=120)
        devices, received = ray.get(actor.receive.remote(box), timeout=120)
        assert all(d.startswith("cuda") for d in devices)
        assert received == sent
    finally:
        ray.kill(critic)
        ray.kill(actor)


if pytest is not None:

    @pytest.mark.gpu
    @pytest.mark.usefixtures("ray_session")
    def test_cuda_round_trip_every_dtype() -> None:
        check_cuda_round_trip_every_dtype()

    @pytest.mark.gpu
    @pytest.mark.usefixtures("ray_session")
    def test_gpu_to_gpu_handoff() -> None:
        if torch.cuda.device_count() < 2:
            pytest.skip("needs 2 GPUs")
        check_gpu_to_gpu_handoff()


if __name__ == "__main__":
    ray.init(num_cpus=4, num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False)
    check_cuda_round_trip_every_dtype()
    print("cuda round trip, every dtype: ok")
    if torch.cuda.device_count() >= 2:
        check_gpu_to_gpu_handoff()
        print("GPU 0 -> GPU 1 handoff through the object store: ok")
    ray.shutdown()
    sys.exit(0)
