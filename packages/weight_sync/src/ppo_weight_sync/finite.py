"""Which tensors hold a NaN or an infinity: checked before weights leave the trainer.

A NaN or an infinity in a tensor makes its floating-point sum NaN or infinite (NaN and inf propagate
through addition; inf + -inf is NaN), so a finite sum proves every element finite. The scan therefore
takes one sum per floating tensor (accumulated in float32, or float64 for float64 tensors; see
``_sum``), stacks them per device and result type and reads them back once; only the tensors whose sum is not
finite (a real NaN/inf, or finite values whose sum overflows) get the exact ``isfinite().all()``.
A sum reads the tensor once without allocating a mask as large as it: several times faster than
``isfinite(t).all()`` on CPU (``benchmarks/bench_finite.py``).

The scan is split in two so that a caller can overlap it with work of its own: :func:`start_finite_check`
queues the sums and their copy to the host (on a GPU the host does not wait for them), and
:meth:`FiniteCheck.result` waits for them, bounded, and names the bad tensors. The sender starts it just
before its pause is sent (:mod:`ppo_weight_sync.sender`). On a GPU the host's launches bound the scan of
hundreds of small tensors, and a lone reduction's tail leaves the GPU half idle on a large one: there the
small tensors of a device (under :data:`SCAN_SPLIT_BYTES`, 64 MiB) are summed by one fused multi-tensor
L1 norm (``torch._foreach_norm``, what ``clip_grad_norm_`` uses; an absolute value keeps NaN and
infinities, so the same proof holds), a few launches for all of them, and each large tensor by a sum of
its own, spread round-robin over :data:`SCAN_STREAMS` side streams so that the reductions overlap each
other and the fused norm (``benchmarks/bench_finite.py``: on an H200 the fused norm alone reads at about
half the device's rate, this split at 80-85% of it on 4-16 GB models). On the CPU each tensor gets one
plain sum (no per-tensor cast, no ``detach``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ppo_weight_sync.device_sync import on_device
from ppo_weight_sync.waiting import wait_until

__all__ = [
    "SCAN_SPLIT_BYTES",
    "SCAN_STREAMS",
    "FiniteCheck",
    "cuda_sums",
    "fused_abs_sums",
    "non_finite_names",
    "start_finite_check",
]

_POLL_S = 0.00002  # the verdict is awaited on the update's path: poll finely (a sleep is ~60 us more)
# Where a tensor's own reduction beats the fused multi-tensor norm, and how many side streams carry them
# (chosen from benchmarks/bench_finite.py on an H200; see docs/benchmarks/weight_sync.md).
SCAN_SPLIT_BYTES = 64 << 20
SCAN_STREAMS = 4
_side_streams: dict[tuple[int, int], list[torch.cuda.Stream]] = {}
# The floating-point dtypes summed as they are (no complex view, no widening): one set lookup decides the
# common case, since host time per tensor matters (hundreds of tensors, a scan of well under a millisecond
# on a GPU).
_SUMMED_AS_IS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _comparable(tensor: torch.Tensor) -> torch.Tensor:
    """Real, and at least 16 bits wide (float8 types lack reduction kernels; float16 holds them exactly)."""
    if tensor.dtype in _SUMMED_AS_IS:
        return tensor
    real = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    return real if real.element_size() > 1 else real.to(torch.float16)


def _accumulator(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What a tensor's sum is accumulated and returned in: float64 for float64, else float32; a bfloat16
    tensor on the CPU is summed as it is: the CPU kernel accumulates it in float32 anyway, while
    ``dtype=float32`` first copies the whole tensor to float32 (10x slower, measured); the result's range
    is float32's (bfloat16 has its exponent)."""
    if dtype == torch.float64:
        return torch.float64
    if dtype == torch.bfloat16 and device.type == "cpu":
        return torch.bfloat16
    return torch.float32


