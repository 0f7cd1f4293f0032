"""The pieces of the static decoder's fused forward (``StaticDecoder(fused=True)``).

Each computes what transformers' modules of a family the decoder knows compute, in fewer kernels: a
captured decode step is several hundred small kernels whose launches, not their work, set its time. See
:mod:`ppo_rollout.engine.static_decode` for how the decoder uses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ppo_weight_sync.families import DecoderSpec

__all__ = [
    "GATE_UP",
    "QKV",
    "FusedLinear",
    "RmsNorm",
    "RopeTables",
    "fuse_linears",
    "fuse_projections",
    "rotate_rolled",
    "signed_sin",
]

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def _parameter(module: torch.nn.Module, name: str) -> torch.Tensor:
    """``module.<name>``, read at call time (a weight update may replace what the module holds)."""
    value = getattr(module, name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.{name} is {type(value).__name__}, not a tensor")
    return value


@dataclass(frozen=True)
class RmsNorm:
    """One of the model's RMSNorms. ``eps`` is set when the module is one of the transformers classes
    its family's :class:`~ppo_weight_sync.families.DecoderSpec` names (``norm_classes``), whose formula
    (``spec.norm``) :meth:`__call__` computes with ``F.rms_norm`` (one kernel on CUDA instead of about
    seven); None for any other class, which is called as it is. ``one_plus``: the weight multiplies as
    ``1 + weight`` in float32 before the cast back (Gemma), not after it (Llama)."""

    module: torch.nn.Module
    eps: float | None
    one_plus: bool = False

    @classmethod
    def of(cls, module: torch.nn.Module, spec: DecoderSpec | None = None) -> RmsNorm:
        kind = type(module)
        known = spec is not None and kind.__name__ in spec.norm_classes
        if not known or not kind.__module__.startswith("transformers.models."):
            return cls(module, None)
        assert spec is not None
        # A plain attribute (torch's stubs type it as a tensor): Llama's variance_epsilon, Gemma's eps.
        eps: object = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if not isinstance(eps, float | int):
            raise TypeError(f"{kind.__name__}.variance_epsilon/eps is {type(eps).__name__}, not a number")
        return cls(module, float(eps), spec.norm == "rms_one_plus")

    def __call__(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        if not fused or self.eps is None:
            return self.module(x)
        weight = _parameter(self.module, "weight")
        normed = F.rms_norm(x.float(), (weight.shape[-1],), eps=self.eps)
        if self.one_plus:
            # Gemma's order: (normalised * (1 + weight)) in float32, then cast.
            return (normed * (1.0 + weight.float())).to(x.dtype)
        # Llama's order of roundings: normalise in float32, cast to the input's dtype, then multiply by
        # the weight (F.rms_norm's own weight argument would multiply before the cast).
        return normed.to(x.dtype) * weight


@dataclass(frozen=True)
class FusedLinear:
    """Plain ``nn.Linear`` modules with one input that run as one matmul: a layer's q/k/v projections,
    or its gate/up projections.

    :func:`fuse_linears` stores their weights (and biases) as consecutive row blocks of one buffer and
    makes each module's parameters views into it, so the model holds no second copy and a weight update
    that writes into a module's parameter (``copy_``, as ``load_weights`` does) writes the buffer.
    :meth:`joined` reads the buffer back at call time and gives None when the parameters are not (or no
    longer) laid out so -- a parameter replaced by a tensor of its own -- and the decoder then calls the
    modules one by one: there is no joined copy that could go stale.
    """

    parts: tuple[torch.nn.Linear, ...]

    @classmethod
    def of(cls, module: torch.nn.Module, names: tuple[str, ...]) -> FusedLinear | None:
        parts = [module.get_submodule(n) for n in names]
        # A subclass (LoRA, quantised) may compute something else than weight @ x + bias.
        linears = tuple(p for p in parts if type(p) is torch.nn.Linear and isinstance(p, torch.nn.Linear))
        if len(linears) != len(parts):
            return None
        first = linears[0]
        for p in linears:
            if p.in_features != first.in_features or p.weight.dtype != first.weight.dtype:
                return None
            if p.weight.device != first.weight.device or (p.bias is None) != (first.bias is None):
                return None
        return cls(linears)

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(p.out_features for p in self.parts)

    def joined(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The weight [sum of out_features, in_features] (and bias) the parts' parameters are row blocks
        of, as views of their storage; None when they are not consecutive blocks of one storage."""
        weight = _consecutive([p.weight for p in self.parts])
        biases = [p.bias for p in self.parts if p.bias is not None]
        if weight is None or not biases:
            return None if weight is None else (weight, None)
        bias = _consecutive(biases)
        return None if bias is None else (weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """``cat([part(x) for part in parts], -1)`` as one matmul; None when the parts are not joined."""
        joined = self.joined()
        return None if joined is None else F.linear(x, joined[0], joined[1])


def _consecutive(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensors stacked along dim 0 as one view of their storage, if they are contiguous,
    consecutive blocks of one storage; else None."""
    first = tensors[0]
    base = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in tensors:
        if t.dtype != first.dtype or not t.is_contiguous() or t.storage_offset() != offset:
            return None
        if t.untyped_storage().data_ptr() != base:
            return None
        offset += t.numel()
    rows = sum(int(t.shape[0]) for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def fuse_linears(fused: FusedLinear) -> None:
    """Moves the parts' weights (and biases) into one buffer each and makes every part's parameter a
    view into it (in place: the parameters stay the same objects). Nothing to do if already joined."""
    if fused.joined() is not None:
        return
    with torch.no_grad():
        weight = torch.cat([p.weight.detach() for p in fused.parts])
        biases = [p.bias.detach() for p in fused.parts if p.bias is not None]
        bias = torch.cat(biases) if biases else None
    start = 0
    for part, width in zip(fused.parts, fused.widths, strict=True):
        part.weight.data = weight[start : start + width]
        if bias is not None and part.bias is not None:
            part.bias.data = bias[start : start + width]
        start += width


def rotate_rolled(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` as ``x * cos + roll(x, D/2) * sin_signed``.

    ``rotate_half(x) = cat(-x2, x1)`` and ``roll(x, D/2) = cat(x2, x1)``, so with ``sin_signed =
    cat(-s1, s2)`` the products are ``x2 * -s1`` against ``-x2 * s1`` (equal: rounding is symmetric in
    the sign) and ``x1 * s2`` against the same: the same values, one kernel (the roll) instead of a
    negation and a concatenation."""
    rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)
    return (x * cos) + (rolled * sin_signed)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


@dataclass(frozen=True)
class RopeTables:
    """One forward's rotary tables: ``cos``/``sin`` [B, 1, T, D] broadcast over the heads;
    ``sin_signed`` (fused) as :func:`rotate_rolled` takes it."""

    cos: torch.Tensor
    sin: torch.Tensor
    sin_signed: torch.Tensor | None


def fuse_projections(model: torch.nn.Module) -> int:
    """Joins every layer's q/k/v and gate/up projections of a decoder model (``model.model.layers``)
    into one buffer each (:func:`fuse_linears`); returns how many groups are joined. Layers whose
    projections are not plain ``nn.Linear`` modules are left as they are."""
    joined = 0
    for layer in model.get_submodule("model.layers").children():
        for module, names in (("self_attn", QKV), ("mlp", GATE_UP)):
            fused = FusedLinear.of(layer.get_submodule(module), names)
            if fused is not None:
                fuse_linears(fused)
                joined += 1
    return joined
