"""A colocated update of an engine of TP 2 over CUDA IPC, on ONE GPU: two trainer-rank processes (planned
on "gpu-a" and "gpu-b", both on cuda:0) and an SGLang stand-in of TP 2 (0.5.23's rules) whose two TP ranks
are processes on cuda:0 too. Rank 0 posts one ``flattened_bucket`` request per bucket with one entry per
TP rank; rank 1 feeds TP rank 1's entry from its own buffers (``ppo_weight_sync.ipc.tp``).

Weights are zeros (bf16, Llama-shaped, ``bench_update.spec_for``): every process allocates them on the GPU
at once, and the bytes moved are the same as for any values. Per size: median of ``--reps`` after a
warm-up, of rank 0's whole ``update()`` (pause, flush, buckets, continue), its transfer alone, and rank 1's
feed (from its update's start until TP rank 1 copied its last bucket out).

    python benchmarks/bench_ipc_tp.py --sizes-gb 4
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_update import GB, spec_for

from ppo_weight_sync import HttpEngineEndpoint
from ppo_weight_sync.testing.http_engine import start_process
from ppo_weight_sync.testing.ipc_ranks import EngineInfo, RankProcesses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[4.0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args()
    print(
        "| size GB | TP | bucket MiB | rank 0 update | rank 0 transfer | GB/s (update) | rank 1 feed "
        "| buckets |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for gb in args.sizes_gb:
        spec = spec_for(gb)
        nbytes = sum(2 * math.prod(shape) for _, shape in spec.values())
        proc, url = start_process(
            spec,
            seed=None,
            device="cuda:0",
            timeout_s=300,
            sglang_version="0.5.23",
            tp_size=2,
            tp_one_device=True,
        )
        try:
            ep = HttpEngineEndpoint.for_sglang(url, name="tp2", timeout_s=args.timeout_s)
            ranks = RankProcesses(
                ["gpu-a", "gpu-b"],
                [["gpu-a", "gpu-b"]],
                [EngineInfo(url, "tp2", 2, ep.load_formats, sglang=True)],
                spec,
                bucket_bytes=None,
                timeout_s=args.timeout_s,
            )
            try:
                ranks.ok("update", None, "warm-up", timeout_s=300)
                updates, transfers, feeds, buckets = [], [], [], 0.0
                for rep in range(args.reps):
                    t0 = time.perf_counter()
                    replies = ranks.call("update", None, f"r{rep}", timeout_s=300)
                    wall = time.perf_counter() - t0
                    for r in replies:
                        if not r.ok:
                            raise RuntimeError(f"rank {r.rank}: {r.error_type}: {r.value}")
                    lead, feeder = (r.value for r in replies)
                    updates.append(replies[0].seconds)
                    transfers.append(lead["weight_sync/seconds"])
                    feeds.append(feeder["weight_sync/ipc_seconds"])
                    buckets = lead["weight_sync/ipc_buckets"]
                    print(f"  rep {rep}: wall {wall * 1e3:.1f} ms", file=sys.stderr, flush=True)
                ranks.ok("disconnect")
            finally:
                ranks.close()
        finally:
            proc.kill()
            proc.wait()
        update, transfer, feed = (statistics.median(x) for x in (updates, transfers, feeds))
        bucket_mib = round(nbytes / buckets / (1 << 20)) if buckets else 0
        print(
            f"| {nbytes / GB:.2f} | 2 | ~{bucket_mib} (auto) | {update * 1e3:.1f} ms "
            f"| {transfer * 1e3:.1f} ms | {nbytes / update / GB:.0f} | {feed * 1e3:.1f} ms | {buckets:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
