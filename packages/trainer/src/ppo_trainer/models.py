"""Model construction for the torch backend: the actor (a causal LM), the critic (the same architecture's
backbone with a scalar value head) and the frozen reference policy.

Models are built in float32 (the optimizer's master copy); compute runs under autocast where the
config asks for bfloat16.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.utils import logging as hf_logging

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def has_weights(model_path: str | Path) -> bool:
    """Whether a Hugging Face folder holds weights (otherwise it only describes an architecture)."""
    folder = Path(model_path)
    return any((folder / name).exists() for name in _WEIGHT_FILES)


def _check_folder(model_path: str | Path) -> Path:
    folder = Path(model_path)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"model_path={str(model_path)!r} has no config.json; give a local Hugging Face model folder "
            "(save_pretrained output)"
        )
    return folder


def load_causal_lm(model_path: str | Path, seed: int) -> PreTrainedModel:
    """The actor: ``AutoModelForCausalLM`` from a local folder in float32 (config only: init from seed)."""
    folder = _check_folder(model_path)
    if has_weights(folder):
        model = AutoModelForCausalLM.from_pretrained(folder)
    else:
        config = AutoConfig.from_pretrained(folder)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.float()


def count_parameters(model_path: str | Path) -> int:
    """The causal LM's parameter count, from its config alone (built on the meta device: no memory)."""
    config = AutoConfig.from_pretrained(_check_folder(model_path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def hidden_size(config: PretrainedConfig) -> int:
    """The width of a transformers config's hidden states (``hidden_size``, ``n_embd`` or ``d_model``)."""
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"cannot find the hidden size of {type(config).__name__}; expected hidden_size")


class CriticModel(nn.Module):
    """The actor's architecture without its LM head, plus ``value_head: Linear(hidden, 1)``.

    ``forward`` returns one scalar per position, ``[B, L]``: the value at position ``p`` is the estimate
    after reading tokens ``0..p``, i.e. before the token at ``p + 1``.
    """

    def __init__(self, backbone: PreTrainedModel, seed: int) -> None:
        super().__init__()
        self.backbone = backbone
        hidden = hidden_size(backbone.config)
        self.value_head = nn.Linear(hidden, 1)
        self.reset_value_head(seed)

    def reset_value_head(self, seed: int) -> None:
        """A fresh head: small normal weights (std 1/sqrt(hidden+1)), zero bias, from ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        hidden = self.value_head.in_features
        with torch.no_grad():
            weight = torch.randn(self.value_head.weight.shape, generator=generator) / math.sqrt(hidden + 1)
            self.value_head.weight.copy_(weight)
            self.value_head.bias.zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **attention_kwargs: Any,
    ) -> torch.Tensor:
        """``position_ids`` and ``attention_kwargs`` (``cu_seq_lens_q``, ...): packed samples."""
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **attention_kwargs,
        )
        hidden = out.last_hidden_state
        # Not a view: FSDP2 hooks the backward of a sharded module's output, and an in-place op on
        # a view of it would skip that hook (it warns about view outputs).
        return self.value_head(hidden).squeeze(-1).clone()


def load_critic(model_path: str | Path, seed: int, *, weights: bool = True) -> CriticModel:
    """The critic from a causal-LM (policy) checkpoint: its backbone weights and a fresh value head.

    ``AutoModel`` strips the causal LM's prefix and drops its LM head, so a policy checkpoint loads
    without complaint about the head it lacks. ``weights=False``: the architecture alone, initialised
    from ``seed`` (weights that ``critic_init`` loads next).
    """
    folder = _check_folder(model_path)
    if weights and has_weights(folder):
        # The policy's LM head is expected to be left out: keep transformers' load report quiet.
        previous = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            backbone = AutoModel.from_pretrained(folder)
        finally:
            hf_logging.set_verbosity(previous)
    else:
        config = AutoConfig.from_pretrained(folder)
        torch.manual_seed(seed)
        backbone = AutoModel.from_config(config)
    return CriticModel(backbone.float(), seed).float()


def load_policy_state_into_critic(critic: CriticModel, state: Mapping[str, torch.Tensor]) -> list[str]:
    """Load a state dict into the critic, accepting a critic checkpoint or a causal-LM (policy) one.

    Keys may be the critic's own (``backbone.*``, ``value_head.*``), the backbone's bare names, or the
    causal LM's names (``<base_model_prefix>.*``; ``lm_head.*`` is ignored). Every backbone tensor must be
    found (else ``ValueError`` listing the missing ones); a missing value head keeps its fresh weights.
    Returns the names of critic parameters left at their fresh values.
    """
    mapped, missing = map_policy_state_to_critic(critic, state)
    critic.load_state_dict(mapped, strict=False)
    return missing


def map_policy_state_to_critic(
    critic: nn.Module, state: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``state`` under the critic's names, and the critic's names it leaves fresh (see
    ``load_policy_state_into_critic``, which loads the result; a sharded critic loads it through
    ``torch.distributed.checkpoint``)."""
    own = critic.state_dict()
    backbone = critic.get_submodule("backbone")
    prefix = getattr(backbone, "base_model_prefix", "")
    mapped: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        candidates = [key, f"backbone.{key}"]
        if prefix and key.startswith(prefix + "."):
            candidates.append(f"backbone.{key[len(prefix) + 1 :]}")
        for name in candidates:
            if name in own:
                if tuple(own[name].shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"checkpoint tensor {key!r} has shape {tuple(tensor.shape)} "
                        f"but the critic's {name!r} "
                        f"has {tuple(own[name].shape)}; the checkpoint is of another architecture"
                    )
                mapped[name] = tensor
                break
    missing = [name for name in own if name not in mapped]
    missing_backbone = [name for name in missing if not name.startswith("value_head.")]
    if missing_backbone:
        shown = ", ".join(missing_backbone[:5])
        raise ValueError(
            f"checkpoint lacks {len(missing_backbone)} backbone tensors of the critic (e.g. {shown}); "
            "it is not a checkpoint of this architecture"
        )
    return mapped, missing


def load_reference(model_path: str | Path, seed: int, dtype: torch.dtype) -> PreTrainedModel:
    """The frozen reference policy (the initial actor), in ``dtype``, without gradients."""
    model = load_causal_lm(model_path, seed)
    nn.Module.to(model, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model
