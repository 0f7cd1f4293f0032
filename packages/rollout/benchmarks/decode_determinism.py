"""Does the built-in engine give the same samples for the same seed twice on one GPU? Which kernel breaks it?

    python packages/rollout/benchmarks/decode_determinism.py [--size 12x1024] [--tokens 256]

Runs each decode path (the per-token loop and the static/graph path) twice with one seed in one
process, after a full-size warm-up, and compares the samples. When two runs differ, it runs the loop
again with a fingerprint of every module's output at every call (a bitwise integer sum, kept on the GPU
until the end) and names the first module whose output differs between two runs with identical
inputs: that module's kernel is what makes the run nondeterministic. Then it repeats the comparison
under ``torch.use_deterministic_algorithms(True)`` (with ``CUBLAS_WORKSPACE_CONFIG=:4096:8``) to show
whether torch's deterministic mode removes the difference. Exits 1 when any path differs from itself
in the default mode (so a GPU run fails loudly), 0 when every path repeats itself bit for bit.

Measured on one H200 (torch 2.11.0+cu130, 2026-12-02): the loop repeated 153-160 of 256 samples; the
first differing output was an ``o_proj``, so the attention kernel before it; run under one SDPA
backend at a time, cuDNN attention repeated 164/256 and the memory-efficient and math kernels 256/256.
Both decode paths now leave cuDNN attention out (``decode_graphs.SDPA_BACKENDS``): 256/256 each, with
and without torch's deterministic mode.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed before cuBLAS starts, if asked for

import torch
from gpu_generate import SIZES, build, make_prompts

from ppo_rollout.config import SamplingConfig
from ppo_rollout.engine.core import GenerationCore


def integer_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A sum of the raw bits (as int64) of a float tensor: equal only for bitwise-equal values (whp)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype in (torch.bfloat16, torch.float16):
        bits = flat.view(torch.int16).to(torch.int64)
    elif flat.dtype == torch.float32:
        bits = flat.view(torch.int32).to(torch.int64)
    else:
        bits = flat.to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64) % 1_000_003
    return (bits * weights).sum()


@contextmanager
def fingerprints(model: torch.nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Record ``(module name, fingerprint)`` for every module call, in call order."""
    seen: list[tuple[str, torch.Tensor]] = []
    handles = []
    for name, module in model.named_modules():

        def hook(_m: torch.nn.Module, _args: object, out: object, name: str = name) -> None:
            first = out[0] if isinstance(out, tuple) else out
            if isinstance(first, torch.Tensor) and first.is_floating_point():
                seen.append((name or "<model>", integer_fingerprint(first)))

        handles.append(module.register_forward_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def first_difference(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> str:
    if len(a) != len(b):
        return f"different number of module calls ({len(a)} vs {len(b)})"
    fa = torch.stack([x for _, x in a]).cpu()
    fb = torch.stack([x for _, x in b]).cpu()
    diff = (fa != fb).nonzero()
    if diff.numel() == 0:
        return "no module output differs"
    i = int(diff[0, 0])
    return f"first differing output: call {i} of {len(a)}, module {a[i][0]!r}"


def samples(
    core: GenerationCore, prompts: list[list[int]], sampling: SamplingConfig
) -> list[tuple[int, ...]]:
    return [tuple(o.token_ids) for o in core.generate(prompts, sampling)]


def compare_paths(path: Path, prompts: list[list[int]], sampling: SamplingConfig, label: str) -> bool:
    same_everywhere = True
    for decode in ("loop", "auto"):
        core = GenerationCore(path, device="cuda", dtype="bfloat16", decode=decode)
        samples(core, prompts, sampling)  # warm-up (and graph capture for "auto")
        first, second = samples(core, prompts, sampling), samples(core, prompts, sampling)
        equal = sum(x == y for x, y in zip(first, second, strict=True))
        ok = equal == len(first)
        same_everywhere &= ok
        print(f"{'ok    ' if ok else 'DIFFER'} {label}, decode={decode}: {equal}/{len(first)} samples repeat")
        if not ok and decode == "loop":
            with fingerprints(core.model) as run_a:
                samples(core, prompts, sampling)
            with fingerprints(core.model) as run_b:
                samples(core, prompts, sampling)
            print(f"       {label}, decode=loop: {first_difference(run_a, run_b)}")
        del core
        torch.cuda.empty_cache()
    return same_everywhere


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="12x1024", choices=sorted(SIZES))
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("FAILED: no CUDA device", file=sys.stderr)
        return 1
    size = SIZES[args.size]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, size {args.size}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = build(size, Path(tmp) / args.size, torch.bfloat16, "cuda")
        vocab = size.vocab or 20
        prompts = make_prompts(size, vocab)
        sampling = SamplingConfig(
            temperature=1.0, max_new_tokens=args.tokens, n_samples_per_prompt=size.samples, seed=3
        )
        default_ok = compare_paths(path, prompts, sampling, "default kernels")
        torch.use_deterministic_algorithms(True, warn_only=True)
        compare_paths(path, prompts, sampling, "torch deterministic algorithms")
    return 0 if default_ok else 1


if __name__ == "__main__":
    sys.exit(main())
