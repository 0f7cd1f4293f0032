"""Packed sequences in the megatron backend (``train.pack_sequences`` with ``backend: megatron``).

megatron-core runs packed samples in its ``thd`` format: ``GPTModel(input_ids [1, T], ...,
packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=...))`` restarts the rotary positions
at each sample (``rope_utils._apply_rotary_pos_emb_thd``, megatron-core 0.19.2) and hands the core
attention ``[T, heads, dim]`` tensors with the samples' offsets.

Attention: only Transformer Engine's ``TEDotProductAttention`` takes those tensors; the local layer
spec's ``DotProductAttention`` refuses ``packed_seq_params`` (``dot_product_attention.py``).
``PackedDotProductAttention`` is that module with the packed case added: causal attention within each
sample through the torch backend's packed attention (``packing.causal_within_samples``: torch's
varlen flash kernel on CUDA in bf16, a causal SDPA call per sample on the CPU). Unpacked calls run
megatron's own code unchanged.

Rotary embeddings: given a table of ``max_seqlen`` rows, megatron rotates each sample on its own,
about a dozen small kernels per sample, for queries and keys, in every layer (200 samples of SmolLM2's
arithmetic in a 16 384-token micro-batch: some 150 000 launches a forward). Given a table of one row
per packed token, it rotates the whole row at once (its "exact mapping" for per-token positions).
``PackedRotaryEmbedding`` serves that table while ``packed_positions`` holds the micro-batch's
positions; the offsets megatron then reads per sample come from ``cu_seqlens_q_padded``, set to a CPU
copy of the offsets (no host sync per sample and layer; with no padding between samples the two are
the same offsets).

Imported only where megatron-core is installed (the ``megatron`` extra, Python >= 3.12).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import nn

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


class PackedRotaryEmbedding(nn.Module):
    """GPTModel's rotary embedding (``inner``), with one row per packed token while ``positions`` is
    set (each token's position within its sample): see the module docstring."""

    def __init__(self, inner: RotaryEmbedding) -> None:
        super().__init__()
        self.inner = inner
        self.positions: torch.Tensor | None = None

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> int:
        return int(self.inner.get_rotary_seq_len(*args, **kwargs))

    def forward(self, max_seq_len: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        table = self.inner(max_seq_len, *args, **kwargs)  # [max_seq_len, 1, 1, dim]
        return table if self.positions is None else table.index_select(0, self.positions)


@contextlib.contextmanager
def packed_positions(model: nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """Every ``PackedRotaryEmbedding`` in ``model`` serves ``positions`` (``[T]``) within the block."""
    tables = [m for m in model.modules() if isinstance(m, PackedRotaryEmbedding)]
    for table in tables:
        table.positions = positions
    try:
        yield
    finally:
        for table in tables:
            table.positions = None


def packed_layer_spec() -> ModuleSpec:
    """The local layer spec (RMSNorm) with ``PackedDotProductAttention`` as the core attention."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    return spec


def packed_seq_params(mb: PackedMicroBatch) -> PackedSeqParams:
    """What GPTModel takes for ``mb``'s samples back to back (one sequence per sample, no padding)."""
    return thd_params(mb.cu_seqlens, mb.cu_seqlens_host, mb.max_seqlen)


def thd_params(cu_seqlens: torch.Tensor, cu_seqlens_host: torch.Tensor, max_seqlen: int) -> PackedSeqParams:
    """Samples at offsets ``cu_seqlens`` (on the model's device, for the attention; ``cu_seqlens_host``:
    the same on the CPU, for RoPE, as its ``_padded`` offsets: there is no padding between samples)."""
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_host,
        cu_seqlens_kv_padded=cu_seqlens_host,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )
