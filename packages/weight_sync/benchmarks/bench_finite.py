"""What the sender's non-finite scan (``non_finite_names``) costs per update, against the bytes scanned.

    python packages/weight_sync/benchmarks/bench_finite.py [--device cpu|cuda] [--repeats 20] \\
        [--sizes-gb 1 4 16]

Shapes: the CPU default run's tiny model (float32), a Llama-like model in bfloat16, and (``--sizes-gb``)
the Llama-shaped bf16 models of ``bench_update.py`` / ``bench_ipc.py`` at those sizes, so a row here is
the scan inside a row there. Each way of scanning is timed against the read limit of the same bytes: one
float32-accumulated sum over a single contiguous buffer of that size (what no scan of separate tensors
can beat), so "vs read limit" says how much of the scan is launches and tails rather than bytes.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_update import random_weights, spec_for

from ppo_weight_sync import non_finite_names
from ppo_weight_sync.finite import SCAN_SPLIT_BYTES, SCAN_STREAMS, cuda_sums, fused_abs_sums
from ppo_weight_sync.testing import llama_like_spec, make_weights

SHAPES = {
    "cpu default (tiny, fp32)": llama_like_spec(
        layers=2, hidden=64, intermediate=128, vocab=16, dtype="float32", kv_heads_ratio=1
    ),
    "llama-like 24 layers, hidden 1024 (bf16)": llama_like_spec(
        layers=24, hidden=1024, intermediate=2816, vocab=32000
    ),
}
# Per-tensor isfinite allocates a mask per tensor and is far slower: timed only up to this size.
ISFINITE_MAX_BYTES = 2 << 30


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sizes-gb", type=float, nargs="*", default=[], help="also bench_update's models")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {device} ({name}), torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| weights | tensors | MB | scan | ms per scan (median) | GB/s | vs read limit |")
    print("|---|---|---|---|---|---|---|")
    models = [(label, lambda spec=spec: _on(device, spec)) for label, spec in SHAPES.items()]
    models += [
        (f"bench_update {gb:g} GB (bf16)", lambda gb=gb: random_weights(spec_for(gb), device))
        for gb in args.sizes_gb
    ]
    for label, build in models:
        items = build()
        nbytes = sum(t.numel() * t.element_size() for _, t in items)
        assert non_finite_names(items) == []  # warm-up, and the scan finds nothing in finite weights
        limit = _read_limit(nbytes, device)
        limit_s = _median_seconds(limit, device, args.repeats)
        ways = [("read limit: one sum over one buffer of these bytes", limit), *_scans(items, nbytes)]
        for scan, run in ways:
            median = limit_s if run is limit else _median_seconds(run, device, args.repeats)
            rate = nbytes / median / 1e9
            cells = [label, len(items), f"{nbytes / 1e6:.1f}", scan, f"{median * 1e3:.2f}", f"{rate:.1f}"]
            cells.append(f"{limit_s / median:.0%}")
            print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
        del items, limit
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _on(device: torch.device, spec: dict[str, tuple[str, list[int]]]) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.to(device)) for n, t in make_weights(spec, 0).items()]


def _read_limit(nbytes: int, device: torch.device) -> Callable[[], object]:
    """One bf16 buffer of ``nbytes``, summed as the scan sums bf16 on this device (in float32 on a GPU; as
    it is on the CPU, whose kernel accumulates in float32 anyway) and read back: the scan's floor."""
    buffer = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    if device.type == "cpu":
        return lambda: buffer.sum().item()
    return lambda: buffer.sum(dtype=torch.float32).item()


def _scans(items: list[tuple[str, torch.Tensor]], nbytes: int) -> list[tuple[str, Callable[[], object]]]:
    """The update's scan and its alternatives; each ends in a read-back, so it synchronises itself."""
    tensors = [t for _, t in items]
    floats = [t.float() if t.element_size() == 1 else t for t in tensors]
    f32 = torch.float32
    ways: list[tuple[str, Callable[[], object]]] = [
        (
            f"non_finite_names (what update runs: split at {SCAN_SPLIT_BYTES >> 20} MiB, "
            f"{SCAN_STREAMS} streams)",
            lambda: non_finite_names(items),
        ),
        ("one float32 sum per tensor", lambda: torch.stack([t.sum(dtype=f32) for t in floats]).tolist()),
        (
            "one L1 norm per tensor (vector_norm)",
            lambda: torch.stack([torch.linalg.vector_norm(t, 1, dtype=f32) for t in floats]).tolist(),
        ),
        ("fused L1 norms (_foreach_norm)", lambda: torch.stack(fused_abs_sums(floats)).float().tolist()),
    ]
    if tensors[0].is_cuda:  # the split scan's settings around the defaults non_finite_names uses
        for streams in (2, 4, 8):
            label = f"fused L1 norms over {streams} streams"
            ways.append((label, functools.partial(_fused_over_streams, floats, streams)))
        for split_mib, streams in [(0, 1), (0, 4), (4, 4), (16, 1), (16, 2), (16, 8), (64, 4)]:
            label = f"split scan: own sums from {split_mib} MiB, {streams} stream(s)"
            ways.append((label, functools.partial(_split_scan, floats, split_mib << 20, streams)))
    if nbytes <= ISFINITE_MAX_BYTES:
        ways.append(("isfinite().all() per tensor", lambda: [bool(torch.isfinite(t).all()) for t in tensors]))
    return ways


_STREAMS: dict[int, list[torch.cuda.Stream]] = {}


def _fused_over_streams(tensors: list[torch.Tensor], streams: int) -> object:
    """The fused norm, the tensors dealt round-robin over ``streams`` side streams (one multi-tensor launch
    per stream instead of one reduction per large tensor: fewer host launches)."""
    current = torch.cuda.current_stream()
    sides = _STREAMS.setdefault(streams, [torch.cuda.Stream() for _ in range(streams)])
    parts = []
    for n, side in enumerate(sides):
        side.wait_stream(current)
        with torch.cuda.stream(side):
            norms = fused_abs_sums(tensors[n::streams])
        for norm in norms:
            norm.record_stream(current)
        parts.append(norms)
    for side in sides:
        current.wait_stream(side)
    return torch.stack([x for part in parts for x in part]).tolist()


def _split_scan(tensors: list[torch.Tensor], split_bytes: int, streams: int) -> object:
    return cuda_sums(tensors, torch.float32, split_bytes=split_bytes, streams=streams).tolist()


def _median_seconds(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()
