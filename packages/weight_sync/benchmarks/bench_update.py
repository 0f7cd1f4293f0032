"""GB/s of a full weight update, trainer process -> engine process, against raw broadcasts.

Trainer: this process (GPU 0 with NCCL, or CPU with gloo). Engine: a second process running a
TensorEngine behind SGLang's HTTP routes (GPU 1 with NCCL). Weights are bf16, shaped like a Llama
model (embeddings, per-layer attention/MLP/norms, head) scaled to each target size. Modes, same run:

- ``stream``: this package's default with its own receiver (one call per update, flat 512 MiB buckets,
  bucket k+1 packed while k is on the wire);
- ``flattened_bucket``: one call and one flat buffer per bucket (SGLang's load_format of that name);
- ``per_tensor``: one call per bucket and one broadcast per tensor, the way slime drives SGLang;
- ``raw``: one pre-packed contiguous buffer of the same size, broadcast in ``--bucket-mb`` messages
  back to back, with no metadata, packing or loading (the upper bound).

``update GB/s`` counts the whole ``WeightSender.update`` (scan, pause, flush, transfer, continue);
``transfer GB/s`` only the transfer (metadata call, broadcasts, engine reply). Median of ``--reps`` after
a warm-up. Each row also says where the update's time went, in ms (the repetition of median wall time,
split by the sender's metrics, parts that never overlap): ``scan`` (the host's time in the non-finite
scan, beyond what the pause and flush in flight hide), ``control before`` (pause, flush, session, the
first bucket's packing), ``transfer``, ``control after`` (session end, continue) and ``other`` (argument
checks, the lock; the rest of the wall time). Each repetition prints the same split as it runs.

    python benchmarks/bench_update.py --backend nccl --sizes-gb 1 4 16      # 2 GPUs
    python benchmarks/bench_update.py --backend gloo --sizes-gb 0.0625 0.25  # CPU
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from ppo_weight_sync import HttpEngineEndpoint, WeightSender
from ppo_weight_sync.device_sync import on_device, wait_stream
from ppo_weight_sync.endpoints import RECEIVER_LOAD_FORMATS
from ppo_weight_sync.testing import TensorEngine, llama_like_spec
from ppo_weight_sync.testing.http_engine import EngineHTTPServer, wait_until_ready

GB = 1e9
# (hidden, intermediate, vocab): from small to Llama-3-8B.
CONFIGS = [
    (512, 1408, 8000),
    (1024, 2816, 32000),
    (2048, 8192, 32000),
    (4096, 14336, 32000),
    (4096, 14336, 128256),
]


def spec_for(target_gb: float) -> dict[str, tuple[str, list[int]]]:
    """A bf16 Llama-shaped spec of about ``target_gb`` GB: the largest config whose embeddings and head
    stay under 40% of the target, with as many layers as fill the rest."""
    target = target_gb * GB
    chosen = CONFIGS[0]
    for hidden, inter, vocab in CONFIGS:
        if 2 * vocab * hidden * 2 <= 0.4 * target:
            chosen = (hidden, inter, vocab)
    hidden, inter, vocab = chosen
    edges = 2 * vocab * hidden * 2
    per_layer = 2 * (2 * hidden * hidden + 2 * (hidden // 4) * hidden + 3 * inter * hidden + 2 * hidden)
    layers = max(1, round((target - edges) / per_layer))
    return llama_like_spec(layers=layers, hidden=hidden, intermediate=inter, vocab=vocab, dtype="bfloat16")


# ------------------------------------------------------------------------------ engine process


def engine_main(device: str, timeout_s: float) -> None:
    torch.set_num_threads(2)
    engine = TensorEngine({}, seed=None, device=device, timeout_s=timeout_s)
    raw_buffers: dict[int, torch.Tensor] = {}

    def set_spec(body: dict[str, Any]) -> dict[str, Any]:
        raw_buffers.clear()
        engine.set_spec(body["spec"], seed=None)
        return {"success": True, "message": f"{len(body['spec'])} tensors"}

    def raw(body: dict[str, Any]) -> dict[str, Any]:
        group = engine.receiver.group(body["group_name"])
        if group is None:
            return {"success": False, "message": "no such group"}
        nbytes, chunk = int(body["bytes"]), int(body["chunk"])
        buf = raw_buffers.get(nbytes)
        if buf is None:
            buf = raw_buffers.setdefault(nbytes, torch.empty(nbytes, dtype=torch.uint8, device=engine.device))
        with on_device(engine.device):
            works = [group.broadcast(buf[o : o + chunk]) for o in range(0, nbytes, chunk)]
            for w in works:
                w.wait()
            # Bounded, unlike torch.cuda.synchronize(): a broadcast that never completes fails the call.
            wait_stream(engine.device, timeout_s, "raw receive")
        return {"success": True, "message": "received"}

    def fingerprint(body: dict[str, Any]) -> dict[str, Any]:
        from ppo_weight_sync.testing.ipc_peer import gpu_fingerprint

        with on_device(engine.device):
            wait_stream(engine.device, timeout_s, "fingerprint")
            return gpu_fingerprint(engine.weights.items())

    def mappings(body: dict[str, Any]) -> dict[str, Any]:
        return {"ipc_mappings": engine.receiver.ipc_mappings}

    routes = {
        "/bench_set_spec": set_spec,
        "/bench_raw": raw,
        "/bench_fingerprint": fingerprint,
        "/bench_mappings": mappings,
    }
    server = EngineHTTPServer(engine, "127.0.0.1", 0, routes)
    print(f"READY {server.url}", flush=True)
    server.serve_forever()


def start_engine(device: str, env: dict[str, str], timeout_s: float) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "engine", "--device", device]
    cmd += ["--timeout-s", str(timeout_s)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
    return proc, wait_until_ready(proc, 120.0, lambda line: say(f"[engine] {line}"))


T0 = time.monotonic()


def say(message: str) -> None:
    """Progress on stdout, flushed at once, so a slow or stuck step is visible while it runs."""
    print(f"[{time.monotonic() - T0:7.1f} s] {message}", flush=True)


# A pool of random values, copied into every weight: random bytes without generating 16 GB of them
# (randn on the CPU for 16 GB takes minutes; this is one 256 MiB draw on the benchmark's device).
POOL_ELEMENTS = 128 << 20


def random_weights(
    spec: dict[str, tuple[str, list[int]]], device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    total = sum(math.prod(shape) for _, shape in spec.values())
    gen = torch.Generator(device=device).manual_seed(0)
    pool = torch.randn(min(total, POOL_ELEMENTS), generator=gen, device=device).to(torch.bfloat16)
    out: list[tuple[str, torch.Tensor]] = []
    offset = 0
    for name, (_, shape) in spec.items():
        t = torch.empty(tuple(shape), dtype=torch.bfloat16, device=device)
        flat, filled = t.view(-1), 0
        while filled < flat.numel():
            start = offset % pool.numel()
            n = min(flat.numel() - filled, pool.numel() - start)
            flat[filled : filled + n].copy_(pool[start : start + n])
            filled += n
            offset += n
        out.append((name, t))
    del pool
    sync(device)
    return out


# ------------------------------------------------------------------------------ trainer process


def sync(device: torch.device, timeout_s: float = 120.0) -> None:
    # Bounded, unlike torch.cuda.synchronize(): a stuck kernel ends the run with a message.
    wait_stream(device, timeout_s, "benchmark: finishing queued work")


def bench_size(
    ep: HttpEngineEndpoint,
    backend: str,
    device: torch.device,
    gb: float,
    bucket_bytes: int,
    reps: int,
    timeout_s: float,
) -> list[dict[str, Any]]:
    spec = spec_for(gb)
    say(f"{gb:g} GB: engine allocates {len(spec)} tensors")
    ep.request("POST", "/bench_set_spec", {"spec": spec})
    say(f"{gb:g} GB: generating the trainer's weights on {device}")
    weights = random_weights(spec, device)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    say(f"{gb:g} GB: {nbytes / GB:.2f} GB in {len(weights)} tensors ready")
    rows: list[dict[str, Any]] = []
    raw_sender: WeightSender | None = None
    for mode in ("stream", "flattened_bucket", "per_tensor"):
        sender = WeightSender(
            backend=backend, bucket_bytes=bucket_bytes, load_format=mode, timeout_s=timeout_s
        )
        sender.connect([ep])
        say(f"{gb:g} GB {mode}: connected; warm-up update")
        t0 = time.perf_counter()
        sender.update(weights, "warmup")
        say(f"{gb:g} GB {mode}: warm-up took {time.perf_counter() - t0:.2f} s")
        sender.pop_metrics()
        walls, splits = [], []
        for r in range(reps):
            sync(device)
            t0 = time.perf_counter()
            sender.update(weights, f"v{r}")
            walls.append(time.perf_counter() - t0)
            splits.append(sender.pop_metrics())  # this repetition's own split
            say(
                f"{gb:g} GB {mode}: rep {r}: {walls[-1]:.3f} s = {nbytes / walls[-1] / GB:.1f} GB/s "
                f"({breakdown_text(split_ms(splits[-1], walls[-1]))})"
            )
        median = sorted(range(reps), key=lambda i: walls[i])[reps // 2]  # the median repetition
        transfer_s = sum(m["weight_sync/seconds"] for m in splits)
        rows.append(
            {
                "size_gb": nbytes / GB,
                "tensors": len(weights),
                "mode": mode,
                "update_gbps": nbytes / statistics.median(walls) / GB,
                "transfer_gbps": nbytes * reps / transfer_s / GB,
                "buckets": sum(m["weight_sync/buckets"] for m in splits) / reps,
                **split_ms(splits[median], walls[median]),
            }
        )
        if mode == "stream":
            raw_sender = sender  # keep its group for the raw broadcasts
        else:
            sender.disconnect()
    assert raw_sender is not None
    assert raw_sender.group is not None
    group = raw_sender.group
    del weights
    say(f"{gb:g} GB raw: {reps + 1} broadcasts of the whole buffer")
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    times = []
    for r in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        fut = pool.submit(
            ep.request,
            "POST",
            "/bench_raw",
            {"group_name": raw_sender.active_group_name, "bytes": nbytes, "chunk": bucket_bytes},
        )
        with on_device(device):
            works = [group.broadcast(buf[o : o + bucket_bytes]) for o in range(0, nbytes, bucket_bytes)]
            for w in works:
                w.wait()
            wait_stream(device, timeout_s, "raw send")
        reply = fut.result(timeout=timeout_s)
        if r:
            times.append(time.perf_counter() - t0)
        assert reply["success"], reply
    pool.shutdown()
    raw_sender.disconnect()
    raw_gbps = nbytes / statistics.median(times) / GB
    rows.append(
        {
            "size_gb": nbytes / GB,
            "tensors": 1,
            "mode": "raw",
            "update_gbps": raw_gbps,
            "transfer_gbps": raw_gbps,
            "buckets": -(-nbytes // bucket_bytes),
            "update_ms": statistics.median(times) * 1e3,
            "transfer_ms": statistics.median(times) * 1e3,
        }
    )
    for row in rows:
        row["vs_raw_update"] = row["update_gbps"] / raw_gbps
        row["vs_raw_transfer"] = row["transfer_gbps"] / raw_gbps
    del buf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


# Where one update's time went (the sender's metrics, weight_sync/*_seconds: parts that never overlap),
# in ms, in the order they happen; "other" is the rest of the measured update() call.
PARTS = [
    ("scan_ms", "scan", "check_seconds"),
    ("control_before_ms", "control before", "control_before_seconds"),
    ("transfer_ms", "transfer", "seconds"),
    ("control_after_ms", "control after", "control_after_seconds"),
]


def split_ms(metrics: dict[str, float], wall_s: float) -> dict[str, float]:
    """One update's parts in ms (metrics popped right after it), its wall time and the rest ("other")."""
    out = {key: metrics.get(f"weight_sync/{name}", float("nan")) * 1e3 for key, _, name in PARTS}
    out["update_ms"] = wall_s * 1e3
    out["other_ms"] = out["update_ms"] - sum(out[key] for key, _, _ in PARTS)
    return out


