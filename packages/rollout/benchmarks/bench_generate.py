"""Tokens per second: the built-in engine's generation core vs transformers' ``generate``.

Same model, same batch (left-padded prompts of mixed lengths), same sampling (temperature 1, no
top-k/top-p), every sample forced to ``--new-tokens`` tokens. Prints a markdown table.

    python benchmarks/bench_generate.py --device cpu
    python benchmarks/bench_generate.py --device cuda --preset small --dtype bfloat16
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from ppo_rollout.config import SamplingConfig
from ppo_rollout.engine.core import GenerationCore
from ppo_rollout.tasks import make_tiny_model

PRESETS = {
    # name: (hidden, layers, heads, intermediate, vocab, batch, prompt_len, new_tokens)
    "tiny": (64, 2, 4, 128, 20, 32, 8, 32),
    "medium": (256, 4, 4, 704, 1000, 16, 32, 64),
    "small": (1024, 12, 16, 2816, 32000, 64, 128, 128),
}


def build_model(preset: str, folder: Path) -> Path:
    hidden, layers, heads, inter, vocab, *_ = PRESETS[preset]
    if preset == "tiny":
        return make_tiny_model("copy", folder, seed=0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def prompts_for(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    # lengths from prompt_len/2 to prompt_len: real batches are ragged
    lens = torch.randint(max(1, prompt_len // 2), prompt_len + 1, (batch,), generator=g).tolist()
    return [[1, *torch.randint(4, vocab, (n - 1,), generator=g).tolist()] for n in lens]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_core(
    core: GenerationCore, prompts: list[list[int]], new_tokens: int, device: str
) -> tuple[float, int]:
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, seed=0)
    sync(device)
    t0 = time.perf_counter()
    outs = core.generate(prompts, sampling)
    sync(device)
    return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)


def run_hf(
    model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, device: str
) -> tuple[float, int]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    sync(device)
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
    )
    sync(device)
    return time.perf_counter() - t0, (out.shape[1] - width) * len(prompts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hidden, layers, _, _, vocab, batch, prompt_len, new_tokens = PRESETS[args.preset]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(args.preset, Path(tmp) / "model")
        core = GenerationCore(path, device=args.device, dtype=args.dtype)
        core.eos_token_ids = ()  # every sample runs to new_tokens, as min_new_tokens forces for generate()
        hf = AutoModelForCausalLM.from_pretrained(path).to(args.device, getattr(torch, args.dtype)).eval()
        prompts = prompts_for(batch, prompt_len, vocab)
        rows = []
        with torch.inference_mode():
            for name, fn, model in (
                ("built-in engine", run_core, core),
                ("transformers generate", run_hf, hf),
            ):
                fn(model, prompts[:2], 4, args.device)  # warm-up
                best = None
                for _ in range(args.repeats):
                    seconds, tokens = fn(model, prompts, new_tokens, args.device)
                    assert tokens == batch * new_tokens, (name, tokens)
                    best = seconds if best is None else min(best, seconds)
                assert best is not None
                rows.append((name, best, batch * new_tokens / best))
    dev = (
        torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    )
    print(
        f"\npreset {args.preset}: hidden {hidden}, {layers} layers, vocab {vocab}, batch {batch}, prompts "
        f"{prompt_len // 2}-{prompt_len} tokens, {new_tokens} new tokens, {args.dtype}, "
        f"{args.device} ({dev}), "
        f"torch {torch.__version__}, {args.threads} thread(s), best of {args.repeats}\n"
    )
    print("| generator | seconds | tokens/s | vs generate |")
    print("|---|---|---|---|")
    base = rows[1][2]
    for name, seconds, tps in rows:
        print(f"| {name} | {seconds:.3f} | {tps:,.0f} | {tps / base:.2f}x |")


if __name__ == "__main__":
    main()
