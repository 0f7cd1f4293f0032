"""The torch backend's AdamW state: made eagerly, keyed by parameter name, gathered and loaded.

``optimizer.pt`` holds AdamW's state dict keyed by parameter name (``optimizer_format``), the layout
``torch.distributed.checkpoint`` uses for full state dicts; ``optimizer.state_dict()`` keys it by
index. These functions take the model and its optimizer (and whether FSDP2 shards them), not a
trainer: the backend calls them for ``hf_optimizer_state`` / ``load_hf_optimizer_state`` and the
checkpoint code for its files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

# Whole tensors, gathered to rank 0's host memory (other ranks get empty dicts).
GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)


def init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam/AdamW's state for every parameter now, as its first step would (zeros, step 0).

    The tensors are the ones ``torch.optim.Adam._init_group`` makes lazily (same dtype, device and
    memory format), so the training that follows is bit for bit the same; a parameter that already
    has state keeps it. The step after this finds the state present and skips its own creation.
    """
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise ValueError(f"init_adam_state: expected Adam or AdamW, got {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        fused = bool(group.get("fused"))
        on_device = bool(group.get("capturable")) or fused
        for p in group["params"]:
            state = optimizer.state[p]
            if len(state) != 0:
                continue
            if on_device:
                state["step"] = torch.zeros((), dtype=_scalar_dtype(fused), device=p.device)
            else:
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype(False), device="cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _scalar_dtype(fused: bool) -> torch.dtype:
    # torch.optim.optimizer._get_scalar_dtype: float32 for fused, else the default dtype's width.
    if fused:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _trainable_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def _keyed_by_name(state: dict[str, Any]) -> bool:
    # The param groups list every parameter even before the first step, when "state" is empty.
    return any(isinstance(p, str) for group in state["param_groups"] for p in group["params"])


def state_by_name(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """An ``optimizer.state_dict()`` (keyed by parameter index) keyed by parameter name instead, the
    layout ``torch.distributed.checkpoint`` uses for full state dicts. A named one is returned as is."""
    if _keyed_by_name(state):
        return state
    names = _trainable_names(model)
    by_index = {i: names[i] for i in range(len(names))}
    return {
        "state": {by_index[int(k)]: v for k, v in state["state"].items()},
        "param_groups": [
            {**g, "params": [by_index[int(i)] for i in g["params"]]} for g in state["param_groups"]
        ],
    }


def state_by_index(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The inverse of ``state_by_name``, for ``optimizer.load_state_dict``."""
    if not _keyed_by_name(state):
        return state
    index = {name: i for i, name in enumerate(_trainable_names(model))}
    unknown = sorted(set(state["state"]) - set(index))
    if unknown:
        raise ValueError(f"optimizer state names parameters this model lacks: {unknown[:5]}")
    return {
        "state": {index[k]: v for k, v in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
    }


def named_state(model: nn.Module, optimizer: torch.optim.Optimizer, sharded: bool) -> dict[str, Any]:
    """AdamW's state keyed by name, whole tensors: the optimizer's own (replicated), or gathered to
    rank 0's CPU by a collective (sharded; the other ranks get an empty dict)."""
    if not sharded:
        return state_by_name(model, optimizer.state_dict())
    # torch.distributed.checkpoint fills an empty optimizer state by taking a step with lr 0, which
    # would count as Adam's first step: an empty state (never since the state is made at setup, kept
    # for optimizers without that) has nothing to gather anyway.
    if not optimizer.state:
        return state_by_name(model, optimizer.state_dict())
    return _compact(dict(get_optimizer_state_dict(model, optimizer, options=GATHER)))


def _compact(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """The state with each tensor in storage of its own size. A gathered tensor whose rows did not
    split evenly is a view of the gather's padded buffer on CPU (``.cpu()`` compacts it on a GPU), and
    ``torch.save`` writes a tensor's whole storage: the file would then depend on the device and on how
    it was gathered (``checkpoint.sharded`` assembles compact tensors)."""

    def own(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.untyped_storage().nbytes() != v.numel() * v.element_size():
            return v.clone()
        return v

    if "state" not in optimizer_state:  # ranks other than 0 gather nothing
        return optimizer_state
    state = {n: {k: own(v) for k, v in values.items()} for n, values in optimizer_state["state"].items()}
    return {**optimizer_state, "state": state}


def load_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any], sharded: bool
) -> None:
    """An ``optimizer.pt`` dict (keyed by index or by name; either backend's) into ``optimizer``, in the
    tensors it holds (the memory backend tracks them). Every rank passes the whole dict; call it under
    the memory backend's optimizer region."""
    whole = dict(state)
    before = {p: dict(s) for p, s in optimizer.state.items()}
    named = state_by_name(model, whole)
    if sharded and named["state"]:
        set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(full_state_dict=True))
    else:  # also an empty state into sharded ranks (see named_state): no tensors to shard
        optimizer.load_state_dict(state_by_index(model, whole))
    _into_previous_tensors(optimizer, before)
    init_adam_state(optimizer)  # a checkpoint written before any step may hold none


def _into_previous_tensors(optimizer: torch.optim.Optimizer, before: Mapping[Any, Mapping[str, Any]]) -> None:
    """Copy the loaded state into the tensors the optimizer held before the load, where they match.

    The memory backend keeps a host buffer per tracked storage (allocated at setup): new storages
    would need new buffers in the next sleep. Tensors read from a file may also share a storage that
    cannot be resized; the others get their own copies so the backend can release them.
    """
    for param, state in optimizer.state.items():
        old = before.get(param, {})
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            previous = old.get(key)
            if (
                isinstance(previous, torch.Tensor)
                and type(previous) is type(value)
                and previous.shape == value.shape
                and previous.dtype == value.dtype
                and previous.device == value.device
            ):
                previous.copy_(value)
                state[key] = previous
            else:
                state[key] = value.clone()
