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

``update`` is the whole ``WeightSender.update()`` to an HTTP engine process on the same GPU: in one
request per update (``ppo_ipc_stream``, the default), and ``update (request per bucket)``
(``ppo_ipc_bucket``); the bucket size is ``auto_bucket_bytes`` of the model's size unless ``--bucket-mb``
says otherwise, and ``--raw-mb`` adds the update and the raw pipeline at a second size (the issue's).

Each figure is the median of ``--reps`` after a warm-up; ``ipc`` also reports where its host time went
(waiting for packing, waiting for the engine's answers). After the last ``ipc`` repetition the engine's
weights are compared with the trainer's on the GPU (per-tensor integer fingerprints of the bf16 bits).

    python benchmarks/bench_ipc.py --sizes-gb 1 4 16 --raw-mb 64 128 512 --gloo-max-gb 0
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

from ppo_weight_sync import ColocatedIpc, HttpEngineEndpoint, WeightSender, non_finite_names
from ppo_weight_sync.device_sync import wait_stream
from ppo_weight_sync.endpoints import RECEIVER_LOAD_FORMATS
from ppo_weight_sync.ipc import (
    BucketLayout,
    BucketPacker,
    IpcTransport,
    auto_bucket_bytes,
    encode_ipc_bucket,
    export_buffer,
    send_buckets,
)
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
    bucket_bytes: int | None,
    reps: int,
    timeout_s: float,
    sglang_format: bool,
    stream: bool = True,
    check_finite: bool = True,
) -> dict[str, Any]:
    """The whole ``WeightSender.update()`` (pause, flush, buckets, continue) to an HTTP engine process
    on this GPU, connected as colocated: ``ppo_ipc_bucket`` (ours) or SGLang's ``flattened_bucket``.
    ``check_finite=False``: without the non-finite scan, to show what the scan costs."""
    formats = ("flattened_bucket",) if sglang_format else RECEIVER_LOAD_FORMATS
    ep = HttpEngineEndpoint(url, name="near", timeout_s=600, load_formats=formats)
    ep.request("POST", "/bench_set_spec", {"spec": spec})
    sender = WeightSender(
        backend="nccl",
        timeout_s=timeout_s,
        transports=[ColocatedIpc(["near"], bucket_bytes=bucket_bytes, stream=stream)],
        check_finite=check_finite,
    )
    sender.connect([ep])
    (transport,) = [t for t in sender._conn.transports if isinstance(t, IpcTransport)]
    walls, control, scans, transfer, packs, replies = [], [], [], [], [], []
    for r in range(reps + 1):
        sync(weights[0][1].device)
        t0 = time.perf_counter()
        sender.update(weights, f"u{r}")
        wall = time.perf_counter() - t0
        m = sender.pop_metrics()
        if r:
            walls.append(wall)
            control.append(m["weight_sync/control_seconds"])
            scans.append(m["weight_sync/check_seconds"])
            transfer.append(m["weight_sync/ipc_seconds"])
            assert transport.last is not None
            packs.append(transport.last.wait_pack_s)
            replies.append(transport.last.wait_reply_s)
    # One kept-alive HTTP round trip to the same server (what each bucket's message costs at least).
    rtts = []
    for _ in range(21):
        t0 = time.perf_counter()
        ep.get_weight_version().result(timeout_s)
        rtts.append(time.perf_counter() - t0)
    used = transport.packer.allocated_bytes // 2
    same = ep.request("POST", "/bench_fingerprint", {}) == json.loads(json.dumps(fingerprint(weights)))
    state = ep.request("POST", "/bench_mappings", {})
    sender.disconnect()
    released = ep.request("POST", "/bench_mappings", {})
    ep.request("POST", "/bench_set_spec", {"spec": {}})
    ep.close()
    mode = "update (request per bucket)" if not stream else "update"
    mode = "update (sglang format)" if sglang_format else mode
    return {
        "mode": mode if check_finite else f"{mode}, no scan",
        "seconds": statistics.median(walls),
        "buckets": int(m["weight_sync/ipc_buckets"]),
        "control_ms": statistics.median(control) * 1e3,
        "scan_ms": statistics.median(scans) * 1e3,
        "transfer_ms": statistics.median(transfer) * 1e3,
        "wait_pack_ms": statistics.median(packs) * 1e3,
        "wait_reply_ms": statistics.median(replies) * 1e3,
        "rtt_ms": statistics.median(rtts) * 1e3,
        "buffer_mb": used / 2**20,
        "bit_identical": same,
        "mappings": f"{state['ipc_mappings']} -> {released['ipc_mappings']}",
    }


def bench_scan(weights: list[tuple[str, torch.Tensor]], reps: int) -> dict[str, Any]:
    """The non-finite scan alone (``non_finite_names``, the update's scan with its verdict), in this same
    process and state: what the update's ``scan`` share would be if nothing slowed it there."""
    walls = []
    for r in range(reps + 1):
        sync(weights[0][1].device)
        t0 = time.perf_counter()
        bad = non_finite_names(weights)
        if r:
            walls.append(time.perf_counter() - t0)
        if bad:
            raise SystemExit(f"the benchmark's weights hold non-finite values: {bad[:3]}")
    return {"mode": "scan alone", "seconds": statistics.median(walls), "buckets": 0}


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


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| size GB | bucket MiB | mode | seconds | GB/s | vs raw (same buckets) | vs best raw | buckets "
        "| where the time went, ms | same |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        extra = ""
        if r["mode"] == "ipc":
            extra = f"waits: pack {r['wait_pack_ms']:.1f}, replies {r['wait_reply_ms']:.1f}"
        if "control_ms" in r:
            extra = (
                f"scan {r['scan_ms']:.1f}, control {r['control_ms']:.1f}, transfer {r['transfer_ms']:.1f} "
                f"(waits: pack {r['wait_pack_ms']:.1f}, replies {r['wait_reply_ms']:.1f}); "
                f"one HTTP round trip {r['rtt_ms']:.2f}; mappings {r['mappings']}"
            )
        same_raw = f"{r['vs_raw']:.0%}" if r.get("vs_raw") is not None else ""
        print(
            f"| {r['size_gb']:.2f} | {r['bucket_mb']} | {r['mode']} | {r['seconds']:.4f} | "
            f"{r['gb_per_s']:.1f} | {same_raw} | {r['vs_best_raw']:.0%} | {r['buckets']} | {extra} | "
            f"{r.get('bit_identical', '')} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description="colocated weight updates on one GPU")
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--bucket-mb",
        nargs="+",
        default=["auto"],
        help="the update's bucket size per size (or one for all): MiB, or 'auto' (auto_bucket_bytes)",
    )
    parser.add_argument(
        "--raw-mb",
        type=int,
        nargs="*",
        default=[],
        help="per size, a second bucket size for the raw pipeline and the update (the issue's: 64 128 512)",
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sglang", action="store_true", help="also SGLang's flattened_bucket format")
    parser.add_argument("--gloo-reps", type=int, default=1)
    parser.add_argument("--gloo-max-gb", type=float, default=4.0, help="skip gloo above this size (slow)")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_ipc needs a CUDA GPU")
    n = len(args.sizes_gb)
    buckets = args.bucket_mb if len(args.bucket_mb) == n else args.bucket_mb[:1] * n
    second = args.raw_mb if len(args.raw_mb) == n else (args.raw_mb[:1] * n if args.raw_mb else [None] * n)
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    peer = IpcPeer("cuda:0", name="engine", timeout_s=args.timeout_s)
    proc, url = start_engine("cuda:0", {}, args.timeout_s)
    ep = HttpEngineEndpoint(url, name="gloo-engine", timeout_s=600, load_formats=RECEIVER_LOAD_FORMATS)
    rows: list[dict[str, Any]] = []
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, reps {args.reps}", flush=True)
    try:
        for gb, bucket_arg, other_mb in zip(args.sizes_gb, buckets, second, strict=True):
            spec = spec_for(gb)
            weights = random_weights(spec, device)
            nbytes = sum(t.numel() * t.element_size() for _, t in weights)
            auto = bucket_arg == "auto"
            bucket = auto_bucket_bytes(nbytes) if auto else int(bucket_arg) << 20
            label = f"{bucket >> 20} (auto)" if auto else str(bucket >> 20)
            say(f"{gb:g} GB: {nbytes / GB:.2f} GB in {len(weights)} tensors, {label} MiB buckets")
            peer.call("spec", spec, None)
            got: list[dict[str, Any]] = []

            def add(row: dict[str, Any], mb: Any, got: list[dict[str, Any]] = got, gb: float = gb) -> None:
                row["bucket_mb"] = mb
                got.append(row)
                say(f"{gb:g} GB {row['mode']} ({mb} MiB): {row}")

            add(
                bench_update(url, spec, weights, None if auto else bucket, args.reps, args.timeout_s, False),
                label,
            )
            reps, timeout_s = args.reps, args.timeout_s
            add(bench_scan(weights, reps), "")
            add(bench_update(url, spec, weights, bucket, reps, timeout_s, False, check_finite=False), label)
            add(
                bench_update(url, spec, weights, bucket, args.reps, args.timeout_s, False, stream=False),
                label,
            )
            add(bench_ipc(peer, device, weights, bucket, args.reps, args.timeout_s), label)
            add(bench_raw(peer, device, nbytes, bucket, args.reps, args.timeout_s), label)
            if other_mb and other_mb << 20 != bucket:
                add(
                    bench_update(url, spec, weights, other_mb << 20, args.reps, args.timeout_s, False),
                    other_mb,
                )
                add(bench_raw(peer, device, nbytes, other_mb << 20, args.reps, args.timeout_s), other_mb)
            if args.sglang:
                add(bench_update(url, spec, weights, bucket, args.reps, args.timeout_s, True), label)
            add(bench_clone(device, nbytes, args.reps), "")
            if gb <= args.gloo_max_gb:
                add(bench_gloo(ep, spec, weights, args.gloo_reps, args.timeout_s), "")
            peer.call("drop_weights")
            del weights
            torch.cuda.empty_cache()
            raws = {g["bucket_mb"]: g["seconds"] for g in got if g["mode"] == "raw"}
            best = min(raws.values())
            for g in got:
                g.update(size_gb=nbytes / GB, gb_per_s=nbytes / g["seconds"] / GB)
                g["vs_raw"] = raws[g["bucket_mb"]] / g["seconds"] if g["bucket_mb"] in raws else None
                g["vs_best_raw"] = best / g["seconds"]
            rows += got
            print_table(got)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
    finally:
        peer.stop()
        proc.kill()
        proc.wait()
    print(f"\n{torch.cuda.get_device_name(0)}, torch {torch.__version__}, reps {args.reps}")
    print_table(rows)
    if any(r.get("bit_identical") is False for r in rows):
        raise SystemExit("the engine's weights differ from the trainer's after an ipc update")


if __name__ == "__main__":
    main()
