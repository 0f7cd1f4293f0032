"""Throughput of the compute phases: padded vs packed micro-batches vs a plain Hugging Face pass.

For one model size, on one device, in one run:

- ``logprob_forward``: ``compute_log_probs`` (the old log-prob and reference forwards; 2 N FLOPs a token);
- ``actor_train``: ``train_actor`` (old log-probs, then forward and backward per micro-batch, AdamW per
  mini-batch);
- ``critic_train``: ``train_critic`` (values, then the value loss's passes);
- ``plain HF``: ``model(input_ids, attention_mask, labels).loss.backward()`` and AdamW over the same
  tokens in padded micro-batches of the same sample count (6 N FLOPs a token): what transformers does.

Each phase runs padded (``micro_batch_size`` samples, today's path), padded with the token budget
(larger micro-batches alone), packed with the same micro-batches, and packed with a
``max_tokens_per_micro_batch`` budget for each packed attention asked for, the
variants taking turns call by call (all of a phase's trainers are resident at once). Rows: seconds
(median),
tokens/s, achieved TFLOP/s (model FLOPs, ``ppo_trainer.throughput``: what the run's metrics log), its
share of the matmul limit measured in the same run (an 8192^3 bf16 matmul on CUDA, 2048^3 float32 on
the CPU), the same share with causal attention's own FLOPs added (``attention_forward_flops``: left
out of the model FLOPs, a large part at long samples), peak working memory (CUDA: the most a call
allocated above what was resident before it, i.e. activations, logits and gradients, not the weights
and optimizer state), the first call's seconds, and its loss
(every variant starts from the same weights: packed must give the padded loss, up to bf16 rounding on
CUDA).

Sizes: ``tiny`` (the CPU smoke), ``default`` (the embedded default run's model and batch),
``cpu-small`` (a 5M-matmul-parameter model, vocabulary 8192, a CPU measurement),
``135m`` (SmolLM2-135M's shape: Llama, 30 layers, hidden 576, 9 query and
3 key-value heads, vocabulary 49 152, tied embeddings; 512 samples of about 80 tokens), ``0.82b`` (the
step budget's model: hidden 2048, 16 layers, 16 heads, MLP 5632, the copy task's small vocabulary;
256 samples of 16 prompt + 256 response tokens). Weights are random (a config-only folder).

Long samples: ``--sample-tokens N`` makes every sample ``N`` tokens long (its response fills what its
prompt leaves), ``--median M`` (with ``--sigma``) draws the responses from the lognormal
distribution the rollout benchmarks use instead (``lognormal_lengths`` below, the same draws as
``ppo_rollout.testing.long_tail``'s), each cut to ``N``
tokens with its prompt, ``--samples`` sets their count, ``--max-tokens`` takes several budgets (a
variant each), ``--logprob-chunk`` sets ``train.logprob_chunk_tokens``, ``--variants`` picks the
variants. The
``first call s`` column is each variant's first call: a compiled variant's compile is in it;
``--compile-cache DIR`` points inductor's caches (``TORCHINDUCTOR_CACHE_DIR``) at ``DIR``, so that a
second run with the same folder shows the compile with warm caches; ``--cudagraphs`` makes the
compiled variants replay CUDA graphs (one recorded per packed length).

Run: ``python benchmarks/bench_train_phase.py`` (CPU smoke) or
``python benchmarks/bench_train_phase.py --device cuda --size 135m`` (and ``--size 0.82b``);
``--device cuda --size 0.82b --samples 32 --sample-tokens 2048 --variants packed-budget,compiled``
for 2k-token samples.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, LlamaConfig

from ppo_trainer import AlgorithmConfig, TrainerConfig
from ppo_trainer.backend import TorchTrainer
from ppo_trainer.batch import Samples
from ppo_trainer.models import load_causal_lm
from ppo_trainer.throughput import PhaseCost, matmul_limit, matmul_parameters


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    samples: int
    prompt: tuple[int, int]  # token counts drawn uniformly in [low, high]
    response: tuple[int, int]
    micro_batch: int  # padded: samples per micro-batch (the run configs' value)
    max_tokens: int  # packed: tokens per micro-batch


SIZES = {
    "tiny": Size(64, 2, 4, 2, 128, 512, True, 32, (4, 24), (2, 20), 8, 256),
    # The embedded default run's step: its model, 256 samples of a short prompt and <= 4 tokens.
    "default": Size(64, 2, 4, 4, 128, 20, False, 256, (5, 8), (1, 4), 8, 256),
    "cpu-small": Size(256, 4, 8, 2, 768, 8192, True, 64, (20, 60), (5, 40), 16, 2048),
    "135m": Size(576, 30, 9, 3, 1536, 49152, True, 512, (40, 70), (5, 40), 32, 16384),
    "0.82b": Size(2048, 16, 16, 16, 5632, 32, False, 256, (16, 16), (256, 256), 16, 16384),
}


def make_model(folder: Path, size: Size, positions: int = 1024) -> Path:
    LlamaConfig(
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        vocab_size=size.vocab,
        max_position_embeddings=positions,
        rope_theta=100000.0,
        tie_word_embeddings=size.tied,
    ).save_pretrained(folder)  # config only: every trainer initialises the same weights from its seed
    return folder


def make_samples(
    size: Size, seed: int = 0, responses: list[int] | None = None, sample_tokens: int | None = None
) -> Samples:
    """``size.samples`` samples of a prompt and a response of random tokens. The response is
    ``responses[i]`` tokens (``responses`` gives the sample count), else drawn from the size's range;
    with ``sample_tokens`` it is cut to ``sample_tokens`` less the prompt, and without ``responses``
    it fills the sample to exactly ``sample_tokens``."""
    g = torch.Generator().manual_seed(seed)

    def draw(bounds: tuple[int, int]) -> int:
        return int(torch.randint(bounds[0], bounds[1] + 1, (1,), generator=g))

    fields: dict[str, list[torch.Tensor]] = {
        k: []
        for k in ("tokens", "response_length", "loss_mask", "reward", "rollout_log_probs", "prompt_index")
    }
    count = size.samples if responses is None else len(responses)
    for i in range(count):
        prompt = draw(size.prompt)
        if sample_tokens is not None:
            room = sample_tokens - prompt
            response = room if responses is None else min(responses[i], room)
        else:
            response = draw(size.response) if responses is None else responses[i]
        fields["tokens"].append(torch.randint(0, size.vocab, (prompt + response,), generator=g))
        fields["response_length"].append(torch.tensor([response]))
        fields["loss_mask"].append(torch.ones(response))
        fields["reward"].append(torch.tensor([float(i % 2)]))
        fields["rollout_log_probs"].append(torch.full((response,), -10.0))
        fields["prompt_index"].append(torch.tensor([i // 8]))
    return Samples.from_fields(fields)


def lognormal_lengths(count: int, median: float, longest: int, sigma: float, seed: int) -> list[int]:
    """Lognormal response lengths: ``exp(N(log median, sigma))`` rounded, clipped to [1, longest].

    A copy of ``ppo_rollout.testing.long_tail.lognormal_lengths`` (the trainer imports nothing of the
    rollout; ``tests/test_bench_train_phase.py`` checks that both draw the same lengths)."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if median <= 0 or longest < 1 or sigma < 0:
        raise ValueError(
            f"lognormal lengths need median > 0, longest >= 1 and sigma >= 0; got median={median}, "
            f"longest={longest}, sigma={sigma}"
        )
    g = torch.Generator().manual_seed(seed)
    draws = torch.exp(math.log(median) + sigma * torch.randn(count, generator=g, dtype=torch.float64))
    return [max(1, min(longest, round(float(x)))) for x in draws]


