"""``train.lora``: low-rank adapters on the decoder layers' linear layers, the base frozen.

Each chosen ``nn.Linear`` becomes a ``LoRALinear`` holding the same ``weight`` and ``bias`` Parameters
under the same names, plus ``lora_A`` (``rank x in``) and ``lora_B`` (``out x rank``):
``y = x W^T + b + (alpha / rank) * B A dropout(x)``. ``A`` starts Kaiming-uniform and ``B`` at zero, so
the converted model computes exactly what the base does until the first step (the initialisation and
scale of LoRA's paper, and of peft 0.21.2's ``LoraLayer`` in ``peft/tuners/lora/layer.py``:
``reset_lora_parameters``, and the scale ``lora_alpha / r`` without rsLoRA; torchtitan's
``LoRALinear`` in ``torchtitan/components/lora.py``, commit 0b83f010, keeps the base weight in place
the same way).

Written here rather than taken from peft: peft is no dependency of the trainer, and its wrapper
renames the base (``base_model.model.<path>.base_layer.weight``), while here every base tensor keeps
its Hugging Face name and the adapters sit beside it (``<path>.lora_A.weight``), so checkpoints,
the optimizer's names and the weight update stay predictable. ``export`` merges: the engines and the
``hf/`` folder get ``W + (alpha / rank) B A`` under the base's name and no adapter tensor.

With a bfloat16 compute dtype (CUDA's default) the frozen base is stored in bfloat16 (2 bytes a
parameter instead of 4); the adapters and the critic's value head stay float32, as their gradients
and AdamW state do. The merge is computed in float32 and returned in the base's dtype.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ppo_trainer.config import LoraSettings
from ppo_trainer.converters.protocol import NamedTensors
from ppo_trainer.sharding import decoder_blocks
from ppo_weight_sync.lora import ADAPTER_LEAVES, adapter_module, merge_lora

__all__ = [
    "LoRAConverter",
    "LoRALinear",
    "adapter_state",
    "adapters_disabled",
    "is_adapter_name",
    "linear_layer_names",
    "peft_adapter",
]


class LoRALinear(nn.Linear):
    """``base``'s weight and bias (the same Parameters, frozen) plus a trainable rank-``rank`` update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, generator: torch.Generator):
        # nn.Module's constructor, not nn.Linear's: that one would allocate a weight of its own.
        nn.Module.__init__(self)
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.scale = alpha / rank
        self.adapters_enabled = True
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        a = torch.empty(rank, self.in_features)
        # a=sqrt(5): nn.Linear's own initialisation, which peft and torchtitan use for A.
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        # float32 like every trained tensor, whatever dtype the frozen base is stored in.
        like = {"device": base.weight.device, "dtype": torch.float32}
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **like)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **like)
        with torch.no_grad():
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapters_enabled:
            return out
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scale

    def merged_weight(self) -> torch.Tensor:
        """``W + scale * B A`` (no gradient), in the weight's dtype."""
        with torch.no_grad():
            # The engines merge adapter-only updates with this function too: same inputs, same bits.
            return merge_lora(self.weight, self.lora_A.weight, self.lora_B.weight, self.scale)


