"""The torch backend's model converters: the steps that turn a loaded model into the one trained.

A converter changes a model once, after loading (``convert``), and says how its change shows in the
weights handed out (``export``): to the engines, to checkpoints' ``hf/`` folder, to ``hf_state_dict``.
``TorchTrainer`` applies an ordered list to the trained model and another to the frozen reference
(``for_model``); ``named_weights`` passes the model's tensors through the exports in reverse order, so
the last conversion (sharding) is undone first (whole tensors gathered) and LoRA then merges whole
tensors. The seam follows torchtitan's ``ModelConverter`` protocol and its ``LoRAConverter``
(``torchtitan/components/lora.py``, commit 0b83f010): a ``convert(model)`` per transform, applied in
a configured order, instead of one branch per transform in the trainer.

The order: packed attention (which kernel transformers calls), LoRA (adapters on the decoder layers'
linear layers), compile (torchtitan compiles before FSDP2 so it wraps the compiled blocks; after LoRA
so the compiled layers contain the adapters), sharding (FSDP2).

The seam itself (``ModelConverter``, ``NamedTensors``) lives in ``converters.protocol``, which the
converters import; this module re-exports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ppo_trainer.config import TrainerConfig
from ppo_trainer.converters.attention import PackedAttentionConverter
from ppo_trainer.converters.compile import CompileConverter
from ppo_trainer.converters.lora import LoRAConverter
from ppo_trainer.converters.protocol import ModelConverter, NamedTensors
from ppo_trainer.converters.sharding import ShardingConverter

__all__ = ["ModelConverter", "NamedTensors", "apply", "export", "for_model"]


def apply(converters: Iterable[ModelConverter], model: nn.Module) -> nn.Module:
    """``model`` through each converter in order."""
    for converter in converters:
        model = converter.convert(model)
    return model


def export(
    converters: Sequence[ModelConverter], weights: NamedTensors, dtype: torch.dtype | None
) -> NamedTensors:
    """``weights`` through each converter's export, the last conversion first."""
    for converter in reversed(converters):
        weights = converter.export(weights, dtype)
    return weights


def for_model(
    config: TrainerConfig,
    *,
    trained: bool,
    shard_group: dist.ProcessGroup | None,
    device_type: str,
    param_dtype: torch.dtype | None,
) -> list[ModelConverter]:
    """The converters of the trained model (``trained``) or of the frozen reference, from ``config``.

    ``shard_group``: FSDP2's group (None: replicated); ``param_dtype``: the dtype the model computes in
    (autocast's, FSDP2's parameter dtype; None: float32), which LoRA stores the frozen base in.
    The reference gets no adapters (it is the initial policy).
    """
    out: list[ModelConverter] = []
    if config.pack_sequences:
        out.append(PackedAttentionConverter(config.packed_attention))
    if trained and config.lora is not None and config.role in config.lora.roles:
        keep = ("value_head",) if config.role == "critic" else ()
        out.append(LoRAConverter(config.lora, keep_trainable=keep, seed=config.seed, base_dtype=param_dtype))
    if config.compile_layers:
        out.append(CompileConverter())
    if shard_group is not None:
        out.append(ShardingConverter(shard_group, device_type, param_dtype))
    return out