def long_samples(size: Size, args: argparse.Namespace) -> Samples:
    """The samples of ``--sample-tokens`` (and ``--median``), else of the size's own ranges. Fixed:
    every sample exactly ``--sample-tokens`` long (its response fills what its prompt leaves, so
    packed micro-batches of as many samples have one length); lognormal: the response lengths the
    rollout benchmarks draw (``lognormal_lengths``), each cut to what its prompt leaves."""
    if args.sample_tokens is None:
        if args.median is not None:
            raise SystemExit("--median needs --sample-tokens (the longest sample)")
        return make_samples(size)
    room = args.sample_tokens - size.prompt[1]
    if room < 1:
        raise SystemExit(
            f"--sample-tokens {args.sample_tokens} leaves no room for a response after the size's "
            f"prompts of up to {size.prompt[1]} tokens; raise it"
        )
    if args.median is None:
        return make_samples(size, sample_tokens=args.sample_tokens)
    drawn = lognormal_lengths(size.samples, args.median, args.sample_tokens, args.sigma, seed=0)
    return make_samples(size, responses=drawn, sample_tokens=args.sample_tokens)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Row:
    phase: str
    variant: str
    seconds: float
    tokens: int
    flops: float
    attention_flops: float  # causal attention's own (left out of the model FLOPs), the same passes
    peak_gb: float | None
    loss: float | None
    first_s: float  # the first call (a compiled variant's compile is in it)


