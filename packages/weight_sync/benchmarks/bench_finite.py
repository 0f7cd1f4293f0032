"""What the sender's non-finite scan (``non_finite_names``) costs per update, against the bytes scanned.

    python packages/weight_sync/benchmarks/bench_finite.py [--device cpu|cuda] [--repeats 20]

Shapes: the CPU default run's tiny model (float32) and Llama-like models in bfloat16.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from ppo_weight_sync import non_finite_names
from ppo_weight_sync.finite import fused_abs_sums
from ppo_weight_sync.testing import llama_like_spec, make_weights

SHAPES = {
    "cpu default (tiny, fp32)": llama_like_spec(
        layers=2, hidden=64, intermediate=128, vocab=16, dtype="float32", kv_heads_ratio=1
    ),
    "llama-like 24 layers, hidden 1024 (bf16)": llama_like_spec(
        layers=24, hidden=1024, intermediate=2816, vocab=32000
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| weights | tensors | MB | scan | ms per scan (median) | GB/s |")
    print("|---|---|---|---|---|---|")
    for label, spec in SHAPES.items():
        items = [(n, t.to(device)) for n, t in make_weights(spec, 0).items()]
        nbytes = sum(t.numel() * t.element_size() for _, t in items)
        assert non_finite_names(items) == []  # warm-up, and the scan finds nothing in finite weights
        for scan, run in _scans(items).items():
            median = _median_seconds(run, device, args.repeats)
            rate = nbytes / median / 1e9
            cells = [label, len(items), f"{nbytes / 1e6:.1f}", scan, f"{median * 1e3:.2f}", f"{rate:.1f}"]
            print("| " + " | ".join(str(c) for c in cells) + " |")


def _scans(items: list[tuple[str, torch.Tensor]]) -> dict[str, Callable[[], object]]:
    """The update's scan and its alternatives; each ends in a read-back, so it synchronises itself."""
    tensors = [t for _, t in items]
    return {
        "non_finite_names (what update runs)": lambda: non_finite_names(items),
        "one sum per tensor": lambda: torch.stack([t.sum(dtype=torch.float32) for t in tensors]).tolist(),
        "fused L1 norms (_foreach_norm)": lambda: torch.stack(fused_abs_sums(tensors)).float().tolist(),
        "isfinite().all() per tensor": lambda: [bool(torch.isfinite(t).all()) for t in tensors],
    }


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
