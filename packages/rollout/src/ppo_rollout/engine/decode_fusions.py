"""The pieces of the static decoder's fused forward (``LlamaStaticDecoder(fused=True)``).

Each computes what transformers' Llama/Qwen2 modules compute, in fewer kernels: a captured decode step
is several hundred small kernels whose launches, not their work, set its time. See
:mod:`ppo_rollout.engine.static_decode` for how the decoder uses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "QKProjections",
    "RmsNorm",
    "RopeTables",
    "joint_rows",
    "linear_into",
    "rotate_rolled",
    "signed_sin",
]


def _llama_rms_norm_classes() -> tuple[type[torch.nn.Module], ...]:
    """The RMSNorm classes whose forward is the formula :class:`RmsNorm` fuses (read from transformers'
    modeling_llama / modeling_qwen2: float32, ``x * rsqrt(mean(x^2) + eps)``, cast back, times weight)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    return (LlamaRMSNorm, Qwen2RMSNorm)


def _parameter(module: torch.nn.Module, name: str) -> torch.Tensor:
    """``module.<name>``, read at call time (a weight update may replace what the module holds)."""
    value = getattr(module, name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.{name} is {type(value).__name__}, not a tensor")
    return value


@dataclass(frozen=True)
class RmsNorm:
    """One of the model's RMSNorms. ``eps`` is set when the module is transformers' Llama/Qwen2 RMSNorm,
    whose formula :meth:`__call__` computes with ``F.rms_norm`` (one kernel on CUDA instead of about
    seven); None for any other class, which is called as it is."""

    module: torch.nn.Module
    eps: float | None

    @classmethod
    def of(cls, module: torch.nn.Module) -> RmsNorm:
        if type(module) not in _llama_rms_norm_classes():
            return cls(module, None)
        eps: object = module.variance_epsilon  # a plain attribute (torch's stubs type it as a tensor)
        if not isinstance(eps, float | int):
            raise TypeError(f"{type(module).__name__}.variance_epsilon is {type(eps).__name__}, not a number")
        return cls(module, float(eps))

    def __call__(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        if not fused or self.eps is None:
            return self.module(x)
        weight = _parameter(self.module, "weight")
        # transformers' order of roundings: normalise in float32, cast to the input's dtype, then
        # multiply by the weight (F.rms_norm's own weight argument would multiply before the cast).
        normed = F.rms_norm(x.float(), (weight.shape[-1],), eps=self.eps)
        return normed.to(x.dtype) * weight


@dataclass(frozen=True)
class QKProjections:
    """A layer's q and k projections when both are plain ``nn.Linear``: their matmuls can then write
    into one buffer (``out=``), so one rotation covers q and k."""

    q: torch.nn.Linear
    k: torch.nn.Linear

    @classmethod
    def of(cls, attn: torch.nn.Module) -> QKProjections | None:
        q, k = attn.get_submodule("q_proj"), attn.get_submodule("k_proj")
        # A subclass (LoRA, quantised) may compute something else than weight @ x + bias.
        if type(q) is not torch.nn.Linear or type(k) is not torch.nn.Linear:
            return None
        return cls(q, k)


def linear_into(out: torch.Tensor, x: torch.Tensor, linear: torch.nn.Linear) -> None:
    """``linear(x)`` for a 2-D ``x``, written into the contiguous ``out``: the matmul ``F.linear`` runs
    for it (``mm``, or ``addmm`` with the bias), so the same result."""
    if linear.bias is None:
        torch.mm(x, linear.weight.t(), out=out)
    else:
        torch.addmm(linear.bias, x, linear.weight.t(), out=out)


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
    """One forward's rotary tables.

    ``cos``/``sin`` [B, 1, T, D] broadcast over the heads; ``sin_signed`` (fused) as
    :func:`rotate_rolled` takes it. ``joint_cos``/``joint_sin`` (fused, one-position forwards such as
    decode steps): the same values laid out as q and k sit in the joint projection buffer, one row per
    (token, q head), then one per (token, k head), so the buffer is rotated in one go."""

    cos: torch.Tensor
    sin: torch.Tensor
    sin_signed: torch.Tensor | None
    joint_cos: torch.Tensor | None
    joint_sin: torch.Tensor | None


def joint_rows(table: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """[B, 1, T, D] -> [B * T * (heads + kv_heads), D]: each token's row once per q head (all tokens),
    then once per k head, the order of the joint q/k buffer."""
    b, _, t, d = table.shape
    per_token = table[:, 0, :, None, :]
    return torch.cat(
        (per_token.expand(b, t, heads, d).reshape(-1, d), per_token.expand(b, t, kv_heads, d).reshape(-1, d))
    )
