"""Handoff time of critic values: tensors in a critic actor -> tensors in an actor actor.

Three ways, same run, same bytes, each value tensor float32 [tokens], ``seqs`` of them:

* ``box``  - this package: ``pack`` in the critic, the Box travels through the driver, ``unpack``
             in the actor;
* ``list`` - a Python list of CPU tensors through ``ray.put`` / ``ray.get`` (what miles does);
* ``raw``  - one prebuilt flat buffer of the same bytes through ``ray.put`` / ``ray.get``: the
             floor (no gathering, no splitting).

The clock starts in the critic before anything is packed and stops in the actor once its tensors
exist (on the GPU, after a synchronize), so the driver hop is included for all three. Both clocks
are ``time.time()`` of one node. Median of ``--repeats`` after two warm-ups, the three ways interleaved.

    python bench_handoff.py --grid small            # CPU, the cells a small machine can hold
    python bench_handoff.py --grid full --device cuda   # critic on GPU 0, actor on GPU 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np
import ray
import torch

from ppo_value_transport import Box, pack, unpack

MODES = ("box", "list", "raw")
WARMUP = 2
GRIDS = {
    "tiny": ([256, 2048], [512]),
    "small": ([256, 2048], [512, 4096]),
    "full": ([256, 1024, 2048, 4096], [512, 2048, 4096, 8192]),
}


@ray.remote(num_cpus=0)
class Critic:
    def __init__(self, device: str) -> None:
        torch.set_num_threads(1)
        self.device = device
        self.values: list[torch.Tensor] = []
        self.flat: torch.Tensor | None = None

    def make(self, seqs: int, tokens: int) -> int:
        self.values = []
        self.flat = None
        g = torch.Generator().manual_seed(seqs * 10_000 + tokens)
        self.flat = torch.randn(seqs * tokens, generator=g).to(self.device)
        self.values = [v.clone() for v in self.flat.split(tokens)]
        if self.device != "cpu":
            torch.cuda.synchronize()
        return sum(v.numel() for v in self.values)

    def send(self, mode: str) -> tuple[float, Any]:
        start = time.time()
        if mode == "box":
            return start, pack(self.values)
        if mode == "list":
            # What miles does: CPU tensors, one list, one put (the ref goes nested so the driver
            # does not fetch it on the way).
            return start, [ray.put([v.cpu() for v in self.values])]
        assert self.flat is not None
        return start, [ray.put(self.flat.cpu().numpy())]


@ray.remote(num_cpus=0)
class Actor:
    def __init__(self, device: str) -> None:
        torch.set_num_threads(1)
        self.device = device

    def receive(self, mode: str, payload: Any) -> tuple[float, int, float]:
        if mode == "box":
            assert isinstance(payload, Box)
            got = unpack(payload, device=self.device)
        elif mode == "list":
            got = [t.to(self.device, non_blocking=True) for t in ray.get(payload[0])]
        else:
            array = ray.get(payload[0])
            got = [torch.from_numpy(array).to(self.device)]
        if self.device != "cpu":
            torch.cuda.synchronize()
        end = time.time()
        # outside the clock: a checksum so that a transport that loses data shows
        checksum = float(sum(t.double().sum().item() for t in got)) if got else 0.0
        return end, sum(t.numel() for t in got), checksum


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    seqs_list, tokens_list = GRIDS[args.grid]
    if args.seqs:
        seqs_list = args.seqs
    if args.tokens:
        tokens_list = args.tokens
    cells = [(s, t) for s in seqs_list for t in tokens_list if s * t * 4 <= args.max_mib * 2**20]
    largest = max(s * t * 4 for s, t in cells)
    gpus = 2 if args.device == "cuda" else 0
    ray.init(
        num_cpus=4,
        num_gpus=gpus,
        object_store_memory=max(512 * 2**20, 6 * largest),
        include_dashboard=False,
        log_to_driver=False,
    )
    dev = "cuda" if args.device == "cuda" else "cpu"
    critic = Critic.options(num_gpus=1 if gpus else 0).remote(dev)
    actor = Actor.options(num_gpus=1 if gpus else 0).remote(dev)
    rows = []
    began = time.monotonic()
    for seqs, tokens in cells:
        if time.monotonic() - began > args.budget_s:
            print(f"  budget of {args.budget_s:g} s spent: skipping {seqs}x{tokens} and larger", flush=True)
            break
        numel = ray.get(critic.make.remote(seqs, tokens))
        row: dict[str, Any] = {"seqs": seqs, "tokens": tokens, "mib": numel * 4 / 2**20}
        sums: dict[str, float] = {}
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        # Modes interleaved within each repeat, so that a busy moment of the machine hits all three.
        for rep in range(WARMUP + args.repeats):
            for mode in MODES:
                start, payload = ray.get(critic.send.remote(mode))
                end, got, checksum = ray.get(actor.receive.remote(mode, payload))
                del payload
                if got != numel:
                    raise RuntimeError(f"{mode}: received {got} values, sent {numel}")
                sums[mode] = checksum
                if rep >= WARMUP:
                    times[mode].append(end - start)
        for mode in MODES:
            row[mode] = statistics.median(times[mode]) * 1e3
        if not np.allclose(sums["box"], [sums["list"], sums["raw"]], rtol=1e-9, atol=1e-3):
            raise RuntimeError(f"checksums differ: {sums}")
        rows.append(row)
        print(
            f"  {seqs}x{tokens}: box {row['box']:.1f} ms, list {row['list']:.1f} ms, raw {row['raw']:.1f} ms",
            flush=True,
        )
    ray.shutdown()
    return rows


def table(rows: list[dict[str, Any]], device: str) -> str:
    lines = [
        f"| seqs x tokens ({device}) | MiB | box ms | list ms | raw ms | list / box | box / raw |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seqs']} x {r['tokens']} | {r['mib']:.1f} | {r['box']:.1f} | {r['list']:.1f} | "
            f"{r['raw']:.1f} | {r['list'] / r['box']:.1f}x | {r['box'] / r['raw']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--grid", choices=sorted(GRIDS), default="small")
    parser.add_argument("--seqs", type=int, nargs="*", help="override the grid's sequence counts")
    parser.add_argument("--tokens", type=int, nargs="*", help="override the grid's sequence lengths")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--max-mib",
        type=float,
        default=float(os.environ.get("BENCH_MAX_MIB", 1024)),
        help="skip cells whose payload is larger (memory of a small machine)",
    )
    parser.add_argument(
        "--budget-s", type=float, default=float("inf"), help="start no new cell after this many seconds"
    )
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("--device cuda needs 2 GPUs (critic on one, actor on the other)")
    print(f"handoff benchmark: device={args.device} grid={args.grid} repeats={args.repeats}", flush=True)
    rows = run(args)
    print(table(rows, args.device), flush=True)


if __name__ == "__main__":
    main()
