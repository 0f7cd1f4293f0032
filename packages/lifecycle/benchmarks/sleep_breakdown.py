"""Where a trainer role's sleep goes on a GPU: the copy, the frees, and how the state's layout moves both.

The state is shaped like one role of ppo-driver's budget run (a Llama of ``--layers`` x ``--hidden``,
``--intermediate``, untied embeddings of ``--vocab`` rows; float32 weights and both AdamW moments, one
storage per tensor as the trainer holds them: 441 storages, 9.87 GB at the defaults). Every case
runs ``--cycles`` sleep/wake cycles in this process with a ``PinnedHostBackend`` (or plain copies for
the limits) and reports the median of the cycles after the first:

* ``copies landed s``: from the start of the release until the last copy reached the host and the
  backend's copy-out returned (with ``free_while_copying`` that includes its frees of each landed
  group, which ran under the later copies, and of the last one);
* ``after s``: what the release took after that (the frees left to do, ``torch.cuda.empty_cache()``:
  with ordinary segments each ``cudaFree`` is a device-wide synchronisation, so none can hide);
* ``segments``: cached segments the release returned to the device (expandable segments count none);
* ``sleep GB/s``: the whole release, the rate the budget reports;
* ``wake GB/s``: the restore (allocation of each storage and the copy back).

Cases:

* ``memcpy``: one copy of the same bytes from one device buffer into torch's pinned memory (the limit);
* ``memcpy-registered``: the same into a ``cudaHostRegister``-ed slab, the backends' kind of buffer;
* ``per-storage``: the trainer's layout, tags ``weights`` and ``optimizer``, frees at the end;
* ``per-storage-expandable``: the same with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, so
  the backend frees each landed 256 MiB group while the rest copies (``free_while_copying``);
* ``per-storage-expandable-free-at-end``: expandable segments, frees at the end;
* ``contiguous`` / ``contiguous-expandable``: the same bytes in three storages (weights, ``exp_avg``,
  ``exp_avg_sq``), the layout of a flat-buffer optimizer.

Usage: ``python benchmarks/sleep_breakdown.py [--layers 16] [--hidden 2048] [--intermediate 5632]
[--cycles 4] [--cases memcpy,per-storage]``. Exits non-zero when a case fails or bytes differ after a
cycle. Each case runs in its own process (``--one``), so the allocator starts clean for every case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

CASES = (
    "memcpy",
    "memcpy-registered",
    "per-storage",
    "per-storage-expandable",
    "per-storage-expandable-free-at-end",
    "contiguous",
    "contiguous-expandable",
)
# cases run with PYTORCH_CUDA_ALLOC_CONF set in their process
EXPANDABLE = {c for c in CASES if "expandable" in c}


def llama_shapes(layers: int, hidden: int, intermediate: int, vocab: int) -> list[int]:
    """Element count of every parameter of an untied Llama with as many key/value heads as heads."""
    per_layer = [hidden * hidden] * 4 + [hidden * intermediate] * 3 + [hidden] * 2
    return [vocab * hidden] + per_layer * layers + [hidden, vocab * hidden]


def make_state(numels: list[int], layout: str, device: torch.device) -> list[torch.Tensor]:
    """Weights, exp_avg, exp_avg_sq: one storage per tensor, or three flat storages viewed by all."""
    gen = torch.Generator(device=device).manual_seed(0)
    tensors: list[torch.Tensor] = []
    for _kind in range(3):
        if layout == "contiguous":
            flat = torch.empty(sum(numels), dtype=torch.float32, device=device)
            flat.uniform_(generator=gen)
            tensors.extend(flat.split(numels))
        else:
            for n in numels:
                t = torch.empty(n, dtype=torch.float32, device=device)
                t.uniform_(generator=gen)
                tensors.append(t)
    return tensors


def checksum(tensors: list[torch.Tensor]) -> int:
    return int(sum(int(t.view(torch.int32).sum(dtype=torch.int64)) for t in tensors))


def segments() -> int:
    return int(torch.cuda.memory_stats().get("segment.all.current", 0))


def run_memcpy(nbytes: int, registered: bool, cycles: int) -> dict[str, Any]:
    from ppo_lifecycle.memory._pinned_copy import PinnedPool

    device_buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device_buf.fill_(1)
    if registered:
        host = PinnedPool()._allocate(nbytes)
    else:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    sleeps, wakes = [], []
    for _ in range(cycles):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host.copy_(device_buf, non_blocking=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        device_buf.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        sleeps.append(t1 - t0)
        wakes.append(time.perf_counter() - t1)
    copy = statistics.median(sleeps[1:] or sleeps)
    wake = statistics.median(wakes[1:] or wakes)
    return {"copy_s": copy, "free_s": 0.0, "segments": 0, "sleep_s": copy, "wake_s": wake, "storages": 1}


def run_backend(numels: list[int], layout: str, free_while_copying: bool, cycles: int) -> dict[str, Any]:
    from ppo_lifecycle.memory import PinnedHostBackend

    device = torch.device("cuda", torch.cuda.current_device())
    state = make_state(numels, layout, device)
    weights, optimizer = state[: len(state) // 3], state[len(state) // 3 :]
    torch.cuda.synchronize()
    before = checksum(state)

    timings: dict[str, float] = {}

    class Timed(PinnedHostBackend):
        """The backend, noting when its copy-out of the last tag ended (all copies landed)."""

        def _copy_out(
            self, tag: str, storages: list[torch.UntypedStorage]
        ) -> Iterator[tuple[torch.UntypedStorage, torch.Tensor]]:
            yield from super()._copy_out(tag, storages)
            timings["landed"] = time.perf_counter()

    backend = Timed(device, free_while_copying=free_while_copying)
    backend.track("weights", lambda: weights)
    backend.track("optimizer", lambda: optimizer)
    storages = len({t.untyped_storage()._cdata for t in state})
    rows = []
    for _ in range(cycles):
        timings.clear()
        torch.cuda.synchronize()
        seg = segments()
        t0 = time.perf_counter()
        backend.release()
        t1 = time.perf_counter()
        freed = seg - segments()
        backend.restore()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        rows.append((timings["landed"] - t0, t1 - timings["landed"], freed, t1 - t0, t2 - t1))
        if checksum(state) != before:
            raise SystemExit(f"{layout}: bytes differ after a sleep/wake cycle")
    steady = rows[1:] or rows
    copy, free, segs, sleep, wake = (statistics.median(col) for col in zip(*steady, strict=True))
    return {
        "copy_s": copy,
        "free_s": free,
        "segments": int(segs),
        "sleep_s": sleep,
        "wake_s": wake,
        "storages": storages,
    }


def run_case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    numels = llama_shapes(args.layers, args.hidden, args.intermediate, args.vocab)
    nbytes = 3 * 4 * sum(numels)
    if case in ("memcpy", "memcpy-registered"):
        out = run_memcpy(nbytes, case == "memcpy-registered", args.cycles)
    else:
        layout = "contiguous" if case.startswith("contiguous") else "per-storage"
        early = case in EXPANDABLE and not case.endswith("free-at-end")
        out = run_backend(numels, layout, early, args.cycles)
    return {"case": case, "bytes": nbytes, **out}


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | storages | GB | copies landed s | copy GB/s | after s | segments freed | sleep s "
        "| sleep GB/s | wake GB/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error']} |" + " |" * 8)
            continue
        gb = r["bytes"] / 1e9
        lines.append(
            f"| {r['case']} | {r['storages']} | {gb:.2f} | {r['copy_s']:.3f} | {gb / r['copy_s']:.1f} | "
            f"{r['free_s']:.3f} | {r['segments']} | {r['sleep_s']:.3f} | {gb / r['sleep_s']:.1f} | "
            f"{gb / r['wake_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=16)
    ap.add_argument("--cycles", type=int, default=4, help="cycles per case (first not counted)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one case, JSON out
    args = ap.parse_args()
    if min(args.layers, args.hidden, args.intermediate, args.vocab) < 1 or args.cycles < 1:
        ap.error("--layers, --hidden, --intermediate, --vocab and --cycles must be >= 1")
    if not torch.cuda.is_available():
        ap.error("needs CUDA (run on the GPU machine)")
    if args.one:
        print(json.dumps(run_case(args.one, args)), flush=True)
        return 0
    cases = args.cases.split(",")
    if unknown := [c for c in cases if c not in CASES]:
        ap.error(f"unknown cases {unknown}; choose from {list(CASES)}")
    rows, failed = [], False
    for case in cases:
        cmd = [sys.executable, __file__, "--one", case, "--cycles", str(args.cycles)]
        for name in ("layers", "hidden", "intermediate", "vocab"):
            cmd += [f"--{name}", str(getattr(args, name))]
        t0 = time.perf_counter()
        env = dict(os.environ)
        if case in EXPANDABLE:
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if proc.returncode != 0:
            failed = True
            err = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1][:160]
            rows.append({"case": case, "error": err.replace("|", "/")})
        else:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"# {case}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    print(table(rows), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
