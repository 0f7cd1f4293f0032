"""Generation of long-tailed response lengths: continuous batching against static batches and ``generate``.

Requests get response lengths drawn from a lognormal distribution (median ``--median``, clipped to
``[1, --max]``), forced through each request's ``max_new_tokens`` with eos ignored, greedy, on a
randomly initialised Llama model built from a config (``--size``) or loaded from ``--model``. Three
ways to serve the same requests, on CUDA each timed after an untimed warm-up (the engine's: a full run,
which captures its graphs; ``generate``'s: a short call):

- ``continuous``: ``GenerationCore.generate_requests`` with ``--slots`` rows (a finished request
  leaves, a waiting one takes its slot every ``--refill-every`` decode steps);
- ``static``: the same engine, one ``generate`` call per ``--slots`` requests in arrival order, each
  running to its batch's longest response;
- ``transformers``: ``model.generate`` on the same batches (left-padded, also to the longest).

Printed per way: wall seconds, tokens/s (the requested tokens over the wall time), continuous's
speed-up over it, decode steps, the slot idle share (the share of slot-steps spent on finished rows
or empty slots), and the memory-bandwidth bound: what the decode steps must read (every weight once
per step, plus each kept token's keys and values over its context) over a device-to-device copy's
rate measured in the same run, and the wall time over it; then continuous's prefill forwards (the
prompts that take free slots at one refill share them). Checks: every output has its forced
length; in float32 the three ways give the same tokens. Exits non-zero on any failure.

    python packages/rollout/benchmarks/long_tail_generate.py --device cpu --requests 16 --median 20 --max 64
    python packages/rollout/benchmarks/long_tail_generate.py                       # CUDA: 0.82B, 256 requests
    python packages/rollout/benchmarks/long_tail_generate.py --size smollm2-135m --slots 128
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from ppo_rollout.config import SamplingConfig
from ppo_rollout.engine.continuous import GenerationRequest
from ppo_rollout.engine.core import GenerationCore
from ppo_rollout.engine.static_decode import batch_bucket
from ppo_rollout.testing import long_tail
from ppo_rollout.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer


@dataclass(frozen=True)
class Size:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int  # 0: the char tokenizer's vocabulary (model.tiny's)
    tied: bool


SIZES = {
    # SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M config.json).
    "smollm2-135m": Size(576, 1536, 30, 9, 3, 49152, tied=True),
    # The 0.82B model.tiny config of packages/ppo_driver/benchmarks/gpu_budget.py (its MODEL).
    "0.82B": Size(2048, 5632, 16, 16, 16, 0, tied=False),
    "tiny": Size(64, 128, 2, 4, 4, 0, tied=False),
}


class CheckFailed(RuntimeError):
    pass


def check(ok: bool, what: str) -> None:
    print(("ok    " if ok else "FAILED") + " " + what, flush=True)
    if not ok:
        raise CheckFailed(what)


def build(size: Size, folder: Path, dtype: torch.dtype, device: str, max_positions: int) -> Path:
    config = LlamaConfig(
        vocab_size=size.vocab or len(build_char_tokenizer(DEFAULT_ALPHABET)),
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,  # ignored: every response runs to its forced length
        pad_token_id=0,
        tie_word_embeddings=size.tied,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model: Any = LlamaForCausalLM(config)
        model = model.to(dtype)
    model.save_pretrained(folder)
    del model
    return folder


def prompts(count: int, low: int, high: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed + 1)
    sizes = torch.randint(low, high + 1, (count,), generator=g).tolist()
    return [(1, *torch.randint(4, vocab, (n - 1,), generator=g).tolist()) for n in sizes]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(device: str, fn: Callable[[], Any]) -> tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def decode_bytes(model: Any, steps: int, requests: Sequence[GenerationRequest]) -> int:
    """What ``steps`` decode steps of ``model`` must read at least for ``requests``
    (``ppo_rollout.testing.long_tail.decode_bytes``)."""
    weights, kv_token = long_tail.decode_sizes(model, model.dtype.itemsize)
    workload = [(len(r.prompt), r.max_new_tokens) for r in requests]
    return long_tail.decode_bytes(weights, kv_token, steps, workload)


def hf_generate(model: Any, batch: Sequence[GenerationRequest], new_tokens: int) -> list[list[int]]:
    width = max(len(r.prompt) for r in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(batch):
        ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt)
        mask[i, width - len(r.prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return [row[width : width + r.max_new_tokens] for row, r in zip(out.tolist(), batch, strict=True)]


@dataclass(frozen=True)
class Run:
    name: str
    seconds: float
    steps: int
    idle: float
    tokens: list[list[int]]
    prefills: int | None = None  # prefill forwards (continuous only: a refill's prompts share them)
    # Set when only some batches ran (--hf-budget-s): the seconds are projected from them, not measured.
    measured_batches: tuple[int, int] | None = None


def run_continuous(core: GenerationCore, requests: list[GenerationRequest], args: argparse.Namespace) -> Run:
    greedy = SamplingConfig(temperature=0.0, ignore_eos=True)
    seconds, outs = timed(
        args.device,
        lambda: core.generate_requests(
            requests, greedy, max_running=args.slots, refill_every=args.refill_every
        ),
    )
    stats = core.last_slot_stats
    assert stats is not None  # set by every generate_requests call
    tokens = [list(o.token_ids) for o in outs]
    return Run("continuous", seconds, stats.steps, stats.idle_share, tokens, stats.prefills)


def batches(requests: list[GenerationRequest], size: int) -> list[list[GenerationRequest]]:
    return [requests[i : i + size] for i in range(0, len(requests), size)]


def batch_stats(requests: list[GenerationRequest], size: int) -> tuple[int, float]:
    """(decode steps, idle share) of static batches of ``size``: each runs to its longest request."""
    steps, slot_steps, busy = 0, 0, 0
    for batch in batches(requests, size):
        n = max(r.max_new_tokens for r in batch) - 1
        steps += n
        slot_steps += batch_bucket(len(batch)) * n
        busy += sum(r.max_new_tokens - 1 for r in batch)
    return steps, (1.0 - busy / slot_steps if slot_steps else 0.0)


def run_static(core: GenerationCore, requests: list[GenerationRequest], args: argparse.Namespace) -> Run:
    def go() -> list[list[int]]:
        out = []
        for batch in batches(requests, args.slots):
            longest = max(r.max_new_tokens for r in batch)
            sampling = SamplingConfig(temperature=0.0, max_new_tokens=longest, ignore_eos=True)
            made = core.generate([list(r.prompt) for r in batch], sampling)
            out += [list(o.token_ids[: r.max_new_tokens]) for o, r in zip(made, batch, strict=True)]
        return out

    seconds, tokens = timed(args.device, go)
    steps, idle = batch_stats(requests, args.slots)
    return Run("static batches", seconds, steps, idle, tokens)


def run_hf(core: GenerationCore, requests: list[GenerationRequest], args: argparse.Namespace) -> Run:
    """transformers ``generate`` over the static batches; with ``--hf-budget-s``, once the batches run so
    far project past the budget (by their decode steps), the rest are left out and the time is projected
    from the measured ones, so a slower card reports a projection instead of being killed."""
    todo = batches(requests, args.slots)
    lengths = [max(r.max_new_tokens for r in batch) for batch in todo]
    out: list[list[int]] = []
    spent, done = 0.0, 0
    for batch, length in zip(todo, lengths, strict=True):
        seconds, made = timed(args.device, lambda b=batch, n=length: hf_generate(core.model, b, n))
        out += made
        spent, done = spent + seconds, done + 1
        projected = spent / sum(lengths[:done]) * sum(lengths)
        if args.hf_budget_s is not None and done < len(todo) and projected > args.hf_budget_s:
            steps, idle = batch_stats(requests, args.slots)
            return Run("transformers generate", projected, steps, idle, [], None, (done, len(todo)))
    steps, idle = batch_stats(requests, args.slots)
    return Run("transformers generate", spent, steps, idle, out)


WAYS: dict[str, Callable[[GenerationCore, list[GenerationRequest], argparse.Namespace], Run]] = {
    "continuous": run_continuous,
    "static": run_static,
    "transformers": run_hf,
}


def machine(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")
        )
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{model}, {torch.get_num_threads()} threads"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--size", default=None, choices=sorted(SIZES), help="default: 0.82B on CUDA, tiny on CPU"
    )
    parser.add_argument("--model", default=None, help="a model folder instead of --size (its weights)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--median", type=float, default=300.0)
    parser.add_argument("--max", type=int, default=2048)
    parser.add_argument("--sigma", type=float, default=1.0, help="the lognormal's sigma (its tail)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    parser.add_argument("--slots", type=int, default=64, help="continuous slots and static batch size")
    parser.add_argument("--refill-every", type=int, default=8)
    parser.add_argument("--skip-hf", action="store_true", help="leave out transformers generate")
    parser.add_argument(
        "--hf-budget-s",
        type=float,
        default=None,
        help="stop transformers generate once its projected time passes this; report the projection",
    )
    parser.add_argument(
        "--ways",
        default="continuous,static,transformers",
        help="comma-separated ways to time, continuous first (the speed-ups are over it)",
    )
    parser.add_argument(
        "--attention",
        default=None,
        choices=["ranged", "matmul", "sdpa"],
        help="the engine's decode attention (default: the engine's own, ranged where its kernel runs)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads; default 1 on CPU (a tiny model's matmuls gain nothing from more, and on "
        "a busy machine OpenMP's waiting threads made them 50x slower)",
    )
    args = parser.parse_args()
    args.ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    if args.skip_hf:
        args.ways = [w for w in args.ways if w != "transformers"]
    unknown = [w for w in args.ways if w not in WAYS]
    if unknown or not args.ways or args.ways[0] != "continuous":
        parser.error(f"--ways: names from {sorted(WAYS)}, continuous first; got {args.ways}")
    args.size = args.size or ("0.82B" if args.device == "cuda" else "tiny")
    threads = args.threads or (1 if args.device == "cpu" else None)
    if threads is not None:
        torch.set_num_threads(threads)
    if args.device == "cpu" and args.size != "tiny" and args.model is None:
        print("note: --size on CPU builds the full model; --size tiny is the CPU dry run", flush=True)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            return bench(args, dtype, Path(tmp))
    except CheckFailed:
        return 1
    except Exception as exc:  # any failure is a non-zero exit, with the reason
        print(f"FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise


def bench(args: argparse.Namespace, dtype: str, tmp: Path) -> int:
    device = args.device
    positions = args.prompt_len[1] + args.max + 64
    if args.model is not None:
        path = Path(args.model)
        label = f"{path.name} ({AutoConfig.from_pretrained(path).model_type})"
    else:
        path = build(SIZES[args.size], tmp / "model", getattr(torch, dtype), device, positions)
        label = args.size
    mode = "auto" if device == "cuda" else "static-eager"
    core = GenerationCore(path, device=device, dtype=dtype, decode=mode)
    if args.attention is not None:
        core._continuous_decoder().attention = args.attention  # before any call: no graphs captured yet
    drawn = long_tail.lognormal_lengths(args.requests, args.median, args.max, args.sigma, args.seed)
    low, high = args.prompt_len
    requests = [
        GenerationRequest(p, n, seed=i)
        for i, (p, n) in enumerate(
            zip(prompts(args.requests, low, high, core.vocab_size, args.seed), drawn, strict=True)
        )
    ]
    total = sum(drawn)
    params = sum(p.numel() for p in core.model.parameters())
    print(
        f"== {label}: {params / 1e9:.3f}B parameters, {dtype}, {device} ({machine(device)}), "
        f"{len(requests)} requests, {total} tokens (median {sorted(drawn)[len(drawn) // 2]}, "
        f"max {max(drawn)}), {args.slots} slots, refill every {args.refill_every}",
        flush=True,
    )
    ways = [WAYS[name] for name in args.ways]
    if device == "cuda":
        # Untimed: the engine's graph capture for every KV bucket (a full run of each of its ways), and
        # generate's one-off set-up (a short call: a full one would double the longest part of the run).
        for way in ways:
            if way is run_hf:
                hf_generate(core.model, requests[:8], 4)
            else:
                way(core, requests, args)
    rate = long_tail.copy_rate(device)
    runs = [way(core, requests, args) for way in ways]
    for run in runs:
        if run.measured_batches is None:
            check([len(t) for t in run.tokens] == drawn, f"{run.name}: every response has its forced length")
    compared = [run for run in runs[1:] if run.measured_batches is None]
    if dtype == "float32":
        for run in compared:
            same = sum(a == b for a, b in zip(runs[0].tokens, run.tokens, strict=True))
            check(
                same == len(requests),
                f"float32: continuous gives {run.name}'s tokens ({same}/{len(requests)})",
            )
    else:
        for run in compared:
            same = sum(a == b for a, b in zip(runs[0].tokens, run.tokens, strict=True))
            print(f"info  {dtype}: {same}/{len(requests)} responses equal to {run.name}'s", flush=True)
    date = datetime.date.today().isoformat()
    print(f"\n{date}, {machine(device)}, {label}, {dtype}, device copy {rate / 1e9:.1f} GB/s\n")
    print(
        "| way | wall s | tokens/s | continuous's speed-up | decode steps | slot idle share "
        "| bandwidth bound s | wall / bound |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ours = runs[0].seconds
    for run in runs:
        bound = decode_bytes(core.model, run.steps, requests) / rate
        name = run.name
        if run.measured_batches is not None:
            name += " (projected from {} of {} batches)".format(*run.measured_batches)
        print(
            f"| {name} | {run.seconds:.2f} | {total / run.seconds:.0f} | {run.seconds / ours:.2f}x | "
            f"{run.steps} | {run.idle:.1%} | {bound:.3f} | {run.seconds / bound:.1f}x |",
            flush=True,
        )
    for run in runs:
        if run.prefills is not None:
            print(f"\n{run.name}: {run.prefills} prefill forwards for {len(requests)} requests", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