def linear_layer_names(model: nn.Module) -> list[str]:
    """The names (last path component) of the ``nn.Linear`` layers inside ``model``'s decoder layers."""
    names = {
        path.rpartition(".")[2]
        for block in decoder_blocks(model)
        for path, module in block.named_modules()
        if isinstance(module, nn.Linear)
    }
    return sorted(names)


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    for path, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield path, module


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """``model`` computing as its base inside (every adapter off): the reference policy of a LoRA
    actor, without a copy of the model."""
    modules = [m for _, m in lora_modules(model)]
    previous = [m.adapters_enabled for m in modules]
    for m in modules:
        m.adapters_enabled = False
    try:
        yield
    finally:
        for m, was in zip(modules, previous, strict=True):
            m.adapters_enabled = was


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter tensor by its name in ``model`` (``<path>.lora_A.weight``, ``<path>.lora_B.weight``)."""
    out: dict[str, torch.Tensor] = {}
    for path, module in lora_modules(model):
        out[f"{path}.lora_A.weight"] = module.lora_A.weight.detach()
        out[f"{path}.lora_B.weight"] = module.lora_B.weight.detach()
    return out


class LoRAConverter:
    """Adapters on ``settings.target_modules`` of the decoder layers (all their linear layers when
    empty); every other parameter frozen except the modules named in ``keep_trainable`` (the critic's
    value head). Remembers the modules it converted and their scale, for ``export``."""

    name = "lora"

    def __init__(
        self,
        settings: LoraSettings,
        keep_trainable: tuple[str, ...] = (),
        seed: int = 0,
        base_dtype: torch.dtype | None = None,
    ):
        self.settings = settings
        self.keep_trainable = keep_trainable
        self.seed = seed
        self.base_dtype = base_dtype
        self.scales: dict[str, float] = {}
        self.targets: tuple[str, ...] = ()

    def convert(self, model: nn.Module) -> nn.Module:
        available = linear_layer_names(model)
        if not available:
            raise ValueError(
                f"train.lora: {type(model).__name__} has no decoder layers with linear layers (transformers' "
                "_no_split_modules names none); remove train.lora for this model"
            )
        wanted = self.settings.target_modules or tuple(available)
        unknown = [t for t in wanted if t not in available]
        if unknown:
            raise ValueError(
                f"train.lora.target_modules: {unknown} are not linear layers of {type(model).__name__}'s "
                f"decoder layers; its linear layers are {available}"
            )
        self.targets = tuple(wanted)
        model.requires_grad_(False)
        # One generator over all adapters, in module order: the same seed gives the same A everywhere.
        generator = torch.Generator().manual_seed(self.seed)
        path_of = {id(m): p for p, m in model.named_modules()}
        targets = [
            (f"{path_of[id(block)]}.{sub}", module)
            for block in decoder_blocks(model)
            for sub, module in block.named_modules()
            if isinstance(module, nn.Linear) and sub.rpartition(".")[2] in wanted
        ]
        s = self.settings
        for path, module in targets:
            parent_path, _, leaf = path.rpartition(".")
            wrapped = LoRALinear(module, s.rank, s.alpha, s.dropout, generator)
            model.get_submodule(parent_path).register_module(leaf, wrapped)
            self.scales[path] = wrapped.scale
        for path in self.keep_trainable:
            model.get_submodule(path).requires_grad_(True)
        if self.base_dtype is not None:
            # The frozen base needs no float32 master copy: autocast computes in base_dtype anyway
            # (the same dtype the full fine-tuning's reference model is held in), and it halves the
            # largest share of a LoRA role's memory.
            with torch.no_grad():
                for p in model.parameters():
                    if not p.requires_grad:
                        p.data = p.data.to(self.base_dtype)
        return model

    def export(self, weights: NamedTensors, dtype: torch.dtype | None) -> NamedTensors:
        """The base weight of each converted layer merged with its adapters (under the base's name),
        from the three tensors cast to ``dtype`` first (None: as they are); the adapter tensors themselves
        left out; everything else as it comes."""
        held: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            path, leaf = _split_adapter_name(name, self.scales)
            if path is None:
                yield name, tensor
                continue
            parts = held.setdefault(path, {})
            # Cast before the merge (to the sync dtype on a weight update): an engine given the adapters
            # alone merges them, in that dtype, onto the base it holds; both then hold the same bits.
            parts[leaf] = tensor if dtype is None else tensor.detach().to(dtype)
            if len(parts) == 3:
                del held[path]
                merged = merge_lora(
                    parts["weight"], parts["lora_A.weight"], parts["lora_B.weight"], self.scales[path]
                )
                yield f"{path}.weight", merged
        if held:
            raise RuntimeError(f"train.lora export: adapters or base weights missing for {sorted(held)[:3]}")


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` is an adapter tensor's (``<path>.lora_A.weight`` or ``.lora_B.weight``)."""
    return adapter_module(name) is not None


def peft_adapter(
    converter: LoRAConverter, state: Mapping[str, torch.Tensor], base_model: str
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``adapter_config.json``'s content and ``adapter_model.safetensors``' tensors of a PEFT adapter
    folder, from a causal LM's ``state`` (its adapter tensors are picked).

    PEFT's format as its ``save_pretrained`` writes it (peft 0.21.2: ``peft/utils/constants.py``
    names the two files, ``peft/utils/save_and_load.py``'s ``get_peft_model_state_dict`` drops the
    adapter's name from the keys; ``PeftModel.from_pretrained`` of peft 0.21.2 loads the folder and its
    ``merge_and_unload`` gives the weights of ``hf/``): ``base_model.model.<module path>.lora_A.weight`` and
    ``.lora_B.weight``; ``PeftModel.from_pretrained(base, folder)`` loads it onto the base model.
    """
    tensors = {
        f"base_model.model.{name}": t.detach().contiguous()
        for name, t in state.items()
        if is_adapter_name(name)
    }
    s = converter.settings
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": s.rank,
        "lora_alpha": s.alpha,
        "lora_dropout": s.dropout,
        "target_modules": sorted(converter.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
    }
    return config, tensors


def _split_adapter_name(name: str, paths: dict[str, float]) -> tuple[str | None, str]:
    """``(path, leaf)`` when ``name`` is a converted layer's weight or adapter tensor, else ``(None, "")``."""
    for leaf in ("weight", *ADAPTER_LEAVES):
        suffix = "." + leaf
        if name.endswith(suffix) and name[: -len(suffix)] in paths:
            return name[: -len(suffix)], leaf
    return None, ""
