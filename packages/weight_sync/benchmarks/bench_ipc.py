"""Colocated weight updates on one GPU: CUDA IPC buckets vs a raw IPC pipeline vs gloo through the host.

Trainer: this process, GPU 0. Engine: a second process on the same GPU. bf16 weights shaped like a Llama
model (``bench_update.spec_for``). Modes, in the same run, same bytes, same bucket size:

- ``ipc``: this package's colocated path, bucket by bucket as :func:`ppo_weight_sync.ipc.send_buckets`
  drives it (pack into one of two cached, exported buffers; one message per bucket naming the buffer
  and the layout; the engine maps once, copies each tensor into its own weights, answers);
- ``raw``: the upper bound of the same pattern: one pre-filled contiguous source, each bucket copied
  into one of two exported buffers, its slot handed to the engine over the same pipe, which copies it
  into its own buffer (no layout, no per-tensor copies, no names);
- ``gloo``: the group path the driver used for colocated engines (``WeightSender(backend="gloo")`` to an
  HTTP engine process on the same GPU; bytes staged through host memory);
- ``clone``: one on-GPU ``clone()`` of the whole buffer, for scale.

Each figure is the median of ``--reps`` after a warm-up; ``ipc`` also reports where its host time went
(waiting for packing, waiting for the engine's answers). After the last ``ipc`` repetition the engine's
weights are compared with the trainer's on the GPU (per-tensor integer fingerprints of the bf16 bits).

    python benchmarks/bench_ipc.py --sizes-gb 1 4 16 --bucket-mb 64 128 512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_update import GB, random_weights, spec_for, start_engine

from ppo_weight_sync import ColocatedIpc, HttpEngineEndpoint, WeightSender
from ppo_weight_sync.device_sync import wait_stream
from ppo_weight_sync.endpoints import RECEIVER_LOAD_FORMATS
from ppo_weight_sync.ipc import BucketLayout, BucketPacker, encode_ipc_bucket, export_buffer, send_buckets
from ppo_weight_sync.testing.ipc_peer import IpcPeer, gpu_fingerprint

T0 = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f} s] {message}", flush=True)


def sync(device: torch.device) -> None:
    wait_stream(device, 120.0, "benchmark: queued work")


def fingerprint(tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, list[int]]:
    return gpu_fingerprint(tensors)


def bench_ipc(
    peer: IpcPeer,
    device: torch.device,
    weights: list[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    reps: int,
    timeout_s: float,
) -> dict[str, Any]:
    packer = BucketPacker(device, bucket_bytes, timeout_s)
    layouts = packer.plan(weights)
    session = f"bench-{bucket_bytes}"

    def post(slot: int, layout: BucketLayout, last: bool) -> list[Callable[[float], Any]]:
        return [peer.post("ipc", encode_ipc_bucket(session, packer.handle(peer.name, slot), layout))]

    walls, packs, replies = [], [], []
    for r in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        stats = send_buckets(packer, weights, layouts, post, timeout_s)
        wall = time.perf_counter() - t0
        if r:
            walls.append(wall)
            packs.append(stats.wait_pack_s)
            replies.append(stats.wait_reply_s)
    ok = peer.call("fingerprint") == fingerprint(weights)
    peer.call("release", session)
    packer.forget(peer.name, released=True)
    packer.free()
    torch.cuda.empty_cache()
    wall = statistics.median(walls)
    return {
        "mode": "ipc",
        "seconds": wall,
        "buckets": len(layouts),
        "wait_pack_ms": statistics.median(packs) * 1e3,
        "wait_reply_ms": statistics.median(replies) * 1e3,
        "bit_identical": ok,
    }


def raw_pipeline(
    peer: IpcPeer,
    src: torch.Tensor,
    slots: list[torch.Tensor],
    chunks: list[tuple[int, int]],
    timeout_s: float,
) -> None:
    """Pack chunk k into slot k % 2, hand the slot to the peer, pack k+1 while the peer copies k."""
    waiting: list[Callable[[float], Any] | None] = [None, None]
    events: list[torch.cuda.Event | None] = [None, None]

    def pack(k: int) -> None:
        o, n = chunks[k]
        slots[k % 2][:n].copy_(src[o : o + n], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        events[k % 2] = ev

    pack(0)
    for k, (o, n) in enumerate(chunks):
        ev = events[k % 2]
        if ev is not None:
            while not ev.query():
                time.sleep(0.00002)
        waiting[k % 2] = peer.post("raw_copy", k % 2, o, n)
        if k + 1 < len(chunks):
            prev = waiting[(k + 1) % 2]
            if prev is not None:
                prev(timeout_s)
                waiting[(k + 1) % 2] = None
            pack(k + 1)
    for k in range(max(0, len(chunks) - 2), len(chunks)):
        w = waiting[k % 2]
        if w is not None:
            w(timeout_s)
            waiting[k % 2] = None


def bench_raw(
    peer: IpcPeer, device: torch.device, nbytes: int, bucket_bytes: int, reps: int, timeout_s: float
) -> dict[str, Any]:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    slots = [torch.empty(bucket_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
    peer.call("raw_setup", [export_buffer(s).to_wire() for s in slots], nbytes)
    chunks = [(o, min(bucket_bytes, nbytes - o)) for o in range(0, nbytes, bucket_bytes)]
    walls = []
    for r in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        raw_pipeline(peer, src, slots, chunks, timeout_s)
        if r:
            walls.append(time.perf_counter() - t0)
    peer.call("raw_release")
    del src, slots
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()
    return {"mode": "raw", "seconds": statistics.median(walls), "buckets": len(chunks)}


def bench_clone(device: torch.device, nbytes: int, reps: int) -> dict[str, Any]:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    walls = []
    for _ in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        dst = src.clone()
        sync(device)
        walls.append(time.perf_counter() - t0)
        del dst
    del src
    torch.cuda.empty_cache()
    return {"mode": "clone", "seconds": statistics.median(walls[1:]), "buckets": 1}


def bench_update(
    url: str,
    spec: dict[str, Any],
    weights: list[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    reps: int,
    timeout_s: float,
    sglang_format: bool,
) -> dict[str, Any]:
    """The whole ``WeightSender.update()`` (pause, flush, buckets, continue) to an HTTP engine process
    on this GPU, connected as colocated: ``ppo_ipc_bucket`` (ours) or SGLang's ``flattened_bucket``."""
    formats = ("flattened_bucket",) if sglang_format else RECEIVER_LOAD_FORMATS
    ep = HttpEngineEndpoint(url, name="near", timeout_s=600, load_formats=formats)
    ep.request("POST", "/bench_set_spec", {"spec": spec})
    sender = WeightSender(
        backend="nccl",
        bucket_bytes=bucket_bytes,
        timeout_s=timeout_s,
        transports=[ColocatedIpc(["near"], bucket_bytes=bucket_bytes)],
    )
    sender.connect([ep])
    walls, control, transfer = [], [], []
    for r in range(reps + 1):
        sync(weights[0][1].device)
        t0 = time.perf_counter()
        sender.update(weights, f"u{r}")
        wall = time.perf_counter() - t0
        m = sender.pop_metrics()
        if r:
            walls.append(wall)
            control.append(m["weight_sync/control_seconds"])
            transfer.append(m["weight_sync/ipc_seconds"])
    same = ep.request("POST", "/bench_fingerprint", {}) == json.loads(json.dumps(fingerprint(weights)))
    state = ep.request("POST", "/bench_mappings", {})
    sender.disconnect()
    released = ep.request("POST", "/bench_mappings", {})
    ep.request("POST", "/bench_set_spec", {"spec": {}})
    ep.close()
    return {
        "mode": "update (sglang format)" if sglang_format else "update",
        "seconds": statistics.median(walls),
        "buckets": int(m["weight_sync/ipc_buckets"]),
        "control_ms": statistics.median(control) * 1e3,
        "transfer_ms": statistics.median(transfer) * 1e3,
        "bit_identical": same,
        "mappings": f"{state['ipc_mappings']} -> {released['ipc_mappings']}",
    }


