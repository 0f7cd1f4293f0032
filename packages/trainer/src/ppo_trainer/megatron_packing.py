"""Packed sequences in the megatron backend (``train.pack_sequences`` with ``backend: megatron``).

megatron-core runs packed samples in its ``thd`` format: ``GPTModel(input_ids [1, T], ...,
packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=...))`` restarts the rotary positions
at each sample (``rope_utils._apply_rotary_pos_emb_thd``, megatron-core 0.19.2) and hands the core
attention ``[T, heads, dim]`` tensors with the samples' offsets. Only Transformer Engine's
``TEDotProductAttention`` takes them there; the local layer spec's ``DotProductAttention`` refuses
``packed_seq_params`` (``dot_product_attention.py``). ``PackedDotProductAttention`` is that module
with the packed case added: causal attention within each sample through the same function as the
torch backend's packed path (``packing.causal_within_samples``: torch's varlen flash kernel on CUDA in
bf16, a causal SDPA call per sample on the CPU). Unpacked calls run megatron's own code unchanged.

Imported only where megatron-core is installed (the ``megatron`` extra, Python >= 3.12).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from ppo_trainer.packing import PackedMicroBatch, causal_within_samples


class PackedDotProductAttention(DotProductAttention):
    """megatron's local ``DotProductAttention``, plus packed (``thd``) samples."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed attention takes the thd format, got {packed_seq_params.qkv_format!r}")
        if self.training and self.attention_dropout.p > 0:
            raise ValueError("packed attention has no dropout; train with attention_dropout=0")
        out = causal_within_samples(  # [T, heads, dim]
            query,
            key,
            value,
            packed_seq_params.cu_seqlens_q,
            int(packed_seq_params.max_seqlen_q),
            self.softmax_scale,
        )
        return out.reshape(out.shape[0], -1)  # [T, heads x dim], as TEDotProductAttention returns


def packed_layer_spec() -> ModuleSpec:
    """The local layer spec (RMSNorm) with ``PackedDotProductAttention`` as the core attention."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    return spec


def packed_seq_params(mb: PackedMicroBatch) -> PackedSeqParams:
    """What GPTModel takes for ``mb``'s samples back to back (one sequence per sample, no padding)."""
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=mb.cu_seqlens,
        cu_seqlens_kv=mb.cu_seqlens,
        max_seqlen_q=mb.max_seqlen,
        max_seqlen_kv=mb.max_seqlen,
    )
