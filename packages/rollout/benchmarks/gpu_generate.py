"""The built-in engine's generation core against transformers' ``generate`` on one GPU, with checks.

Exits non-zero when anything fails: a check below, or the CUDA-graph path not being taken.

1. Exactness, float32 (a 4-layer model, ragged prompts, a batch that is padded into its bucket), for
   each decoder variant (attention sdpa/matmul, fused; matmul unfused): greedy tokens equal
   ``generate``'s token for token; sampled tokens (temperature, top-k/top-p, stop tokens) equal the
   pre-graph decode loop's (``decode="loop"``) for the same seed; log-probs within 1e-4.
2. Per size, bfloat16, 256 samples (32 prompts x 8) of 256 tokens, no stop token:
   - greedy against the decode loop (the engine before the static path): every sample equal token for
     token, or its first difference at a near-tie: a forward pass over the common prefix puts the two
     tokens' logits within 2^-4 of the largest |logit| (the order of bf16 rounding between two correct
     computations; the teacher-forced log-prob difference is printed as a measure of it);
   - sampled (temperature 1) against the decode loop, same seed: the share of identical samples is
     printed (not checked: in bf16 a rounding difference anywhere changes every later draw);
   - the decode attentions "ranged" (each row over its own cache columns: the default where its
     Triton kernel runs), "matmul" and "sdpa" (over the step's KV bucket with a mask), with the fused
     decoder (the default: fused RMSNorm, rolled rotary, joint q/k; see ``static_decode``), and
     "matmul" with the unfused one (``fused=False``, the forward before it), for the fused decoder's
     speed-up in the same run;
   - the memory-bandwidth bound: the bytes decoding must read (every weight once per token step, each
     sample's keys and values over its context) over a device-to-device copy's bytes a second, measured
     in the same run, and the engine's time over it;
   - tokens/s: our engine (best of 2, graphs already captured by a warm-up call; the first call, which
     captures them, is printed too), ``generate`` and the old decode loop (both after a full-size
     warm-up of the loop); the fused decoder's tokens/s over the unfused one's (matmul attention);
   - on CUDA, milliseconds per decode-graph replay by KV bucket, for each variant, and the fused
     decoder's step time over the unfused one's, bucket by bucket.

    python packages/rollout/benchmarks/gpu_generate.py             # both sizes
    python packages/rollout/benchmarks/gpu_generate.py --sizes tiny --device cpu   # a local dry run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ppo_rollout.config import SamplingConfig
from ppo_rollout.engine import ranged_attention
from ppo_rollout.engine.core import GenerationCore, GenerationOutput
from ppo_rollout.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int  # 0: the char tokenizer's vocabulary (model.tiny's)
    prompts: int
    samples: int
    new_tokens: int
    prompt_len: tuple[int, int]


SIZES = {
    # The sizes: 12 layers hidden 1024 with a 32k vocabulary (the 0.62x measurement), and the
    # 0.82B model.tiny config of the 2xH200 runs.
    "12x1024": Size(1024, 12, 16, 2816, 32000, 32, 8, 256, (16, 64)),
    "0.82B": Size(2048, 16, 16, 5632, 0, 32, 8, 256, (16, 64)),
    # Local dry runs.
    "tiny": Size(64, 2, 4, 128, 0, 4, 4, 24, (4, 12)),
}
EXACT = Size(256, 4, 4, 704, 1000, 10, 5, 48, (4, 20))  # 50 rows: padded to a 64-row bucket


class CheckFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class Variant:
    """A static-decoder setting: decode attention and fused (the default) or not."""

    attention: str
    fused: bool

    @property
    def label(self) -> str:
        return f"{self.attention}, {'fused' if self.fused else 'unfused'}"


# The unfused row is the fused matmul row's baseline: the same attention, the forward before fusing.
UNFUSED = Variant("matmul", fused=False)
FUSED = Variant("matmul", fused=True)
RANGED = Variant("ranged", fused=True)  # the default where the Triton kernel runs (CUDA)
VARIANTS = (Variant("sdpa", fused=True), FUSED, UNFUSED)


def variants(device: str) -> tuple[Variant, ...]:
    """The settings to time on ``device``: the ranged kernel's first where it runs."""
    return ((RANGED,) if ranged_attention.available(torch.device(device)) else ()) + VARIANTS