@dataclass
class Timing:
    """One variant's calls: seconds of the timed ones, the first call's, its peak working memory, the
    first loss."""

    seconds: list[float]
    peak_gb: float | None = None
    loss: float | None = None
    first_s: float | None = None


def timed_call(fn: Callable[[], float | None], device: torch.device, timing: Timing, keep: bool) -> None:
    """Run ``fn`` once; record its seconds (``keep``), its loss (the first call) and the memory it
    allocated above what was resident before it (CUDA: activations, logits, gradients)."""
    sync(device)
    if device.type == "cuda":
        resident = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    loss = fn()
    sync(device)
    seconds = time.perf_counter() - start
    if keep:
        timing.seconds.append(seconds)
    if timing.first_s is None:
        timing.first_s = seconds
    if timing.loss is None and loss is not None:
        timing.loss = loss
    if device.type == "cuda":
        working = (torch.cuda.max_memory_allocated(device) - resident) / 1e9
        timing.peak_gb = max(timing.peak_gb or 0.0, working)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


PHASES = (("logprob_forward", "actor"), ("actor_train", "actor"), ("critic_train", "critic"))
COMPILED = ", torch.compile"
"""The suffix of a variant whose decoder layers run compiled (``--compile``: ``train.compile_layers``)."""


def trainer_rows(
    path: Path,
    samples: Samples,
    device: torch.device,
    variants: dict[str, dict[str, object]],
    args: argparse.Namespace,
) -> list[Row]:
    """Every phase for every variant; within a phase the variants take turns call by call, so that
    drift in the machine's load (or clocks) hits them alike."""
    tokens = sum(t.numel() for t in samples.tokens)
    alg = AlgorithmConfig(lam=1.0, num_mini_batches=args.mini_batches)
    # Seeded here: loading a config-only model reseeds the global generator.
    g = torch.Generator().manual_seed(1)
    values = torch.randn(len(samples), samples.max_response, generator=g) * samples.response_mask
    rows = []
    for phase, role in PHASES:
        trainers, costs = {}, {}
        for variant, settings in variants.items():
            config = TrainerConfig(
                role=role,  # type: ignore[arg-type]
                model_path=str(path),
                algorithm=alg,
                device=device.type,  # type: ignore[arg-type]
                actor_lr=1e-5,
                critic_lr=1e-5,
                **settings,  # type: ignore[arg-type]
            )
            trainers[variant], costs[variant] = TorchTrainer(config), PhaseCost.for_config(config)

        def run(trainer: TorchTrainer, phase: str = phase) -> float | None:
            if phase == "logprob_forward":
                trainer.compute_log_probs(samples)
                return None
            if phase == "actor_train":
                return trainer.train_actor(samples, values)["pg_loss"]
            return trainer.train_critic(samples)[0]["value_loss"]

        timings = {variant: Timing([]) for variant in variants}
        for i in range(args.warmup + args.repeats):
            for variant, trainer in trainers.items():
                started = time.perf_counter()
                timed_call(functools.partial(run, trainer), device, timings[variant], keep=i >= args.warmup)
                # Progress on stderr as each call ends: a run cut short by a time limit still says
                # where its time went (the table comes only at the end).
                print(
                    f"[bench] {phase} | {variant} | call {i + 1}: {time.perf_counter() - started:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
        for variant, timing in timings.items():
            cost = costs[variant]
            flops = 2 * cost.trained * tokens if phase == "logprob_forward" else cost.flops(tokens)
            # forwards: the trained model's (and the reference's); a backward is two forwards' worth
            passes = 1 if phase == "logprob_forward" else 1 + (cost.reference > 0) + 3 * cost.epochs
            attention = passes * attention_forward_flops(path, samples)
            seconds = statistics.median(timing.seconds)
            first = timing.first_s or seconds
            rows.append(
                Row(phase, variant, seconds, tokens, flops, attention, timing.peak_gb, timing.loss, first)
            )
        del trainers
        free(device)
    return rows


def attention_forward_flops(path: Path, samples: Samples) -> float:
    """Causal attention's own FLOPs in one forward over ``samples`` (each sample attends within
    itself, as packed and padded runs both compute): per layer, ``Q K^T`` and ``P V`` over the
    ``T^2 / 2`` causal pairs of a ``T``-token sample, 2 FLOPs a multiply-add, ``2 x heads x head_dim x
    T^2``. The model FLOPs (``ppo_trainer.throughput``) leave these out: a few percent at short
    samples, a large share at 2k tokens and a small hidden size."""
    config = AutoConfig.from_pretrained(path)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = config.num_attention_heads * head_dim
    return float(sum(2 * width * config.num_hidden_layers * t.numel() ** 2 for t in samples.tokens))


def plain_row(
    path: Path, samples: Samples, size: Size, device: torch.device, args: argparse.Namespace
) -> Row:
    """Transformers' own causal-LM loss, forward and backward, padded micro-batches, AdamW."""
    model: Any = load_causal_lm(path, seed=1234)  # the weights every trainer starts from
    model = model.to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=device.type == "cuda")
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    )
    n = len(samples)
    order = list(range(n))
    minis = [order[i :: args.mini_batches] for i in range(args.mini_batches)]

    def batch(rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        width = max(samples.tokens[i].numel() for i in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.int64)
        mask = torch.zeros(len(rows), width, dtype=torch.int64)
        for j, i in enumerate(rows):
            ids[j, : samples.tokens[i].numel()] = samples.tokens[i]
            mask[j, : samples.tokens[i].numel()] = 1
        labels = ids.masked_fill(mask == 0, -100)
        return ids.to(device), mask.to(device), labels.to(device)

    def step() -> float:
        total = 0.0
        for mini in minis:
            micros = [mini[i : i + size.micro_batch] for i in range(0, len(mini), size.micro_batch)]
            for rows in micros:
                ids, mask, labels = batch(rows)
                with autocast:
                    loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
                (loss / len(micros)).backward()
                total += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return total

    timing = Timing([])
    for i in range(args.warmup + args.repeats):
        timed_call(step, device, timing, keep=i >= args.warmup)
    tokens = sum(t.numel() for t in samples.tokens)
    flops = 6.0 * matmul_parameters(model) * tokens
    variant = f"padded, {size.micro_batch} samples"
    return Row(
        "plain HF fwd+bwd",
        variant,
        statistics.median(timing.seconds),
        tokens,
        flops,
        3 * attention_forward_flops(path, samples),
        timing.peak_gb,
        timing.loss,
        timing.first_s or statistics.median(timing.seconds),
    )


def print_table(rows: list[Row], limit: float) -> None:
    print(
        "| phase | variant | s | tokens/s | TFLOP/s | share of matmul limit | with attention | working GB "
        "| first call s | first loss |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        tflops = r.flops / r.seconds / 1e12
        with_attention = (r.flops + r.attention_flops) / r.seconds / 1e12
        peak = "-" if r.peak_gb is None else f"{r.peak_gb:.1f}"
        loss = "-" if r.loss is None else f"{r.loss:.5f}"
        print(
            f"| {r.phase} | {r.variant} | {r.seconds:.3f} | {r.tokens / r.seconds:,.0f} | {tflops:.3g} | "
            f"{tflops / limit:.1%} | {with_attention / limit:.1%} | {peak} | {r.first_s:.2f} | {loss} |"
        )


VARIANTS = ("padded", "padded-budget", "packed", "packed-budget", "compiled", "plain")
"""``--variants`` names: padded (``micro_batch_size`` samples), padded-budget (the token budget without
packing), packed (the padded micro-batches' samples, packed), packed-budget (packed within each token
budget, one per attention), compiled (packed-budget with ``train.compile_layers``, first attention),
plain (transformers' own loss, padded)."""


def build_variants(
    size: Size,
    budgets: list[int],
    attentions: list[str],
    chosen: set[str],
    chunk: int,
    compiled_label: str = COMPILED,
) -> dict[str, dict[str, object]]:
    """The trainer settings of each chosen variant, by its row label."""
    variants: dict[str, dict[str, object]] = {}
    if "padded" in chosen:
        variants[f"padded, {size.micro_batch} samples"] = {"micro_batch_size": size.micro_batch}
    # The same token budget without packing (samples x longest within it): how much of the packed
    # budget's gain is the larger micro-batches alone.
    if "padded-budget" in chosen:
        for budget in budgets:
            variants[f"padded, {budget} tokens"] = {"max_tokens_per_micro_batch": budget}
    # Packing alone (the padded micro-batches' samples), then with the token budget.
    if "packed" in chosen:
        variants[f"packed {attentions[0]}, {size.micro_batch} samples"] = {
            "pack_sequences": True,
            "packed_attention": attentions[0],
            "micro_batch_size": size.micro_batch,
        }
    for budget in budgets:
        packed = {"pack_sequences": True, "max_tokens_per_micro_batch": budget}
        if "packed-budget" in chosen:
            for attention in attentions:
                variants[f"packed {attention}, {budget} tokens"] = {**packed, "packed_attention": attention}
        if "compiled" in chosen:  # decoder layers compiled (in the warm-up calls)
            variants[f"packed {attentions[0]}, {budget} tokens{compiled_label}"] = {
                **packed,
                "packed_attention": attentions[0],
                "compile_layers": True,  # train.compile_layers: what a run sets
            }
    return {name: {**settings, "logprob_chunk_tokens": chunk} for name, settings in variants.items()}


def compile_cache(folder: Path | None) -> str:
    """Points inductor's on-disk caches (its FX graph cache, AOTAutograd's and the generated kernels)
    at ``folder``: a later run with the same folder, models and shapes skips inductor's compile and
    keeps Dynamo's tracing. Set before the first compile; returns what the run uses, for the header."""
    if folder is None:
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR", "inductor's default (a folder under /tmp)")
    folder.mkdir(parents=True, exist_ok=True)
    warm = any(folder.iterdir())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder.resolve())
    return f"{folder} ({'warm: filled by an earlier run' if warm else 'cold: empty'})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--size", choices=sorted(SIZES), default=None, help="default: tiny on cpu, 135m on cuda"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--attention",
        default=None,
        help="packed attentions, comma-separated (varlen, sdpa, flex_attention); default: varlen,sdpa on "
        "the CPU, varlen on CUDA (sdpa's dense block mask is T^2 per packed row: at a 16384-token budget "
        "a [16384, 16384] mask per layer)",
    )
    parser.add_argument(
        "--max-tokens",
        default=None,
        help="packed token budgets, comma-separated (a budget variant each; default: the size's)",
    )
    parser.add_argument("--samples", type=int, default=None, help="samples (default: the size's)")
    parser.add_argument(
        "--sample-tokens",
        type=int,
        default=None,
        help="long samples: every sample this many tokens (its response fills what its prompt leaves); "
        "with --median, lognormal response lengths cut to it",
    )
    parser.add_argument(
        "--median", type=float, default=None, help="lognormal response lengths' median (--sample-tokens)"
    )
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal response lengths' sigma")
    parser.add_argument(
        "--logprob-chunk",
        type=int,
        default=4096,
        help="train.logprob_chunk_tokens (default 4096, the setting's): positions per chunk of the "
        "float32 log-softmax (and, packed, of the LM head)",
    )
    parser.add_argument(
        "--variants",
        default=",".join(v for v in VARIANTS if v != "compiled"),
        help=f"comma-separated, of {', '.join(VARIANTS)}",
    )
    parser.add_argument("--mini-batches", type=int, default=4, help="optimizer steps per phase")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also the packed token-budget variants with torch.compile'd decoder layers (--variants "
        "compiled; compiling is in the warm-up calls, shown as the first call's seconds; raise --warmup "
        "to 2 or more, a new packed length may recompile)",
    )
    parser.add_argument(
        "--cudagraphs",
        action="store_true",
        help="the compiled variants replay CUDA graphs (inductor's triton.cudagraphs, what "
        "mode='reduce-overhead' sets): a graph is recorded per packed length, so it pays where every "
        "micro-batch has the same length (equal samples filling the budget); CUDA only",
    )
    parser.add_argument(
        "--compile-cache",
        type=Path,
        default=None,
        help="TORCHINDUCTOR_CACHE_DIR for the compiled variants: run twice with the same folder and the "
        "second run's first call shows the compile with warm caches",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    chosen = set(args.variants.split(",")) | ({"compiled"} if args.compile else set())
    unknown = chosen - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; use names of {', '.join(VARIANTS)}")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    size = SIZES[args.size or ("135m" if device.type == "cuda" else "tiny")]
    if args.samples is not None:
        size = replace(size, samples=args.samples)
    budgets = [int(b) for b in args.max_tokens.split(",")] if args.max_tokens else [size.max_tokens]
    attentions = (args.attention or ("varlen" if device.type == "cuda" else "varlen,sdpa")).split(",")
    cache = compile_cache(args.compile_cache)
    compiled_label = COMPILED
    if args.cudagraphs:
        if device.type != "cuda":
            raise SystemExit("--cudagraphs needs --device cuda")
        import torch._inductor.config as inductor_config

        # Set before the first compile: every compiled variant of this run records and replays graphs.
        inductor_config.triton.cudagraphs = True
        compiled_label = f"{COMPILED} + CUDA graphs"
    limit, what = matmul_limit(device)
    where = torch.cuda.get_device_name(0) if device.type == "cuda" else f"CPU, {args.threads} thread(s)"
    samples = long_samples(size, args)
    tokens = sum(t.numel() for t in samples.tokens)
    longest = max(t.numel() for t in samples.tokens)
    if longest > min(budgets) and ({"padded-budget", "packed-budget", "compiled"} & chosen):
        raise SystemExit(f"--max-tokens {min(budgets)} is below the longest sample ({longest}); raise it")
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "model", size, positions=max(1024, longest))
        params = PhaseCost.for_config(TrainerConfig(role="actor", model_path=str(path))).trained
        print(
            f"\n### train phases on {where}: {params / 1e6:.0f}M matmul parameters (hidden {size.hidden}, "
            f"{size.layers} layers, vocabulary {size.vocab}); {len(samples)} samples, {tokens} tokens "
            f"({tokens / len(samples):.0f} a sample, longest {longest}); "
            f"{args.mini_batches} mini-batches; each trainer holds about {params * 16 / 1e9:.1f} GB of "
            "float32 weights, gradients and AdamW state besides the working memory below; log-prob chunks "
            f"of {args.logprob_chunk} positions; matmul "
            f"limit {limit:.1f} TFLOP/s ({what}); median of {args.repeats} after {args.warmup} warm-up, "
            f"variants interleaved" + (f"; compile cache {cache}" if "compiled" in chosen else "")
        )
        variants = build_variants(size, budgets, attentions, chosen, args.logprob_chunk, compiled_label)
        rows = trainer_rows(path, samples, device, variants, args) if variants else []
        rows.sort(key=lambda r: r.phase)
        if "plain" in chosen:
            rows.append(plain_row(path, samples, size, device, args))
        free(device)
    print_table(rows, limit)


if __name__ == "__main__":
    main()