def fused_abs_sums(tensors: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """One L1 norm per tensor (all on one device), in ``dtype``, fused into multi-tensor kernels: finite
    exactly when the tensor is (unless finite values overflow the accumulator)."""
    return list(torch._foreach_norm(list(tensors), 1, dtype=dtype))


def cuda_sums(
    reals: Sequence[torch.Tensor],
    dtype: torch.dtype,
    *,
    split_bytes: int = SCAN_SPLIT_BYTES,
    streams: int = SCAN_STREAMS,
) -> torch.Tensor:
    """One CUDA device's tensors' sums in ``dtype``, stacked in their order, queued without a host wait.

    Tensors under ``split_bytes`` go through :func:`fused_abs_sums` together; each larger one gets its own
    sum on one of ``streams`` side streams (each side stream first waits for the caller's stream, which
    then waits for them all: the sums see the weights as the caller's queued work leaves them, and whatever
    the caller queues next sees the sums)."""
    device = reals[0].device
    current = torch.cuda.current_stream(device)
    pieces: list[torch.Tensor | None] = [None] * len(reals)
    large = [i for i, t in enumerate(reals) if t.nbytes >= split_bytes]
    sides = _streams(device, max(1, min(streams, len(large)))) if large else []
    # The side streams start before the fused norm is queued, so that the large sums run beside it.
    for side in sides:
        side.wait_stream(current)
    for n, i in enumerate(large):
        with torch.cuda.stream(sides[n % len(sides)]):
            total = reals[i].sum(dtype=dtype)
        total.record_stream(current)  # made on a side stream, read by the stack below
        pieces[i] = total
    small = [i for i, piece in enumerate(pieces) if piece is None]
    if small:
        for i, norm in zip(small, fused_abs_sums([reals[i] for i in small], dtype), strict=True):
            pieces[i] = norm
    for side in sides:
        current.wait_stream(side)
    return torch.stack([piece for piece in pieces if piece is not None])


def _streams(device: torch.device, count: int) -> list[torch.cuda.Stream]:
    """``count`` side streams of ``device``, made once per process and kept (streams are cheap to keep,
    not to make on every update)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, count)
    if key not in _side_streams:
        _side_streams[key] = [torch.cuda.Stream(device=index) for _ in range(count)]
    return _side_streams[key]


def _cpu_sums(reals: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The tensors' plain sums in ``dtype`` (bfloat16 summed in its own dtype, see _accumulator), stacked."""
    return torch.stack([real.sum() if real.dtype == dtype else real.sum(dtype=dtype) for real in reals])


@dataclass(frozen=True)
class _Sums:
    """The sums of one device's tensors of one accumulation type, on their way to the host."""

    device: torch.device
    order: list[int]  # each tensor's position in the caller's list (bad names come back in that order)
    names: list[str]
    reals: list[torch.Tensor]  # what was summed, for the exact check of a non-finite sum
    host: torch.Tensor  # the sums on the host (a pinned copy in flight on a GPU)
    done: torch.cuda.Event | None  # recorded after the copy (None on CPU: already there)


class FiniteCheck:
    """A non-finite scan in flight; :meth:`result` names the bad tensors."""

    def __init__(self, sums: list[_Sums]) -> None:
        self._sums = sums

    def result(self, timeout_s: float) -> list[str]:
        """The names of the floating-point tensors holding a NaN or an infinity, in the caller's order.
        Waits at most ``timeout_s`` for the GPU's sums (``TimeoutError`` naming the devices)."""
        deadline = time.monotonic() + timeout_s
        bad: list[tuple[int, str]] = []
        for sums in self._sums:
            if sums.done is not None:  # polled, never a blocking sync: the wait stays bounded
                wait_until(
                    sums.done.query,
                    max(deadline - time.monotonic(), 0.0),
                    _late_scan_message(sums, timeout_s),
                    poll_s=_POLL_S,
                )
            values = sums.host.tolist()
            for i, name, real, value in zip(sums.order, sums.names, sums.reals, values, strict=True):
                # An overflowing sum of finite values is fine: the exact check (rare) clears it.
                if not math.isfinite(value) and not bool(torch.isfinite(real).all()):
                    bad.append((i, name))
        return [name for _, name in sorted(bad)]


def _late_scan_message(sums: _Sums, timeout_s: float) -> Callable[[], str]:
    return lambda: (
        f"the non-finite scan of {len(sums.names)} tensor(s) on {sums.device} did not finish within "
        f"{timeout_s:g} s (is a kernel on that GPU stuck?)"
    )


def start_finite_check(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> FiniteCheck:
    """Queue the scan of ``named_tensors`` (see the module's text); the host waits for nothing on a GPU."""
    Group = tuple[list[int], list[str], list[torch.Tensor]]  # order, names, reals
    groups: dict[tuple[torch.device, torch.dtype], Group] = {}
    with torch.no_grad():  # no autograd record of the sums: no per-tensor detach needed
        for i, (name, tensor) in enumerate(named_tensors):
            if tensor.dtype not in _SUMMED_AS_IS and not (tensor.is_floating_point() or tensor.is_complex()):
                continue
            real = _comparable(tensor)
            device = real.device
            accumulator = _accumulator(real.dtype, device)
            group = groups.get((device, accumulator))
            if group is None:
                group = groups[(device, accumulator)] = ([], [], [])
            group[0].append(i)
            group[1].append(name)
            group[2].append(real)
        out: list[_Sums] = []
        for (device, dtype), (order, names, reals) in groups.items():
            if device.type != "cuda":
                out.append(_Sums(device, order, names, reals, _cpu_sums(reals, dtype), None))
                continue
            with on_device(device):
                stacked = cuda_sums(reals, dtype)  # one tensor, one copy to the host
                host = torch.empty(len(reals), dtype=stacked.dtype, pin_memory=True)
                host.copy_(stacked, non_blocking=True)
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(device))
            out.append(_Sums(device, order, names, reals, host, done))
    return FiniteCheck(out)


def non_finite_names(
    named_tensors: Sequence[tuple[str, torch.Tensor]], timeout_s: float = 300.0
) -> list[str]:
    """The names of the floating-point tensors of ``named_tensors`` holding a NaN or an infinity (waits for
    the scan, at most ``timeout_s``)."""
    return start_finite_check(named_tensors).result(timeout_s)