def bench_gloo(
    ep: HttpEngineEndpoint,
    spec: dict[str, Any],
    weights: list[tuple[str, torch.Tensor]],
    reps: int,
    timeout_s: float,
) -> dict[str, Any]:
    ep.request("POST", "/bench_set_spec", {"spec": spec})
    sender = WeightSender(backend="gloo", bucket_bytes=512 << 20, timeout_s=timeout_s)
    sender.connect([ep])
    walls = []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        sender.update(weights, f"gloo-{r}")
        if r:
            walls.append(time.perf_counter() - t0)
    sender.disconnect()
    ep.request("POST", "/bench_set_spec", {"spec": {}})
    return {"mode": "gloo", "seconds": statistics.median(walls), "buckets": -1}


def main() -> None:
    parser = argparse.ArgumentParser(description="colocated weight updates on one GPU")
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--bucket-mb", type=int, nargs="+", default=[64, 128, 512], help="one per size, or one for all"
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--gloo-reps", type=int, default=1)
    parser.add_argument("--gloo-max-gb", type=float, default=4.0, help="skip gloo above this size (slow)")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_ipc needs a CUDA GPU")
    buckets = (
        args.bucket_mb
        if len(args.bucket_mb) == len(args.sizes_gb)
        else args.bucket_mb[:1] * len(args.sizes_gb)
    )
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    peer = IpcPeer("cuda:0", name="engine", timeout_s=args.timeout_s)
    proc, url = start_engine("cuda:0", {}, args.timeout_s)
    ep = HttpEngineEndpoint(url, name="gloo-engine", timeout_s=600, load_formats=RECEIVER_LOAD_FORMATS)
    rows: list[dict[str, Any]] = []
    try:
        for gb, bucket_mb in zip(args.sizes_gb, buckets, strict=True):
            spec = spec_for(gb)
            weights = random_weights(spec, device)
            nbytes = sum(t.numel() * t.element_size() for _, t in weights)
            say(f"{gb:g} GB: {nbytes / GB:.2f} GB in {len(weights)} tensors, {bucket_mb} MiB buckets")
            peer.call("spec", spec, None)
            got = [bench_ipc(peer, device, weights, bucket_mb << 20, args.reps, args.timeout_s)]
            say(f"{gb:g} GB ipc: {got[-1]}")
            got.append(bench_raw(peer, device, nbytes, bucket_mb << 20, args.reps, args.timeout_s))
            say(f"{gb:g} GB raw: {got[-1]}")
            got.append(bench_clone(device, nbytes, args.reps))
            for sglang_format in (False, True):
                got.append(
                    bench_update(
                        url, spec, weights, bucket_mb << 20, args.reps, args.timeout_s, sglang_format
                    )
                )
                say(f"{gb:g} GB {got[-1]['mode']}: {got[-1]}")
            if gb <= args.gloo_max_gb:
                got.append(bench_gloo(ep, spec, weights, args.gloo_reps, args.timeout_s))
                say(f"{gb:g} GB gloo: {got[-1]}")
            peer.call("drop_weights")
            del weights
            torch.cuda.empty_cache()
            raw = next(g for g in got if g["mode"] == "raw")["seconds"]
            for g in got:
                g.update(size_gb=nbytes / GB, bucket_mb=bucket_mb, gb_per_s=nbytes / g["seconds"] / GB)
                g["vs_raw"] = raw / g["seconds"]
            rows += got
    finally:
        peer.stop()
        proc.kill()
        proc.wait()
    print(f"\n{torch.cuda.get_device_name(0)}, torch {torch.__version__}, reps {args.reps}")
    print(
        "| size GB | bucket MiB | mode | seconds | GB/s | vs raw | buckets | where the time went, ms | same |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        extra = ""
        if "wait_pack_ms" in r:
            extra = f"waits: pack {r['wait_pack_ms']:.1f}, replies {r['wait_reply_ms']:.1f}"
        if "control_ms" in r:
            extra = (
                f"control {r['control_ms']:.1f}, transfer {r['transfer_ms']:.1f}; mappings {r['mappings']}"
            )
        print(
            f"| {r['size_gb']:.2f} | {r['bucket_mb']} | {r['mode']} | {r['seconds']:.4f} | "
            f"{r['gb_per_s']:.1f} | {r['vs_raw']:.0%} | {r['buckets']} | {extra} | "
            f"{r.get('bit_identical', '')} |",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if any(r.get("bit_identical") is False for r in rows):
        raise SystemExit("the engine's weights differ from the trainer's after an ipc update")


if __name__ == "__main__":
    main()
