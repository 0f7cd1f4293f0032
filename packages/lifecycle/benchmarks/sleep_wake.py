"""Sleep/wake throughput of the memory backends, against a plain copy baseline.

    python benchmarks/sleep_wake.py                      # CUDA, 16 GiB of state
    python benchmarks/sleep_wake.py --gib 4 --cycles 4
    python benchmarks/sleep_wake.py --device cpu --gib 1 # host backend vs a plain clone

CUDA cases, each in its own process (torch_memory_saver's settings are process-wide):
  memcpy        one pinned D2H + H2D copy of the whole state (the physical limit)
  pinned        PinnedHostBackend (buffers allocated at track(), reported as setup)
  tms-pinned    TorchMemorySaverBackend(backup="pinned") (the default)
  tms-retain    TorchMemorySaverBackend(backup="retain")
  tms-default   torch_memory_saver's CPU backup as shipped (--tms-default-gib, slow)
GB/s are 10^9 bytes of state per second. "first" is cycle 1, "steady" the median of the others.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

GiB = 1 << 30
CUDA_CASES = ("memcpy", "pinned", "tms-pinned", "tms-retain", "tms-default")
CPU_CASES = ("clone", "host")


def make_state(total: int, device: str) -> list[torch.Tensor]:
    """15/16 of the bytes in 256 MiB tensors (layers), the rest in 1 MiB ones (norms, biases)."""
    big, small = 256 << 20, 1 << 20
    n_big = (total * 15 // 16) // big
    n_small = (total - n_big * big) // small
    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for size in [big] * n_big + [small] * n_small:
        t = torch.empty(size // 4, dtype=torch.float32, device=device)
        t.uniform_(generator=gen)
        out.append(t)
    return out


def checksum(tensors: list[torch.Tensor]) -> int:
    return int(sum(int(t.view(torch.int32).sum(dtype=torch.int64)) for t in tensors))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_bytes(device: str) -> int:
    return int(torch.cuda.mem_get_info()[0]) if device == "cuda" else 0


def run_case(case: str, gib: float, cycles: int, device: str) -> dict[str, Any]:
    from ppo_lifecycle.memory import HostMemoryBackend, PinnedHostBackend, TorchMemorySaverBackend

    total = int(gib * GiB)
    backend: Any = None
    region: AbstractContextManager[None] = nullcontext()
    if case.startswith("tms-"):
        mode = {"tms-pinned": "pinned", "tms-retain": "retain", "tms-default": "tms_default"}[case]
        backend = TorchMemorySaverBackend(backup=mode)  # type: ignore[arg-type]
        region = backend.region("state")
    with region:
        state = make_state(total, device)
    nbytes = sum(t.numel() * 4 for t in state)
    sync(device)
    before = checksum(state)
    setup = time.perf_counter()
    host_bytes = 0
    if case == "memcpy":
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        del state
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host_bytes = nbytes
    elif case == "clone":
        flat_state = state
    elif case == "pinned":
        backend = PinnedHostBackend()
        backend.track("state", lambda: state)
        host_bytes = backend.pinned_bytes
    elif case == "host":
        backend = HostMemoryBackend()
        backend.track("state", lambda: state)
    elif case == "tms-pinned":
        backend.track("state", lambda: state)
        host_bytes = backend.pinned_bytes
    elif case in ("tms-retain", "tms-default"):
        host_bytes = nbytes  # torch_memory_saver's own backup (retained or per cycle)
    setup = time.perf_counter() - setup

    sleeps, wakes, freed = [], [], 0
    for _ in range(cycles):
        sync(device)
        f0 = free_bytes(device)
        t0 = time.perf_counter()
        if case == "memcpy":
            host.copy_(flat, non_blocking=True)
        elif case == "clone":
            backups = [t.clone() for t in flat_state]
        else:
            backend.release()
        sync(device)
        t1 = time.perf_counter()
        freed = max(freed, free_bytes(device) - f0)
        if case == "memcpy":
            flat.copy_(host, non_blocking=True)
        elif case == "clone":
            for t, b in zip(flat_state, backups, strict=True):
                t.copy_(b)
            del backups
        else:
            backend.restore()
        sync(device)
        t2 = time.perf_counter()
        sleeps.append(t1 - t0)
        wakes.append(t2 - t1)
    identical = None if case == "memcpy" else checksum(flat_state if case == "clone" else state) == before
    steady_s = statistics.median(sleeps[1:]) if cycles > 1 else sleeps[0]
    steady_w = statistics.median(wakes[1:]) if cycles > 1 else wakes[0]
    return {
        "case": case,
        "gib": nbytes / GiB,
        "setup_s": setup,
        "sleep_first": nbytes / sleeps[0] / 1e9,
        "wake_first": nbytes / wakes[0] / 1e9,
        "sleep_steady": nbytes / steady_s / 1e9,
        "wake_steady": nbytes / steady_w / 1e9,
        "host_gib": host_bytes / GiB,
        "freed_gib": freed / GiB,
        "identical": identical,
    }


def table(rows: list[dict[str, Any]], device: str) -> str:
    head = (
        "| case | state GiB | setup s | sleep GB/s first | wake GB/s first | sleep GB/s steady "
        "| wake GB/s steady | pinned host GiB | device GiB freed | bytes identical |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
    )
    lines = []
    for r in rows:
        if "error" in r:
            err = str(r["error"]).replace("|", "/")
            lines.append(f"| {r['case']} | {r.get('gib', 0):.1f} | failed: {err} |" + " |" * 7)
            continue
        freed = f"{r['freed_gib']:.2f}" if device == "cuda" else "n/a"
        ident = {None: "n/a", True: "yes", False: "**NO**"}[r["identical"]]
        lines.append(
            f"| {r['case']} | {r['gib']:.1f} | {r['setup_s']:.2f} | {r['sleep_first']:.1f} | "
            f"{r['wake_first']:.1f} | {r['sleep_steady']:.1f} | {r['wake_steady']:.1f} | "
            f"{r['host_gib']:.1f} | {freed} | {ident} |"
        )
    return head + "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=16.0, help="state size in GiB (default 16)")
    ap.add_argument("--cycles", type=int, default=3, help="sleep/wake cycles per case (default 3)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--cases", default=None, help="comma-separated subset of the cases")
    ap.add_argument("--tms-default-gib", type=float, default=None, help="state size for tms-default")
    ap.add_argument("--tms-default-cycles", type=int, default=2)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one case, print JSON
    args = ap.parse_args()
    if args.gib <= 0 or args.cycles < 1:
        ap.error("--gib must be > 0 and --cycles >= 1")
    if args.one:
        print(json.dumps(run_case(args.one, args.gib, args.cycles, args.device)), flush=True)
        # torch_memory_saver 0.0.10 can abort in its free hook while the interpreter tears down CUDA
        # ("only support interesting region"); the measurement is complete by then, so skip teardown.
        os._exit(0)
    known = CUDA_CASES if args.device == "cuda" else CPU_CASES
    cases = args.cases.split(",") if args.cases else list(known)
    if unknown := [c for c in cases if c not in known]:
        ap.error(f"unknown cases {unknown} for --device {args.device}; choose from {list(known)}")
    rows = []
    for case in cases:
        gib, cycles = args.gib, args.cycles
        if case == "tms-default":
            gib = args.tms_default_gib or args.gib
            cycles = args.tms_default_cycles
        cmd = [sys.executable, __file__, "--one", case, "--gib", str(gib), "--cycles", str(cycles)]
        cmd += ["--device", args.device]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            err = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1][:120]
            rows.append({"case": case, "gib": gib, "error": err})
        else:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"# {case}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    print(table(rows, args.device), flush=True)


if __name__ == "__main__":
    main()
