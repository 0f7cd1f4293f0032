"""Which tensors hold a NaN or an infinity: checked before weights leave the trainer.

A NaN or an infinity in a tensor makes its floating-point sum NaN or infinite (NaN and inf propagate
through addition; inf + -inf is NaN), so a finite sum proves every element finite. The scan therefore
takes one sum per floating tensor (accumulated in float32, or float64 for float64 tensors), stacks
them per device and reads them back with a single synchronisation; only the tensors whose sum is not
finite (a real NaN/inf, or finite values whose sum overflows) get the exact ``isfinite().all()``.
A sum reads the tensor once without allocating a mask as large as it: several times faster than
``isfinite(t).all()`` on CPU (``benchmarks/bench_finite.py``). On CUDA the sums of a device's tensors
are one fused multi-tensor L1 norm (``torch._foreach_norm``, what ``clip_grad_norm_`` uses): a few
kernel launches for the whole model instead of one reduction per tensor (hundreds of launches for a
model of a few hundred tensors, each small one launch-bound), accumulated in float32 like the sums; an
absolute value keeps NaN and infinities, so the same proof holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["non_finite_names"]


def _comparable(tensor: torch.Tensor) -> torch.Tensor:
    """Real, and at least 16 bits wide (float8 types lack reduction kernels; float16 holds them exactly)."""
    real = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    return real if real.element_size() > 1 else real.to(torch.float16)


def _sum(tensor: torch.Tensor) -> torch.Tensor:
    wide = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    return tensor.sum(dtype=wide)


def fused_abs_sums(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One L1 norm per tensor (of one device), fused into multi-tensor kernels: finite exactly when the
    tensor is (unless finite values overflow the float32 accumulator)."""
    return list(torch._foreach_norm(list(tensors), 1))


def _totals(reals: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    if device.type == "cuda":
        return fused_abs_sums(reals)
    return [_sum(real) for real in reals]  # CPU: a plain sum is faster than abs + sum


def non_finite_names(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the floating-point tensors of ``named_tensors`` holding a NaN or an infinity."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named_tensors:
        if tensor.is_floating_point() or tensor.is_complex():
            by_device.setdefault(tensor.device, []).append((name, _comparable(tensor.detach())))
    bad: list[str] = []
    for device, found in by_device.items():
        totals = _totals([real for _, real in found], device)
        finite = torch.isfinite(torch.stack([t.to(torch.float64) for t in totals])).tolist()  # one sync
        bad += [
            name
            for (name, real), ok in zip(found, finite, strict=True)
            if not ok and not bool(torch.isfinite(real).all())  # an overflowing sum of finite values is fine
        ]
    return bad
