"""Achieved TFLOP/s of a training phase, from its token count and the model's size.

A role's ``train`` call makes one no-grad forward of the trained model over every token (the old
log-probs, or the values), one of the reference when the role holds it, and ``ppo_epochs`` forward
and backward passes. At ``2 N`` FLOPs a token forward and ``6 N`` forward and backward, with ``N`` the
parameters that enter a matmul (all but a lookup-only input embedding; a tied embedding counts once,
as the LM head), the phase does ``tokens x (2 N + 2 N_ref + 6 N x epochs)``. Attention's own
``O(length^2)`` FLOPs are left out (a few percent at the lengths this serves), and so is the LM head's
saving when only response positions are projected (packed): these are the model's FLOPs for the
tokens, the usual MFU convention, so that the figure compares across implementations.

Per rank: the rank's own tokens over its own seconds, so the figure is per GPU (the driver logs rank
0's; every rank of a role does the same work).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from ppo_trainer.config import TrainerConfig


def matmul_parameters(model: nn.Module) -> int:
    """Parameters a token's forward multiplies by: all, less input embeddings used only as a lookup."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookup = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) and id(m.weight) not in linear
    }
    return sum(p.numel() for p in model.parameters() if id(p) not in lookup)


@dataclass(frozen=True)
class PhaseCost:
    """Matmul parameters of what one role's ``train`` call runs (see the module docstring)."""

    trained: int
    reference: int  # 0: the role holds no reference
    epochs: int

    @classmethod
    def for_config(cls, config: TrainerConfig) -> PhaseCost:
        """From the model folder's ``config.json`` alone (models built on the meta device)."""
        hf = AutoConfig.from_pretrained(config.model_path)
        with torch.device("meta"):
            policy = matmul_parameters(AutoModelForCausalLM.from_config(hf))
            if config.role == "actor":
                trained = policy
            else:  # the backbone and a Linear(hidden, 1) value head
                backbone = AutoModel.from_config(hf)
                trained = matmul_parameters(backbone) + int(hf.hidden_size) + 1
        reference = policy if config.algorithm.reference_for(config.role) else 0
        return cls(trained=trained, reference=reference, epochs=config.algorithm.epochs_for(config.role))

    def flops(self, tokens: int) -> float:
        """FLOPs of one ``train`` call over ``tokens`` tokens (prompts and responses)."""
        per_token = 2 * self.trained + 2 * self.reference + 6 * self.epochs * self.trained
        return float(tokens) * per_token


def matmul_limit(device: torch.device) -> tuple[float, str]:
    """TFLOP/s of one large square matmul on ``device`` and what it was: bf16 8192^3 on CUDA, float32
    2048^3 on the CPU. The ceiling an achieved TFLOP/s is compared to, measured in the same run (a
    vendor's peak is not reached by any real matmul)."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (2048, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        a @ b
    sync()
    repeats = 20 if device.type == "cuda" else 3
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync()
    seconds = (time.perf_counter() - start) / repeats
    return 2 * n**3 / seconds / 1e12, f"{n}^3 {str(dtype).removeprefix('torch.')} matmul"


class PhaseMeter:
    """Seconds and (on CUDA) peak allocated memory of one phase; :meth:`metrics` at its end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.start = time.perf_counter()

    def metrics(self, flops: float, tokens: int, excluded_s: float = 0.0) -> dict[str, float]:
        """``tflops`` and ``tokens_per_s`` over the phase's seconds less ``excluded_s`` (time inside it
        that is not compute, e.g. the value handoff); ``peak_memory_gb`` on CUDA."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = max(time.perf_counter() - self.start - excluded_s, 1e-9)
        out = {"tflops": flops / seconds / 1e12, "tokens_per_s": tokens / seconds}
        if self.device.type == "cuda":
            out["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
        return out
