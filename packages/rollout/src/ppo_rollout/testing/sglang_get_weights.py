"""The stand-in's ``/get_weights_by_name``, as SGLang v0.5.17 answers it for a Llama model.

Followed from ``sglang/srt/models/llama.py`` ``LlamaForCausalLM.get_weights_by_name`` (TP 1) and
``sglang/srt/entrypoints/http_server.py`` (the route, GET or POST; ``_create_error_response``):

- ``lm_head.weight`` of a model with ``tie_word_embeddings`` answers ``model.embed_tokens.weight``;
- names holding ``.q_proj``/``.k_proj``/``.v_proj`` read their rows of the fused ``.qkv_proj`` (q at 0,
  k after ``num_heads * head_dim``, v after that), ``.gate_proj``/``.up_proj`` theirs of ``.gate_up_proj``
  (``stacked_params_mapping``): the stand-in builds those fused parameters from its own and cuts them
  the same way, so the offsets are checked, not assumed;
- the answer is ``weight.cpu().to(torch.float32).numpy().tolist()[:truncate_size]`` (``truncate_size``
  default 100): the first rows of a 2-D weight, the first values of a 1-D one;
- a name that is not a parameter (the lookup raises, the model returns None): 400
  ``{"error": {"message": "Get parameter by name failed"}}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ppo_weight_sync.requests import ValidationError

__all__ = ["FAILED", "get_weights_by_name", "sglang_params"]

FAILED = "Get parameter by name failed"
_STACKED = (  # (param_name, shard_name, shard_id), llama.py's order
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)


def sglang_params(held: Mapping[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """SGLang's parameters of a Llama model from its Hugging Face tensors: q/k/v and gate/up fused (in
    that order, along rows), ``lm_head.weight`` the embedding when tied, no buffers (``rotary_emb``)."""
    params: dict[str, torch.Tensor] = {}
    for name, t in held.items():
        if "rotary_emb" in name:
            continue
        fused = next(((p, s) for p, s, _ in _STACKED if s in name), None)
        if fused is None:
            params[name] = t
            continue
        param, shard = fused
        target = name.replace(shard, param)
        if target in params:
            continue
        parts = [held[name.replace(shard, s)] for p, s, _ in _STACKED if p == param]
        params[target] = torch.cat(parts, dim=0)
    if tied:
        params["lm_head.weight"] = params["model.embed_tokens.weight"]
    return params


def _lookup(params: Mapping[str, torch.Tensor], config: Any, name: str) -> torch.Tensor:
    for param, shard, shard_id in _STACKED:
        if shard not in name:
            continue
        whole = params[name.replace(shard, param)]  # KeyError: not a parameter
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        head_dim = config.hidden_size // heads
        offsets = {
            "q": (0, heads * head_dim),
            "k": (heads * head_dim, kv * head_dim),
            "v": ((heads + kv) * head_dim, kv * head_dim),
            0: (0, config.intermediate_size),
            1: (config.intermediate_size, config.intermediate_size),
        }
        offset, size = offsets[shard_id]
        return whole.narrow(0, offset, size)
    return params[name]


def get_weights_by_name(
    held: Mapping[str, torch.Tensor], config: Any, body: Mapping[str, Any] | None
) -> tuple[int, Any]:
    """The route's status and body for request ``body`` (``GetWeightsByNameReqInput``)."""
    data = body or {}
    name = data.get("name")
    if not isinstance(name, str):
        raise ValidationError("body.name: Input should be a valid string")
    truncate = data.get("truncate_size", 100)
    if not isinstance(truncate, int) or isinstance(truncate, bool):
        raise ValidationError("body.truncate_size: Input should be a valid integer")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    try:
        if name == "lm_head.weight" and tied:
            weight = held["model.embed_tokens.weight"]
        else:
            weight = _lookup(sglang_params(held, tied), config, name)
    except KeyError:
        return 400, {"error": {"message": FAILED}}
    return 200, weight.detach().cpu().to(torch.float32).numpy().tolist()[:truncate]
