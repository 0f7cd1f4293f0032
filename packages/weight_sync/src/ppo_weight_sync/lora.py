"""Adapter-only weight updates: what an engine needs to merge LoRA adapters onto the base it holds.

A LoRA update names each adapted linear layer's two tensors ``<module path>.lora_A.weight``
(``rank x in``) and ``<module path>.lora_B.weight`` (``out x rank``); the engine sets
``<module path>.weight`` to ``merge_lora(base, A, B, alpha / rank)``. The trainer's merged export
(``ppo_trainer.converters.lora``) calls the same function, so both sides compute the same bits from the
same inputs. The scale and the product follow peft 0.21.2 (``peft/tuners/lora/layer.py``:
``scaling = lora_alpha / r``, ``get_delta_weight`` = ``B @ A * scaling``, no rsLoRA).
"""

from __future__ import annotations

import torch

__all__ = ["ADAPTER_LEAVES", "adapter_module", "merge_lora"]

ADAPTER_LEAVES = ("lora_A.weight", "lora_B.weight")


def merge_lora(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight + scale * b @ a`` computed in float32 on ``weight``'s device, returned in its dtype.

    The adapters may sit elsewhere: a sleeping role's offload moves its trained tensors (the adapters)
    to host memory and may leave the frozen base on the GPU, and a checkpoint merges what it captured."""
    with torch.no_grad():
        device = weight.device
        merged = torch.addmm(weight.float(), b.to(device).float(), a.to(device).float(), alpha=scale)
    return merged.to(weight.dtype)


def adapter_module(name: str) -> tuple[str, str] | None:
    """``(module path, leaf)`` of an adapter tensor's name (leaf ``lora_A.weight`` or ``lora_B.weight``);
    None for any other name."""
    for leaf in ADAPTER_LEAVES:
        if name.endswith("." + leaf):
            return name[: -len(leaf) - 1], leaf
    return None
