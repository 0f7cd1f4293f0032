"""Train-step throughput of the torch backend against a plain torch PPO loop on the same model and batch.

Both sides do what one PPO actor step needs: a no-grad forward for the old log-probs, then forward,
backward, gradient clipping and an AdamW step per micro-batch group, under the same autocast. The
backend adds batch validation, padding per micro-batch, GAE, advantage whitening and metrics.

Run: ``python benchmarks/bench_train_step.py --device cpu`` (or ``cuda``); prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from ppo_trainer.backend import TorchTrainer
from ppo_trainer.batch import Samples
from ppo_trainer.config import AlgorithmConfig, TrainerConfig

SIZES = {
    # name: (hidden, layers, heads, vocab, samples, prompt, response, micro_batch)
    "cpu": (128, 2, 4, 512, 16, 32, 32, 8),
    "cuda": (1024, 8, 8, 32000, 64, 256, 256, 16),
}


def make_model(folder: Path, hidden: int, layers: int, heads: int, vocab: int) -> Path:
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def make_samples(n: int, prompt: int, response: int, vocab: int) -> Samples:
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, vocab, (prompt + response,), generator=g) for _ in range(n)]
    return Samples.from_fields(
        {
            "tokens": tokens,
            "response_length": [torch.tensor([response])] * n,
            "loss_mask": [torch.ones(response)] * n,
            "reward": [torch.tensor([float(i % 2)]) for i in range(n)],
            "rollout_log_probs": [torch.zeros(response)] * n,
            "prompt_index": [torch.tensor([i // 4]) for i in range(n)],
        }
    )


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    input_ids: torch.Tensor,
    prompt: int,
    advantages: torch.Tensor,
    micro: int,
    autocast: contextlib.AbstractContextManager,
) -> None:
    """The baseline: old log-probs, then clipped PPO loss, backward, clip, AdamW."""
    targets = input_ids[:, prompt:]

    def log_probs(ids: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        with autocast:
            logits = model(input_ids=ids, use_cache=False).logits[:, prompt - 1 : -1]
        return torch.log_softmax(logits.float(), -1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)

    with torch.no_grad():
        old = torch.cat(
            [
                log_probs(input_ids[i : i + micro], targets[i : i + micro])
                for i in range(0, len(input_ids), micro)
            ]
        )
    count = targets.numel()
    for i in range(0, len(input_ids), micro):
        logp = log_probs(input_ids[i : i + micro], targets[i : i + micro])
        ratio = torch.exp(logp - old[i : i + micro])
        adv = advantages[i : i + micro]
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).sum() / count
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def bench(device_name: str, repeats: int, warmup: int) -> list[tuple[str, float, float]]:
    hidden, layers, heads, vocab, n, prompt, response, micro = SIZES[device_name]
    device = torch.device("cuda", 0) if device_name == "cuda" else torch.device("cpu")
    tokens_per_step = n * (prompt + response)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "model", hidden, layers, heads, vocab)
        samples = make_samples(n, prompt, response, vocab)
        values = torch.zeros(n, response)

        config = TrainerConfig(
            role="actor",
            model_path=str(path),
            algorithm=AlgorithmConfig(lam=1.0, num_mini_batches=1),
            device=device_name,  # type: ignore[arg-type]
            micro_batch_size=micro,
            actor_lr=1e-5,
        )
        trainer = TorchTrainer(config)
        model = AutoModelForCausalLM.from_pretrained(path).float().to(device)
        with torch.no_grad():  # own storages, as the backend has (from_pretrained maps the file)
            for p in model.parameters():
                p.data = p.data.clone()
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=device.type == "cuda")
        input_ids = torch.stack(list(samples.tokens)).to(device)
        advantages = torch.randn(n, response, device=device)
        autocast: contextlib.AbstractContextManager = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if device.type == "cuda"
            else contextlib.nullcontext()
        )

        def ours() -> None:
            trainer.train_actor(samples, values)

        def plain() -> None:
            plain_step(model, optimizer, input_ids, prompt, advantages, micro, autocast)

        # Interleaved, so that drift in the machine's load hits both sides alike.
        times: dict[str, list[float]] = {"ours": [], "plain": []}
        for i in range(warmup + repeats):
            for name, fn in (("ours", ours), ("plain", plain)):
                sync(device)
                start = time.perf_counter()
                fn()
                sync(device)
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
        rows.append(
            ("ppo_trainer TorchTrainer.train_actor", statistics.median(times["ours"]), tokens_per_step)
        )
        rows.append(("plain torch PPO step", statistics.median(times["plain"]), tokens_per_step))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: skipping the cuda benchmark")
        return
    hidden, layers, _, vocab, n, prompt, response, micro = SIZES[args.device]
    where = (
        torch.cuda.get_device_name(0) if args.device == "cuda" else f"{cpu_name()}, {args.threads} thread(s)"
    )
    print(
        f"\n### train step, {args.device} ({where}); Llama hidden {hidden}, {layers} layers, vocab {vocab}; "
        f"{n} samples x ({prompt} prompt + {response} response) tokens, micro-batch {micro}, "
        f"median of {args.repeats}"
    )
    print("| implementation | step (s) | tokens/s | vs plain |\n|---|---|---|---|")
    rows = bench(args.device, args.repeats, args.warmup)
    plain = rows[-1][1]
    for name, seconds, tokens in rows:
        print(f"| {name} | {seconds:.3f} | {tokens / seconds:,.0f} | {plain / seconds:.2f}x |")


if __name__ == "__main__":
    main()
