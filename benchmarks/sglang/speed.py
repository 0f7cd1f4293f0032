"""The built-in engine against a real SGLang server on the same GPU: tokens/s side by side.

Per size (``long_tail_generate.py``'s ``SIZES``, random weights saved as safetensors) one SGLang server
is launched through the adapter (``SGLangServerSpec``, ``--attention-backend triton --sampling-backend
pytorch --skip-tokenizer-init``, ``--mem-fraction-static`` leaving room for the built-in engine in this
process), timed from launch to ``/health``. Workloads: ``fixed`` (256 requests x 256 tokens) and
``long_tail`` (lognormal lengths: 0.82B 128 requests, median 300, max 2048, 64 slots; 135M and tiny 64,
300, 1024, 32 slots). Greedy, eos ignored (every response has its forced length), log-probs returned:
``GenerationCore.generate_requests`` (continuous) against one ``/generate`` call with every request's
``input_ids`` and ``max_new_tokens`` (``SGLangClient``), each after an untimed warm-up run. Printed:
tokens/s, built-in over SGLang (above 1: the built-in engine is faster), each wall time over the
workload's bandwidth bound (all requests at once: weights once per decode step plus the keys and values
read, at a measured device copy rate), the start-up. Exits non-zero on any failure.

    python benchmarks/sglang/speed.py --sizes smollm2-135m --out /tmp/speed-135m.md     # GPU
    python benchmarks/sglang/speed.py --device cpu --sizes tiny --scale 0.125           # dry run
    python benchmarks/sglang/speed.py --device cpu --sizes tiny --scale 0.125 \\
        --command "python -m ppo_rollout.testing.sglang_standin --standin-version 0.5.17"  # the stand-in
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import os
import shlex
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from launch import launch_server, log

from ppo_rollout.config import SamplingConfig
from ppo_rollout.engine.continuous import GenerationRequest
from ppo_rollout.engine.core import GenerationCore
from ppo_rollout.engine.sglang import SGLangClient, SGLangServer
from ppo_rollout.testing import long_tail
from ppo_rollout.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingConfig(temperature=0.0, ignore_eos=True)
LONG_TAIL = {"0.82B": (128, 300, 2048, 64), "smollm2-135m": (64, 300, 1024, 32), "tiny": (64, 300, 1024, 32)}
FIXED = (256, 256)  # requests x new tokens
PROMPT_LEN = (16, 64)


def _load_long_tail_generate() -> Any:
    """``packages/rollout/benchmarks/long_tail_generate.py`` as a module (a script, not in a package)."""
    path = ROOT / "packages/rollout/benchmarks/long_tail_generate.py"
    spec = importlib.util.spec_from_file_location("long_tail_generate", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


LTG = _load_long_tail_generate()


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[GenerationRequest]
    slots: int  # the built-in engine's rows at once

    @property
    def lengths(self) -> list[int]:
        return [r.max_new_tokens for r in self.requests]


@dataclass(frozen=True)
class Timing:
    seconds: float
    tokens: list[list[int]]


def workloads(args: argparse.Namespace, size: str, vocab: int) -> list[Workload]:
    out = []
    for name in args.workloads:
        if name == "fixed":
            count, new = (max(1, round(x * args.scale)) for x in FIXED)
            lengths, slots = [new] * count, count
        else:
            count, median, longest, slots = LONG_TAIL[size]
            count, longest = max(1, round(count * args.scale)), max(1, round(longest * args.scale))
            lengths = long_tail.lognormal_lengths(count, median * args.scale, longest, 1.0, args.seed)
            slots = min(count, slots)
        prompts = LTG.prompts(count, *PROMPT_LEN, vocab, args.seed)
        requests = [
            GenerationRequest(p, n, seed=i) for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
        ]
        out.append(Workload(name, requests, args.slots or slots))
    return out


def warm_then_time(who: str, wl: Workload, device: str, call: Callable[[], list[list[int]]]) -> Timing:
    """An untimed warm-up run of ``call`` (the built-in engine captures its CUDA graphs, SGLang compiles
    what it compiles lazily), then the timed one."""
    log(f"{who} {wl.name}: warm-up run (untimed)")
    call()
    log(f"{who} {wl.name}: timed run")
    seconds, tokens = LTG.timed(device, call)
    log(f"{who} {wl.name}: {seconds:.2f} s")
    return Timing(seconds, tokens)


def run_builtin(core: GenerationCore, wl: Workload, device: str) -> Timing:
    def call() -> list[list[int]]:
        outs = core.generate_requests(wl.requests, GREEDY, max_running=wl.slots, refill_every=8)
        return [list(o.token_ids) for o in outs]

    return warm_then_time("built-in", wl, device, call)


def run_sglang(client: SGLangClient, wl: Workload, device: str) -> Timing:
    """One ``/generate`` call with every request (bounded by the client's timeout)."""
    prompts = [list(r.prompt) for r in wl.requests]

    def call() -> list[list[int]]:
        return [list(o.token_ids) for o in client.generate(prompts, GREEDY, max_new_tokens=wl.lengths)]

    return warm_then_time("SGLang", wl, device, call)


def check_lengths(who: str, wl: Workload, timing: Timing) -> None:
    got = [len(t) for t in timing.tokens]
    if got != wl.lengths:
        bad = [(i, g, w) for i, (g, w) in enumerate(zip(got, wl.lengths, strict=True)) if g != w][:5]
        raise RuntimeError(
            f"{who} {wl.name}: responses without their forced length (index, got, asked): {bad}"
        )
    log(f"ok    {who} {wl.name}: every response has its forced length ({sum(got)} tokens)")


def bound_seconds(model: Any, wl: Workload, rate: float) -> float:
    """The workload's bandwidth bound: all requests at once (the fewest decode steps any schedule takes)."""
    weights, kv_token = long_tail.decode_sizes(model, model.dtype.itemsize)
    workload = [(len(r.prompt), r.max_new_tokens) for r in wl.requests]
    return long_tail.decode_bytes(weights, kv_token, max(wl.lengths) - 1, workload) / rate


def bench_size(args: argparse.Namespace, size: str, tmp: Path) -> tuple[list[str], float | None, str]:
    """The table rows of ``size``, the server's start-up seconds (None: SGLang skipped) and its version."""
    spec = LTG.SIZES[size]
    vocab = spec.vocab or len(build_char_tokenizer(DEFAULT_ALPHABET))
    wls = workloads(args, size, vocab)
    positions = PROMPT_LEN[1] + max(max(wl.lengths) for wl in wls) + 64
    log(f"building {size} (random weights, {args.dtype}, {positions} positions)")
    path = LTG.build(spec, tmp / size, getattr(torch, args.dtype), args.device, positions)
    _free_cuda()
    server: SGLangServer | None = None
    client: SGLangClient | None = None
    startup, version, rows = None, "skipped", []
    try:
        if args.sglang:
            server, startup = launch_server(
                args, path, f"sglang-{size}", args.dtype, ("--skip-tokenizer-init",)
            )
            client = SGLangClient(server.url, timeout_s=args.request_timeout, name=f"sglang-{size}")
            version = client.protocol.version
            info = client.endpoint.request("GET", "/server_info")
            keys = ("max_total_num_tokens", "max_running_requests", "cuda_graph_max_bs_decode")
            shown = {k: info.get(k) for k in keys} if isinstance(info, dict) else info
            log(f"SGLang {version}: {shown}")
        log(f"loading the built-in engine ({size}, {args.device})")
        core = GenerationCore(
            path,
            device=args.device,
            dtype=args.dtype,
            decode="auto" if args.device == "cuda" else "static-eager",
        )
        rate = long_tail.copy_rate(args.device)
        for wl in wls:
            rows.append(measure(args, core, client, wl, rate, size))
        del core
    finally:
        if client is not None:
            client.close()
        if server is not None:
            log(f"stopping SGLang for {size} (SIGTERM, SIGKILL after {server.stop_grace_s:.0f} s)")
            server.stop()
        _free_cuda()
    return rows, startup, version


def measure(
    args: argparse.Namespace,
    core: GenerationCore,
    client: SGLangClient | None,
    wl: Workload,
    rate: float,
    size: str,
) -> str:
    total = sum(wl.lengths)
    log(f"== {size} {wl.name}: {len(wl.requests)} requests, {total} tokens, {wl.slots} slots")
    ours = run_builtin(core, wl, args.device)
    check_lengths("built-in", wl, ours)
    bound = bound_seconds(core.model, wl, rate)
    steps = core.last_slot_stats.steps if core.last_slot_stats else 0
    theirs: Timing | None = None
    if client is not None:
        theirs = run_sglang(client, wl, args.device)
        check_lengths("SGLang", wl, theirs)
        same = sum(a == b for a, b in zip(ours.tokens, theirs.tokens, strict=True))
        log(f"info  {args.dtype}: {same}/{len(wl.requests)} responses equal between the two engines")
    sg = "-" if theirs is None else f"{total / theirs.seconds:.0f}"
    ratio = "-" if theirs is None else f"{theirs.seconds / ours.seconds:.2f}x"
    sg_bound = "-" if theirs is None else f"{theirs.seconds / bound:.1f}x"
    return (
        f"| {size} | {wl.name} | {len(wl.requests)} | {total} | {wl.slots} ({steps} steps) | "
        f"{ours.seconds:.2f} | {total / ours.seconds:.0f} | "
        f"{'-' if theirs is None else f'{theirs.seconds:.2f}'} | {sg} | {ratio} | {bound:.3f} | "
        f"{ours.seconds / bound:.1f}x | {sg_bound} |"
    )


def _free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default="smollm2-135m,0.82B", help=f"comma-separated, of {sorted(LTG.SIZES)}")
    p.add_argument("--workloads", default="fixed,long_tail", help="comma-separated, of fixed,long_tail")
    p.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--scale", type=float, default=1.0, help="requests and lengths times this (dry runs)")
    p.add_argument("--slots", type=int, default=0, help="the built-in engine's slots (0: per workload)")
    p.add_argument("--mem-fraction-static", type=float, default=0.35)
    p.add_argument("--deterministic", action="store_true", help="--enable-deterministic-inference (slower)")
    p.add_argument("--command", default=None, help="replaces `python -m sglang.launch_server`")
    p.add_argument("--extra-args", default="", help="added to the server's arguments")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=300.0, help="bounds each HTTP call")
    p.add_argument(
        "--logs", default=None, help="folder for the server logs (default: a new one under /tmp, kept)"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.sizes = [s for s in args.sizes.split(",") if s]
    args.workloads = [w for w in args.workloads.split(",") if w]
    if not args.sizes or any(s not in LTG.SIZES for s in args.sizes):
        p.error(f"--sizes: names from {sorted(LTG.SIZES)}, got {args.sizes}")
    if not args.workloads or any(w not in ("fixed", "long_tail") for w in args.workloads):
        p.error(f"--workloads: names from fixed,long_tail; got {args.workloads}")
    if not 0 < args.scale <= 1:
        p.error(f"--scale must be in (0, 1], got {args.scale}")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.sglang = bool(args.command) or importlib.util.find_spec("sglang") is not None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/triton")  # kept between launches on the GPU machine
    if args.device == "cpu":
        torch.set_num_threads(1)
    if not args.sglang:
        log("SGLang is not importable here and no --command was given: the SGLang side is skipped")
    rows, startups = [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args.logs = args.logs or tempfile.mkdtemp(prefix="sglang-speed-logs-")  # kept after the run
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            for size in args.sizes:
                got, startup, version = bench_size(args, size, Path(tmp))
                rows += got
                startups.append(f"| {size} | {version} | {'-' if startup is None else f'{startup:.1f}'} |")
    except Exception as exc:  # every failure is a non-zero exit, with its reason
        traceback.print_exc()
        log(f"FAILED: {type(exc).__name__}: {exc}")
        return 1
    report(args, rows, startups)
    return 0


def report(args: argparse.Namespace, rows: list[str], startups: list[str]) -> None:
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else LTG.machine(args.device)
    mode = "deterministic inference" if args.deterministic else "default (non-deterministic) inference"
    lines = [
        f"{datetime.date.today().isoformat()}, {gpu}, {args.dtype}, SGLang {mode}, greedy, eos ignored",
        f"command: `{shlex.join([sys.executable, *sys.argv])}`",
        "",
        "| size | workload | requests | tokens | built-in slots | built-in s | built-in tok/s | SGLang s "
        "| SGLang tok/s | built-in / SGLang tok/s | bound s | built-in / bound | SGLang / bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "| size | SGLang version | SGLang start-up s (launch to /health) |",
        "|---|---|---|",
        *startups,
    ]
    text = "\n".join(lines) + "\n"
    print("\n" + text, flush=True)
    if args.out:
        Path(args.out).write_text(text)
        log(f"table written to {args.out}")


if __name__ == "__main__":
    sys.exit(main())
