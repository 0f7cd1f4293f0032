"""The optimizer state in a checkpoint's ``optimizer.pt``, shared by both backends.

The file holds a ``torch.optim.AdamW`` state dict keyed by Hugging Face parameter name (the layout
``torch.distributed.checkpoint`` uses for full state dicts): ``{"state": {name: {"step", "exp_avg",
"exp_avg_sq"}}, "param_groups": [{..., "params": [names]}]}``, whole float32 tensors, tensors and
numbers only (``torch.load(..., weights_only=True)`` reads it). The torch backend writes its own
``AdamW`` state dict (``torch_optimizer``); the megatron backend converts its ``DistributedOptimizer``'s
state to this layout (``MegatronTrainer.hf_optimizer_state``) and back.

- :func:`adam_state_dict` builds such a dict from per-name moments and the step count, with param
  groups a real ``AdamW`` of this torch version would write (so the torch backend, which takes its
  hyperparameters from the file, loads it as its own).
- :func:`read_adam_state` checks one (``ValueError`` naming what is wrong) and returns its moments and
  its single step count.
- :func:`moments_to_megatron` / :func:`moments_to_hf`: Adam's moments have their parameter's shape
  and are elementwise, so they take the weights' conversion (``megatron_convert``: names, fused QKV
  and gate-up layouts) unchanged; a tied output layer has no state of its own.
- the torch backend's side: ``checkpoint.torch_optimizer``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ppo_trainer import megatron_convert as mc

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class AdamState:
    """What a resume needs of an ``optimizer.pt``: moments per key and name, and the step count."""

    moments: dict[str, dict[str, torch.Tensor]]  # "exp_avg" / "exp_avg_sq" -> {HF name: tensor}
    step: int


def adam_param_group(
    names: Sequence[str], lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> dict[str, Any]:
    """One param group as this torch version's ``AdamW.state_dict()`` writes it, ``params`` by name.

    Taken from a throwaway ``AdamW``: ``load_state_dict`` adopts the file's hyperparameters, and one
    missing (``decoupled_weight_decay`` in torch >= 2.6) would fall back to plain Adam's default."""
    probe = torch.optim.AdamW([torch.zeros(1)], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    group = dict(probe.state_dict()["param_groups"][0])
    group["params"] = list(names)
    return group


def adam_state_dict(
    moments: Mapping[str, Mapping[str, torch.Tensor]], step: int, group: Mapping[str, Any]
) -> dict[str, Any]:
    """An ``optimizer.pt`` dict: every name of ``group["params"]`` with its moments and ``step``
    (a float32 CPU scalar, as a non-fused, non-capturable ``AdamW`` holds it)."""
    names = list(group["params"])
    for key in ADAM_MOMENTS:
        missing = [n for n in names if n not in moments.get(key, {})]
        if missing:
            raise ValueError(f"adam_state_dict: no {key} for {len(missing)} parameters (e.g. {missing[:3]})")
    state = {
        name: {
            "step": torch.tensor(float(step), dtype=torch.float32),
            **{key: moments[key][name].detach().float().contiguous() for key in ADAM_MOMENTS},
        }
        for name in names
    }
    return {"state": state, "param_groups": [dict(group)]}


def read_adam_state(state: Mapping[str, Any], names: Sequence[str], source: str) -> AdamState:
    """The moments and step count of an ``optimizer.pt`` dict for a model whose trainable parameters
    are ``names``; ``ValueError`` (naming ``source``) when it is not one of this model's Adam states."""
    if not isinstance(state, Mapping) or "state" not in state or "param_groups" not in state:
        raise ValueError(f"{source}: not an optimizer state dict (it needs 'state' and 'param_groups')")
    per_name = state["state"]
    if any(not isinstance(k, str) for k in per_name) or any(
        not isinstance(p, str) for g in state["param_groups"] for p in g["params"]
    ):
        raise ValueError(
            f"{source}: the optimizer state is keyed by parameter index (checkpoint format 1); "
            "resume it on train.backend='torch', which maps indices to names"
        )
    missing = [n for n in names if n not in per_name]
    unknown = sorted(set(per_name) - set(names))
    if missing or unknown:
        raise ValueError(
            f"{source}: the optimizer state does not match this model: missing {missing[:5]}, "
            f"unknown {unknown[:5]}"
        )
    steps = set()
    moments: dict[str, dict[str, torch.Tensor]] = {key: {} for key in ADAM_MOMENTS}
    for name in names:
        entry = per_name[name]
        absent = [k for k in ("step", *ADAM_MOMENTS) if k not in entry]
        if absent:
            raise ValueError(f"{source}: the optimizer state of {name!r} lacks {absent}; is it Adam's?")
        steps.add(float(entry["step"]))
        for key in ADAM_MOMENTS:
            moments[key][name] = entry[key]
    if len(steps) > 1:
        raise ValueError(f"{source}: parameters are at different Adam steps {sorted(steps)[:4]}")
    return AdamState(moments=moments, step=int(steps.pop()) if steps else 0)


def optimizer_names(shape: mc.ModelShape, critic: bool) -> list[str]:
    """The trainable parameters' Hugging Face names, in ``named_parameters`` order (a tied output
    layer is the embedding: one parameter, listed once, as ``torch.optim`` sees it)."""
    names = mc.hf_names(shape, critic)
    if shape.tied_embeddings and not critic:
        names.remove("lm_head.weight")
    return names


def moments_to_megatron(
    moments: Mapping[str, torch.Tensor], shape: mc.ModelShape, critic: bool
) -> dict[str, torch.Tensor]:
    """One moment (``exp_avg`` or ``exp_avg_sq``) per Hugging Face name to megatron names and layouts."""
    return mc.hf_to_megatron(moments, shape, critic=critic)


def moments_to_hf(
    moments: Mapping[str, torch.Tensor], shape: mc.ModelShape, critic: bool
) -> dict[str, torch.Tensor]:
    """Megatron whole moment tensors to Hugging Face names and layouts (no tied alias)."""
    hf = mc.megatron_to_hf(moments, shape, critic=critic)
    return {name: hf[name] for name in optimizer_names(shape, critic)}


__all__ = [
    "ADAM_MOMENTS",
    "AdamState",
    "adam_param_group",
    "adam_state_dict",
    "moments_to_hf",
    "moments_to_megatron",
    "optimizer_names",
    "read_adam_state",
]