def breakdown_text(split: dict[str, float]) -> str:
    return ", ".join(f"{label} {split[key]:.1f}" for key, label, _ in [*PARTS, ("other_ms", "other", "")])


def _ms(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    return "" if value is None else f"{value:.1f}"


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    """The table (columns of earlier runs first), then where each update's time went, in ms: the
    repetition of median wall time, split by the sender's metrics (raw: its wall time only)."""
    print(f"\n{title}")
    print(
        "| size GB | tensors | mode | update GB/s | transfer GB/s | update / raw | transfer / raw | buckets "
        "| update ms | scan ms | control before ms | transfer ms | control after ms | other ms |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        times = " | ".join(_ms(r, key) for key in ["update_ms", *(k for k, _, _ in PARTS), "other_ms"])
        print(
            f"| {r['size_gb']:.2f} | {r['tensors']} | {r['mode']} | {r['update_gbps']:.2f} | "
            f"{r['transfer_gbps']:.2f} | {r['vs_raw_update']:.0%} | {r['vs_raw_transfer']:.0%} | "
            f"{r['buckets']:.0f} | {times} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description="weight update GB/s vs raw broadcast")
    parser.add_argument("--role", choices=["trainer", "engine"], default="trainer")
    parser.add_argument(
        "--backend", choices=["nccl", "gloo"], default="nccl" if torch.cuda.is_available() else "gloo"
    )
    parser.add_argument("--device", default="cpu", help="engine role: its device")
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=None)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", default="", help="also write the rows to this file")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="bound on every wait (both sides)")
    args = parser.parse_args()
    if args.role == "engine":
        engine_main(args.device, args.timeout_s)
        return
    torch.set_num_threads(2)
    gpu = args.backend == "nccl"
    sizes = args.sizes_gb or ([1, 4, 16] if gpu else [0.0625, 0.25])
    if gpu:
        if torch.cuda.device_count() < 2:
            raise SystemExit("the NCCL benchmark needs 2 GPUs (trainer on GPU 0, engine on GPU 1)")
        torch.cuda.set_device(0)
        # The engine sees both GPUs and uses the second, so NCCL can pick its peer-to-peer path.
        proc, url = start_engine("cuda:1", {}, args.timeout_s)
        device = torch.device("cuda", 0)
    else:
        proc, url = start_engine("cpu", {}, args.timeout_s)
        device = torch.device("cpu")
    ep = HttpEngineEndpoint(url, name="engine", timeout_s=600, load_formats=RECEIVER_LOAD_FORMATS)
    rows: list[dict[str, Any]] = []
    try:
        for gb in sizes:
            rows += bench_size(ep, args.backend, device, gb, args.bucket_mb << 20, args.reps, args.timeout_s)
            print_table(
                [r for r in rows if abs(r["size_gb"] - rows[-1]["size_gb"]) < 1e-9], f"{gb} GB target"
            )
    finally:
        proc.kill()
        proc.wait()
    name = torch.cuda.get_device_name(0) if gpu else "CPU"
    print_table(rows, f"backend={args.backend} device={name} bucket={args.bucket_mb} MiB reps={args.reps}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
