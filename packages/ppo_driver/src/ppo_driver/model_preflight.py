"""Checks of a ``train.lora`` run against the model itself, before Ray starts (``preflight.check``).

The model is built on torch's meta device from its folder's ``config.json`` (or from the tiny model's
settings): no weights are read and no memory is taken, and the trainer's own rules then apply to it:

- ``train.lora.target_modules`` names linear layers of the decoder layers (``LoRAConverter``'s rule;
  today a wrong name fails in the trainer after Ray and the roles started);
- ``train.lora.share_base`` on CPU maps the frozen base from ``/dev/shm``: that folder holds the base of
  every actor rank (Docker gives a container 64 MB by default, a 135M-parameter base in float32 is
  538 MB; a mapping past the end kills the actor with SIGBUS).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from ppo_driver.config import RunConfig

__all__ = ["SHM", "lora_problems"]

SHM = "/dev/shm"
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def lora_problems(config: RunConfig) -> list[str]:
    """One line per problem of ``train.lora`` with this model; none without ``train.lora``, or when the
    model's config cannot be read here (``preflight`` reports a missing or broken model folder)."""
    from ppo_driver import build

    lora = config.train.lora
    if lora is None:
        return []
    shares = config.placement.device == "cpu" and build.shares_base(config)
    if not lora.target_modules and not shares:
        return []
    model = _meta_model(config)
    if model is None:
        return []
    problems = _target_problems(lora.target_modules, model)
    if shares:
        problems += _shared_memory_problems(config, model)
    return problems


def _model_config(config: RunConfig) -> Any:
    from transformers import AutoConfig

    if config.model.path is None:  # the built-in tiny model: make_tiny_model's own config
        from ppo_rollout.tasks import tiny_model_config

        t = config.model.tiny
        return tiny_model_config(
            hidden_size=t.hidden_size,
            num_layers=t.num_layers,
            num_heads=t.num_heads,
            intermediate_size=t.intermediate_size,
            max_positions=t.max_positions,
        )
    folder = Path(config.model.path).expanduser()
    if not (folder / "config.json").is_file():
        return None
    try:
        json.loads((folder / "config.json").read_text())
        return AutoConfig.from_pretrained(folder)
    except Exception:  # an unknown architecture or a broken file: the model's own checks say so
        return None


def _meta_model(config: RunConfig) -> nn.Module | None:
    """The causal LM of ``model.path`` on the meta device (shapes only), or None if it cannot be built."""
    import torch
    from transformers import AutoModelForCausalLM

    model_config = _model_config(config)
    if model_config is None:
        return None
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(model_config)
    except Exception:  # not a causal LM transformers can build here: the trainer's load says why
        return None


def _target_problems(targets: tuple[str, ...], model: nn.Module) -> list[str]:
    from ppo_trainer.converters.lora import linear_layer_names

    available = linear_layer_names(model)
    unknown = [t for t in targets if t not in available]
    if not unknown:
        return []
    return [
        f"train.lora.target_modules: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a "
        f"linear layer of {type(model).__name__}'s decoder layers; its linear layers are "
        f"{', '.join(available)} (or leave target_modules empty for all of them)"
    ]


def _shared_memory_problems(config: RunConfig, model: nn.Module) -> list[str]:
    dtype = "float32" if config.model.dtype == "auto" else config.model.dtype  # auto is float32 on cpu
    base = sum(p.numel() for p in model.parameters()) * _BYTES.get(dtype, 4)
    ranks = config.placement.actor_gpus  # each actor rank publishes its own copy
    need = base * ranks
    try:
        free = shutil.disk_usage(SHM).free
    except OSError:
        return []  # no /dev/shm: the trainer says so (share_base on CPU needs it)
    if need <= free:
        return []
    return [
        f"train.lora.share_base maps the frozen base from {SHM} on CPU ({_mb(base)} per actor rank, "
        f"{_mb(need)} for {ranks}), which has {_mb(free)} free; give the container more "
        f"(docker run --shm-size={_suggest(need)}) or set train.lora.share_base=false"
    ]


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


def _suggest(need: int) -> str:
    """A ``--shm-size`` with room for Ray's object store beside the base: twice the need, in GB."""
    return f"{max(1, -(-2 * need // 10**9))}g"
