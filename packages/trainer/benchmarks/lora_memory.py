"""Training state and weight-update size of full fine-tuning against ``train.lora``, per role.

For each role (actor, critic) and each mode (full, LoRA) it builds the torch backend's trainer
(``TorchTrainer``, the real converters) on a model folder or a preset shape (random weights from the
config), then prints, per role and for the two roles together:

- trainable parameters;
- parameters + gradients + AdamW state, bytes (every parameter as stored, a gradient per trainable
  parameter in its dtype, AdamW's two moments and step as allocated at setup);
- bytes per weight update: what the actor sends an engine in ``--sync-dtype``: the merged model
  (``train.lora.update: merged``, SGLang's), and the tensors an adapter-only update sends
  (``train.lora.update: adapters``, the built-in engine's: ``TorchTrainer.trainable_weights``, the
  list the worker hands the weight sender);
- on CUDA, the peak memory of one train step (forward over ``--tokens`` random tokens, backward, the
  optimizer step), from ``torch.cuda.max_memory_allocated``;

and LoRA's share of full fine-tuning. Presets: ``135m`` (SmolLM2-135M's shape: hidden 576, 30 layers,
9 heads, 3 key-value heads, MLP 1536, vocabulary 49152, tied embeddings) and ``0.82b`` (the step
budget's model: hidden 2048, 16 layers, 16 heads, MLP 5632, vocabulary 32).

Run: ``python benchmarks/lora_memory.py --preset 135m --dtype bfloat16`` (CPU: the frozen base is
stored in bfloat16 as on CUDA), ``python benchmarks/lora_memory.py --model models/smollm2-135m-instruct
--device cuda``.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

from ppo_trainer.backend import TorchTrainer
from ppo_trainer.config import LoraSettings, TrainerConfig

PRESETS = {
    # hidden, layers, heads, kv heads, MLP, vocabulary, tied
    "135m": (576, 30, 9, 3, 1536, 49152, True),
    "0.82b": (2048, 16, 16, 16, 5632, 32, False),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def preset_folder(name: str, folder: Path) -> Path:
    hidden, layers, heads, kv, mlp, vocab, tied = PRESETS[name]
    LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=mlp,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        max_position_embeddings=2048,
    ).save_pretrained(folder)
    return folder  # config only: the trainer initialises the weights from its seed


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(config: TrainerConfig, sync_dtype: torch.dtype, tokens: int) -> dict[str, float]:
    t = TorchTrainer(config)
    params = list(t.model.parameters())
    out: dict[str, float] = {
        "trainable": float(sum(p.numel() for p in t.params)),
        "parameters_bytes": float(nbytes(params)),
        "gradient_bytes": float(nbytes(t.params)),
        "optimizer_bytes": float(nbytes(t.optimizer_tensors())),
    }
    out["state_bytes"] = out["parameters_bytes"] + out["gradient_bytes"] + out["optimizer_bytes"]
    if config.role == "actor":
        out["update_bytes_merged"] = float(sum(w.numel() for _, w in t.named_weights()) * sync_dtype.itemsize)
        if t.lora is not None:
            # the list an adapter-only update hands the weight sender, as the worker builds it
            out["update_bytes_adapters"] = float(nbytes(w for _, w in t.trainable_weights(sync_dtype)))
    if t.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        ids = torch.randint(0, 32, (1, tokens), device=t.device)
        with t._autocast():
            if config.role == "critic":
                loss = t.model(ids).float().pow(2).mean()
            else:
                loss = t.model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
        t.backward(loss)
        t.optimizer_step()
        torch.cuda.synchronize()
        out["peak_step_bytes"] = float(torch.cuda.max_memory_allocated())
    del t
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--model", type=Path, help="a Hugging Face model folder (config only: random weights)"
    )
    source.add_argument("--preset", choices=sorted(PRESETS))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--target-modules", nargs="*", default=[], help="default: every linear layer")
    parser.add_argument("--sync-dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--tokens", type=int, default=4096, help="CUDA: tokens of the measured step")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or preset_folder(args.preset, Path(tmp))
        settings = LoraSettings(rank=args.rank, alpha=args.alpha, target_modules=tuple(args.target_modules))
        figures: dict[str, dict[str, dict[str, float]]] = {}
        for mode, lora_settings in (("full", None), ("lora", settings)):
            figures[mode] = {}
            for role in ("actor", "critic"):
                config = TrainerConfig(
                    role=role,
                    model_path=str(folder),
                    device=args.device,
                    dtype=args.dtype,
                    lora=lora_settings,
                )
                figures[mode][role] = measure(config, DTYPES[args.sync_dtype], args.tokens)

    rows = [
        ("trainable parameters", "trainable", 1.0, ""),
        ("parameters + gradients + AdamW", "state_bytes", 1e-6, " MB"),
        ("  of which parameters", "parameters_bytes", 1e-6, " MB"),
        ("  of which gradients", "gradient_bytes", 1e-6, " MB"),
        ("  of which AdamW state", "optimizer_bytes", 1e-6, " MB"),
        ("peak memory of one step (CUDA)", "peak_step_bytes", 1e-6, " MB"),
    ]
    source_name = args.model or args.preset
    print(f"model: {source_name}, rank {args.rank}, alpha {args.alpha}, dtype {args.dtype}, {args.device}")
    print("| figure | role | full | LoRA | LoRA / full |")
    print("|---|---|---:|---:|---:|")
    for label, key, scale, unit in rows:
        if key not in figures["full"]["actor"]:
            continue
        for role in ("actor", "critic", "both"):
            roles = ("actor", "critic") if role == "both" else (role,)
            full = sum(figures["full"][r][key] for r in roles)
            low = sum(figures["lora"][r][key] for r in roles)
            shown = f"{full * scale:,.1f}{unit} | {low * scale:,.1f}{unit}"
            print(f"| {label} | {role} | {shown} | {low / full:.4f} |")
    full_update = figures["full"]["actor"]["update_bytes_merged"]
    for label, key in (
        ("merged", "update_bytes_merged"),
        ("adapters only", "update_bytes_adapters"),
    ):
        sent = figures["lora"]["actor"][key]
        print(
            f"| bytes per weight update ({args.sync_dtype}), {label} | actor | {full_update / 1e6:,.2f} MB "
            f"| {sent / 1e6:,.2f} MB | {sent / full_update:.4f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