def decode_mode(device: str) -> tuple[str, str]:
    """(GenerationCore's decode argument, the path it must take): graphs on CUDA; on a CPU dry run the
    same static decoder, eagerly."""
    return ("auto", "cuda-graphs") if device == "cuda" else ("static", "static-eager")


def check(ok: bool, what: str) -> None:
    print(("ok    " if ok else "FAILED") + " " + what, flush=True)
    if not ok:
        raise CheckFailed(what)


def build(size: Size, folder: Path, dtype: torch.dtype, device: str) -> Path:
    vocab = size.vocab or len(build_char_tokenizer(DEFAULT_ALPHABET))
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.heads,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=None,  # every sample runs to new_tokens, in both generators
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: 0.82B parameters take minutes on a CPU
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    del model
    return folder


def make_prompts(size: Size, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lo, hi = size.prompt_len
    lens = torch.randint(lo, hi + 1, (size.prompts,), generator=g).tolist()
    return [[1, *torch.randint(4, vocab, (n - 1,), generator=g).tolist()] for n in lens]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Any) -> tuple[float, Any]:
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def copy_bandwidth(device: str) -> float:
    """Bytes a second one device-to-device copy moves (its read plus its write), best of 5 over 1 GiB:
    the memory's practical limit, measured in the same run as the engine."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(timed(lambda: dst.copy_(src))[0] for _ in range(5))
    return 2 * src.numel() / best


def decode_bytes(size: Size, params: int, prompts: list[list[int]], dtype_bytes: int) -> int:
    """What decoding must read from memory at least: ``params`` weights once per step, and each sample's
    keys and values over its context so far (prompt plus tokens made), every layer. Prefill's compute
    and the logits' and activations' traffic come on top: a lower bound on the bytes."""
    head_dim = size.hidden // size.heads
    kv_per_token = 2 * size.layers * size.heads * head_dim * dtype_bytes  # keys and values, every layer
    new = size.new_tokens
    contexts = sum(size.samples * (new * len(p) + new * (new - 1) // 2) for p in prompts)
    return new * params * dtype_bytes + contexts * kv_per_token


def hf_generate(
    model: Any, rows: list[list[int]], new_tokens: int, greedy: bool, logits: bool = False
) -> tuple[list[list[int]], list[torch.Tensor]]:
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    dev = model.device
    kwargs: dict[str, Any] = (
        {"do_sample": False}
        if greedy
        else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_new_tokens": new_tokens}
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            max_new_tokens=new_tokens,
            pad_token_id=0,
            eos_token_id=None,
            return_dict_in_generate=True,
            output_logits=logits,
            **kwargs,
        )
    seqs = out.sequences[:, width:].tolist()
    return seqs, list(out.logits) if logits else []


def greedy_vs_loop(
    core: GenerationCore,
    prompts: list[list[int]],
    ours: list[GenerationOutput],
    ref: list[GenerationOutput],
    n: int,
    what: str,
) -> str:
    """Every sample equal, or first differing at a near-tie: where a forward pass over the common
    prefix puts the two tokens' logits within 2^-4 of its largest |logit| (8 bf16 steps of it)."""
    equal = near_tie = 0
    worst = 0.0
    for i, (o, r) in enumerate(zip(ours, ref, strict=True)):
        mine, theirs = list(o.token_ids), list(r.token_ids)
        if mine == theirs:
            equal += 1
            continue
        t = next((j for j, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), None)
        if t is None:
            check(False, f"{what}: sample {i} has {len(mine)} tokens, the loop {len(theirs)}")
            return ""
        prefix = torch.tensor([prompts[i // n] + mine[:t]], device=core.device)
        with torch.inference_mode():
            row = core.model(input_ids=prefix).logits[0, -1].float()
        gap = float((row[mine[t]] - row[theirs[t]]).abs())
        scale = float(row.abs().max())
        worst = max(worst, gap / max(scale, 1e-6))
        if gap > scale / 16:
            check(
                False,
                f"{what}: sample {i} differs at token {t} ({mine[t]} vs {theirs[t]}) where their logits are "
                f"{gap:.4g} apart, over 2^-4 of the largest |logit| {scale:.4g}",
            )
        near_tie += 1
    return f"{equal}/{len(ref)} identical, {near_tie} part at a near-tie (largest gap/|logit| {worst:.4f})"


def logp_noise(core: GenerationCore, prompts: list[list[int]], outs: list[GenerationOutput], n: int) -> float:
    """Largest |log-prob difference| between the engine's and a full forward's (teacher-forced), over
    the first 16 samples: the size of bf16 rounding differences between the two computations."""
    worst = 0.0
    with torch.inference_mode():
        for i, o in enumerate(outs[:16]):
            prompt = prompts[i // n]
            ids = torch.tensor([prompt + list(o.token_ids)], device=core.device)
            logp = torch.log_softmax(core.model(input_ids=ids).logits[0].float(), -1)
            ref = logp[len(prompt) - 1 : len(prompt) - 1 + len(o.token_ids)].gather(
                -1, torch.tensor(o.token_ids, device=core.device)[:, None]
            )[:, 0]
            worst = max(worst, float((ref.cpu() - torch.tensor(o.log_probs)).abs().max()))
    return worst


def exactness(folder: Path, device: str) -> None:
    """float32, both decode attentions: greedy == generate; sampled == the decode loop, same seed."""
    path = build(EXACT, folder / "exact", torch.float32, device)
    mode, expected = decode_mode(device)
    core = GenerationCore(path, device=device, dtype="float32", decode=mode)
    loop = GenerationCore(path, device=device, dtype="float32", decode="loop")
    prompts = make_prompts(EXACT, EXACT.vocab)
    n, new = EXACT.samples, EXACT.new_tokens
    rows = [p for p in prompts for _ in range(n)]
    ref, _ = hf_generate(core.model, rows, new, greedy=True)
    looped = {}
    for variant in variants(device):
        set_variant(core, variant)
        what = variant.label
        greedy = core.generate(
            prompts, SamplingConfig(temperature=0.0, max_new_tokens=new, n_samples_per_prompt=n)
        )
        check(
            core.last_decode_path == expected,
            f"exact, {what}: decode path {core.last_decode_path} (graph failure: {core.graph_failure})",
        )
        check(
            [list(o.token_ids) for o in greedy] == ref,
            f"exact (float32), {what}: greedy tokens equal transformers generate's for all 50 samples",
        )
        for s in (
            SamplingConfig(temperature=1.0, max_new_tokens=new, n_samples_per_prompt=n, seed=7),
            SamplingConfig(
                temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=new, n_samples_per_prompt=n, seed=8
            ),
            SamplingConfig(
                temperature=1.0, max_new_tokens=new, n_samples_per_prompt=n, seed=9, stop_token_ids=(5, 6)
            ),
        ):
            a = core.generate(prompts, s)
            b = looped.setdefault(s.seed, loop.generate(prompts, s))
            same = [
                (x.token_ids, x.finish_reason) == (y.token_ids, y.finish_reason)
                for x, y in zip(a, b, strict=True)
            ]
            err = max(
                max((abs(u - v) for u, v in zip(x.log_probs, y.log_probs, strict=True)), default=0.0)
                for x, y in zip(a, b, strict=True)
                if x.token_ids == y.token_ids
            )
            label = f"{what}, T={s.temperature} top_k={s.top_k} top_p={s.top_p} stop={s.stop_token_ids}"
            check(all(same), f"exact (float32), {label}: {sum(same)}/{len(same)} samples equal the loop's")
            check(err < 1e-4, f"exact (float32), {label}: log-probs within {err:.2e} of the loop's")


def set_variant(core: GenerationCore, variant: Variant) -> None:
    """Switches the static decoder's attention and fusing (benchmark-only knobs; graphs are recaptured)."""
    if core._decoder is not None:
        core.drop_decode_state()
        core._decoder.attention = variant.attention
        core._decoder.fused = variant.fused


@torch.inference_mode()
def step_ms(core: GenerationCore) -> dict[str, float]:
    """Milliseconds per replay of each kept decode graph, by "T=<temperature> kv <KV bucket>": where a
    step's time goes as the attended cache grows. Diagnostic only: it rewinds the kept buffers to
    column 0 first."""
    graphs = core._graphs
    if graphs is None or graphs.buffers is None or not graphs._graphs:
        return {}
    b = graphs.buffers
    times = {}
    for (kv_len, key), graph in sorted(graphs._graphs.items(), key=lambda kv: (str(kv[0][1]), kv[0][0])):
        b.col.zero_()
        b.step.zero_()
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            graph.replay()
        sync()
        times[f"T={key[0]} kv {kv_len}"] = (time.perf_counter() - t0) * 100
    return times


def step_ratios(fused: dict[str, float], unfused: dict[str, float]) -> str:
    """The fused decoder's step time over the unfused one's, per KV bucket both captured."""
    common = [k for k in fused if k in unfused]
    if not common:
        return "no graphs to compare"
    return ", ".join(
        f"{k}: {fused[k]:.2f} vs {unfused[k]:.2f} ms ({fused[k] / unfused[k]:.2f}x)" for k in common
    )


def bench(name: str, size: Size, folder: Path, device: str) -> list[tuple[str, ...]]:
    dtype = "bfloat16" if device == "cuda" else "float32"
    path = build(size, folder / name, getattr(torch, dtype), device)
    mode, expected = decode_mode(device)
    core = GenerationCore(path, device=device, dtype=dtype, decode=mode)
    loop = GenerationCore(path, device=device, dtype=dtype, decode="loop")
    params = sum(p.numel() for p in core.model.parameters())
    vocab = core.vocab_size
    prompts = make_prompts(size, vocab)
    n, new = size.samples, size.new_tokens
    rows = [p for p in prompts for _ in range(n)]
    tokens = len(rows) * new
    sample = SamplingConfig(temperature=1.0, max_new_tokens=new, n_samples_per_prompt=n, seed=3)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=new, n_samples_per_prompt=n)
    print(
        f"\n== {name}: {params / 1e9:.2f}B parameters, vocab {vocab}, {len(rows)} x {new} tokens", flush=True
    )

    # Warm-up at full size: the first Hugging Face forward over each new cache length pays a one-off
    # setup (measured on the H200: whichever of generate and the loop ran first took 14-19 s, the
    # other 2-3 s), so one untimed full-size loop run comes before both timings.
    loop_out = loop.generate(prompts, sample)
    hf_generate(core.model, rows[:8], 4, greedy=False)
    hf_s, (hf_rows, _) = timed(lambda: hf_generate(core.model, rows, new, greedy=False))
    check(all(len(r) == new for r in hf_rows), f"{name}: generate made {new} tokens per sample")
    print(f"info  {name}: generate {hf_s / new * 1000:.2f} ms per token step", flush=True)
    loop_s, again = timed(lambda: loop.generate(prompts, sample))
    check(again == loop_out, f"{name}: the decode loop gives the same samples twice")
    loop_greedy = loop.generate(prompts, greedy)

    # a step reads the input embedding's rows of its tokens only (the LM head whole: untied here)
    read = params - core.model.get_input_embeddings().weight.numel()
    bound_s = decode_bytes(size, read, prompts, core.model.dtype.itemsize) / copy_bandwidth(device)
    print(f"info  {name}: memory-bandwidth bound of the decode {bound_s:.3f} s", flush=True)
    rows_by_variant: dict[Variant, tuple[str, ...]] = {}
    tps: dict[Variant, float] = {}
    steps: dict[Variant, dict[str, float]] = {}
    for variant in variants(device):
        set_variant(core, variant)
        what = f"{name}, {variant.label}"
        first, _ = timed(lambda: core.generate(prompts, sample))  # captures the graphs
        check(
            core.last_decode_path == expected,
            f"{what}: decode path {core.last_decode_path} (graph failure: {core.graph_failure})",
        )
        runs = [timed(lambda: core.generate(prompts, sample)) for _ in range(2)]
        ours_s = min(s for s, _ in runs)
        ours_out = runs[0][1]
        check(all(len(o.token_ids) == new for o in ours_out), f"{what}: every sample has {new} tokens")
        check(runs[0][1] == runs[1][1], f"{what}: the same seed gives the same samples twice")
        same = sum(a.token_ids == b.token_ids for a, b in zip(ours_out, loop_out, strict=True))
        print(f"info  {what}: sampled, same seed: {same}/{len(rows)} samples identical to the loop's")
        if device == "cuda":
            steps[variant] = step_ms(core)
            per_bucket = ", ".join(f"{k}: {ms:.2f} ms" for k, ms in steps[variant].items()) or "no graphs"
            print(f"info  {what}: decode step per KV bucket: {per_bucket}", flush=True)
        mine = core.generate(prompts, greedy)
        verdict = greedy_vs_loop(core, prompts, mine, loop_greedy, n, what)
        print(f"ok     {what}: greedy vs the decode loop: {verdict}", flush=True)
        print(f"info  {what}: log-prob noise vs a full forward: {logp_noise(core, prompts, mine, n):.4f}")
        ours_tps, hf_tps, loop_tps = tokens / ours_s, tokens / hf_s, tokens / loop_s
        tps[variant] = ours_tps
        print(
            f"{what}: ours {ours_s:.2f} s (first call {first:.2f} s), generate {hf_s:.2f} s, "
            f"loop {loop_s:.2f} s",
            flush=True,
        )
        rows_by_variant[variant] = (
            name,
            f"{params / 1e9:.2f}B, hidden {size.hidden}, {size.layers} layers, vocab {vocab}",
            f"{len(rows)} x {new}",
            variant.label,
            f"{ours_tps:,.0f}",
            f"{hf_tps:,.0f}",
            f"{ours_tps / hf_tps:.2f}x",
            f"{loop_tps:,.0f} ({ours_tps / loop_tps:.2f}x)",
            f"{first:.2f} s",
            f"{bound_s:.3f} s ({ours_s / bound_s:.1f}x)",
        )
    speedup = tps[FUSED] / tps[UNFUSED]
    print(f"info  {name}: fused decoder over unfused (matmul): {speedup:.2f}x tokens/s", flush=True)
    if device == "cuda":
        print(f"info  {name}: decode step, fused vs unfused: {step_ratios(steps[FUSED], steps[UNFUSED])}")
    return [(*row, f"{tps[v] / tps[UNFUSED]:.2f}x") for v, row in rows_by_variant.items()]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="12x1024,0.82B")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--skip-exact", action="store_true", help="skip the float32 exactness checks")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAILED: no CUDA device", file=sys.stderr)
        return 1
    names = args.sizes.split(",")
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        print(f"FAILED: unknown sizes {unknown}; known: {sorted(SIZES)}", file=sys.stderr)
        return 2
    machine = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{machine}, torch {torch.__version__}", flush=True)
    table = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if not args.skip_exact:
                exactness(Path(tmp), args.device)
            for name in names:
                table.extend(bench(name, SIZES[name], Path(tmp), args.device))
                if args.device == "cuda":
                    torch.cuda.empty_cache()  # the last size's models and caches are gone
    except CheckFailed:
        return 1
    print(f"\n{machine}, torch {torch.__version__}, bfloat16 on CUDA, tokens/s of generated tokens\n")
    print(
        "| size | model | samples x tokens | decoder (attention, fused) | built-in engine "
        "| transformers generate | ratio | decode loop before (engine's speed-up) "
        "| first call (graph capture) | memory-bandwidth bound (engine's time over it) "
        "| over unfused (matmul) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in table:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
