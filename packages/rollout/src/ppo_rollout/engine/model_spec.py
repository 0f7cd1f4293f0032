"""The static decoder's view of a model: its family's :class:`~ppo_weight_sync.families.DecoderSpec`
checked against the model's config and modules, and resolved layer by layer (:class:`LayerPlan`).

A model the decoder does not compute gets a one-line reason from :func:`unsupported_reason`; the
engine then decodes it with the transformers forward (the decode loop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from ppo_weight_sync.families import DecoderSpec, decoder_model_types, find_family

__all__ = ["ACTIVATIONS", "LayerPlan", "layer_types", "unsupported_reason"]

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),  # transformers' GELUTanh
}
"""The MLP activations the decoder computes, by their transformers names."""

# RoPE types whose frequencies are fixed at load time (the "dynamic" and "longrope" kinds change them
# with the sequence length, which a captured graph cannot follow).
_STATIC_ROPE = frozenset({"default", "linear", "llama3"})
_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def layer_types(config: Any) -> list[str]:
    """Each layer's attention type (``config.layer_types``; all ``full_attention`` without it)."""
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    return list(getattr(config, "layer_types", None) or ["full_attention"] * layers)


def _spec(config: Any) -> DecoderSpec | None:
    family = find_family(getattr(config, "model_type", None))
    return None if family is None else family.decoder


def _activation(config: Any, spec: DecoderSpec) -> str:
    return str(getattr(config, spec.activation_field, None) or "silu")


def _rope_prefixes(config: Any, spec: DecoderSpec) -> list[str]:
    """Each layer's rotary table: ``""`` for ``rotary_emb.inv_freq``, ``"<type>_"`` for one per type."""
    return (
        [f"{t}_" for t in layer_types(config)]
        if spec.rope_per_layer_type
        else [""] * len(layer_types(config))
    )


def _rope_reason(config: Any) -> str | None:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return None
    # One entry per layer type (Gemma 3) or one for every layer.
    entries = list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    for entry in entries:
        rope_type = entry.get("rope_type", entry.get("type", "default"))
        if rope_type not in _STATIC_ROPE:
            return f"rope type {rope_type!r} (only {sorted(_STATIC_ROPE)})"
    return None


def _config_reason(config: Any, spec: DecoderSpec) -> str | None:
    act = _activation(config, spec)
    if act not in spec.activations or act not in ACTIVATIONS:
        return f"{spec.activation_field} {act!r} (only {list(spec.activations)})"
    for field, what in spec.refused:
        if getattr(config, field, None):
            return f"{what} ({field}={getattr(config, field)!r})"
    types = layer_types(config)
    if set(types) - _LAYER_TYPES:
        return f"layer types {sorted(set(types) - _LAYER_TYPES)} (only {sorted(_LAYER_TYPES)})"
    if "sliding_attention" in types or getattr(config, "use_sliding_window", False):
        if not spec.sliding_window:
            return "sliding-window attention"
        if not getattr(config, "sliding_window", None):
            return "sliding_attention layers but no config.sliding_window"
    return _rope_reason(config)


def unsupported_reason(model: Any) -> str | None:
    """Why ``model`` cannot use the static decoder, or None when it can."""
    config = getattr(model, "config", None)
    spec = _spec(config)
    if spec is None:
        model_type = getattr(config, "model_type", None)
        return (
            f"model_type {model_type!r} is not one of the static decoder's families {decoder_model_types()}"
        )
    reason = _config_reason(config, spec)
    if reason is not None:
        return reason
    base: Any = getattr(model, "model", None)
    if getattr(model, "lm_head", None) is None or getattr(base, "layers", None) is None:
        return "no model.layers / lm_head"
    rotary = getattr(base, "rotary_emb", None)
    for prefix in sorted(set(_rope_prefixes(config, spec))):
        if getattr(rotary, f"{prefix}inv_freq", None) is None:
            return f"no model.rotary_emb.{prefix}inv_freq (transformers older than 4.48?)"
    if spec.embedding_scale and getattr(base.embed_tokens, "embed_scale", None) is None:
        return "the embedding module does not scale (no embed_tokens.embed_scale)"
    return None


@dataclass(frozen=True)
class LayerPlan:
    """What the decoder computes for each layer of one model: its family's ``spec``, the attention
    ``scaling``, the MLP ``activation``, each layer's sliding window (None: every earlier token) and
    rotary table prefix (``""``: ``rotary_emb.inv_freq``; ``"<type>_"``: ``<type>_inv_freq``)."""

    spec: DecoderSpec
    scaling: float
    activation: Callable[[torch.Tensor], torch.Tensor]
    windows: tuple[int | None, ...]
    rope: tuple[str, ...]

    @classmethod
    def of(cls, model: Any) -> LayerPlan:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the static decoder does not support this model: {reason}")
        config = model.config
        spec = _spec(config)
        assert spec is not None  # unsupported_reason said so
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        query_scale = getattr(config, spec.query_scale_field) if spec.query_scale_field else head_dim
        window = getattr(config, "sliding_window", None)
        types = layer_types(config)
        return cls(
            spec=spec,
            scaling=float(query_scale**-0.5),
            activation=ACTIVATIONS[_activation(config, spec)],
            windows=tuple(int(window) if t == "sliding_attention" and window else None for t in types),
            rope=tuple(_rope_prefixes(config, spec)),
        )

    @property
    def window(self) -> int | None:
        """The sliding window of the model's sliding layers (they share one), None when it has none."""
        return next((w for w in self.windows if w is not None), None)
