"""Packed sequences (``train.pack_sequences``): a micro-batch's samples back to back in one row.

A padded micro-batch computes ``samples x longest`` positions; packed, it computes the real tokens
only. The samples' tokens are concatenated into ``input_ids [1, T]``, ``position_ids`` restart at 0
for each sample (so rotary embeddings see what they see padded), and ``cu_seqlens`` (``[b + 1]``,
int32, the offsets of the samples in ``T``) keep each sample's attention within itself:

- ``varlen`` (``ppo_varlen``, registered with transformers' ``AttentionInterface``): on CUDA in
  bf16/fp16 (the query's dtype, or autocast's: float32 master weights hand attention a float32 query),
  torch's variable-length flash kernel ``torch.nn.attention.varlen.varlen_attn``, which computes
  ``sum_i L_i^2`` scores instead of ``T^2``; elsewhere (CPU, float32 without autocast) a causal SDPA
  call per sample;
- ``sdpa`` / ``flex_attention``: transformers' own, which find the sample boundaries where the
  position ids restart and build a block-diagonal mask (dense for SDPA: ``T^2`` scores; a block mask
  for FlexAttention).

Log-probs come from the final hidden states of the response positions only: the LM head and the
float32 softmax run on ``chunk`` of them at a time (``token_logprobs``), never on a
``[tokens, vocabulary]`` tensor. Response-space results are scattered back to the padded
``[b, R_max]`` layout the PPO math uses, 0 on padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ppo_trainer import token_logprobs
from ppo_trainer.batch import Samples, to_device
from ppo_trainer.config import PackedAttention

VARLEN = "ppo_varlen"
"""The name ``varlen_attention`` is registered under in transformers' ``AttentionInterface``."""

_IMPLEMENTATIONS: dict[str, str] = {"varlen": VARLEN, "sdpa": "sdpa", "flex_attention": "flex_attention"}


@dataclass(frozen=True)
class PackedMicroBatch:
    """Model inputs for some samples packed into one row, plus where their response tokens are."""

    rows: torch.Tensor  # [b] indices into the rank's samples
    input_ids: torch.Tensor  # [1, T] the samples' tokens back to back
    position_ids: torch.Tensor  # [1, T] 0, 1, ... restarting at each sample
    cu_seqlens: torch.Tensor  # [b + 1] int32: sample j is positions cu_seqlens[j] .. cu_seqlens[j + 1] - 1
    cu_seqlens_host: torch.Tensor  # the same offsets on the CPU (what host code reads without a sync)
    max_seqlen: int
    response_index: torch.Tensor  # [K] the position whose output predicts each real response token
    slot_index: torch.Tensor  # [K] where each of them goes in the flattened [b, R_max] response space
    targets: torch.Tensor  # [K] the response tokens
    max_response: int  # R_max

    def attention_kwargs(self) -> dict[str, Any]:
        """What transformers hands every attention call (its flash-attention keyword names)."""
        return {
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }

    @property
    def response_slots(self) -> torch.Tensor:
        """``[b, R_max]`` bool, True on the K real response tokens."""
        slots = torch.zeros(
            len(self.rows) * self.max_response, dtype=torch.bool, device=self.slot_index.device
        )
        return slots.index_fill(0, self.slot_index, True).view(len(self.rows), self.max_response)

    def scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """``[K]`` per-response-token values to ``[b, R_max]``, 0 on padding (differentiable; indices
        known in advance, so no host sync on CUDA, where a boolean mask would count its elements)."""
        out = flat.new_zeros(len(self.rows) * self.max_response)
        return out.index_copy(0, self.slot_index, flat).view(len(self.rows), self.max_response)


def pack(samples: Samples, rows: Sequence[int], device: torch.device) -> PackedMicroBatch:
    """The chosen samples packed in ``rows`` order (see the module docstring)."""
    chosen = [samples.tokens[i] for i in rows]
    lengths = [t.numel() for t in chosen]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    r_max = samples.max_response
    index, slots, targets = [], [], []
    for j, i in enumerate(rows):
        r = int(samples.response_lengths[i])
        start = lengths[j] - r
        # Response token t sits at start + t and is predicted by the output at start + t - 1.
        index.append(torch.arange(offsets[j] + start - 1, offsets[j] + lengths[j] - 1))
        slots.append(torch.arange(j * r_max, j * r_max + r))
        targets.append(chosen[j][start:])
    cu_seqlens_host = torch.tensor(offsets, dtype=torch.int32)
    return PackedMicroBatch(
        rows=torch.as_tensor(list(rows), dtype=torch.int64),
        input_ids=to_device(torch.cat(chosen).unsqueeze(0), device),
        position_ids=to_device(torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0), device),
        cu_seqlens=to_device(cu_seqlens_host, device),
        cu_seqlens_host=cu_seqlens_host,
        max_seqlen=max(lengths),
        response_index=to_device(torch.cat(index), device),
        slot_index=to_device(torch.cat(slots), device),
        targets=to_device(torch.cat(targets), device),
        max_response=r_max,
    )


# ---------------------------------------------------------------------------------- forwards


def policy_forward(
    model: nn.Module, mb: PackedMicroBatch, with_entropy: bool, chunk: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the response tokens, ``[b, R_max]`` float32, 0 on padding.

    The model's own forward runs (FSDP gathers its root parameters there and reduces their
    gradients after the backward), asked for no logits and the final hidden state; the head runs
    on the response positions in chunks. Call under the compute dtype's autocast.
    """
    causal_lm = _pretrained(model)
    out = causal_lm(
        input_ids=mb.input_ids,
        position_ids=mb.position_ids,
        use_cache=False,
        logits_to_keep=mb.response_index[:0],  # no position: the head runs below, in chunks
        output_hidden_states=-1,  # only the last (after the final norm)
        **mb.attention_kwargs(),
    )
    assert out.hidden_states is not None  # asked for above
    hidden = out.hidden_states[-1][0].index_select(0, mb.response_index)
    head = causal_lm.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(causal_lm).__name__} has no output embeddings to compute log-probs with")
    log_probs, entropy = token_logprobs.head_log_probs(hidden, head, mb.targets, with_entropy, chunk)
    return mb.scatter(log_probs), None if entropy is None else mb.scatter(entropy)


def value_forward(critic: nn.Module, mb: PackedMicroBatch) -> torch.Tensor:
    """The critic's values before each response token, ``[b, R_max]`` float32, 0 on padding."""
    values = critic(mb.input_ids, position_ids=mb.position_ids, **mb.attention_kwargs())  # [1, T]
    return mb.scatter(values[0].float().index_select(0, mb.response_index))


def _pretrained(model: nn.Module) -> PreTrainedModel:
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"packed log-probs need a transformers causal LM, got {type(model).__name__}")
    return model


# ---------------------------------------------------------------------------------- attention


def use_attention(model: nn.Module, kind: PackedAttention) -> None:
    """Switch every transformers model in ``model`` to the packed attention ``kind``."""
    if kind not in _IMPLEMENTATIONS:
        raise ValueError(f"train.packed_attention={kind!r}: use one of {sorted(_IMPLEMENTATIONS)}")
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module.set_attn_implementation(_IMPLEMENTATIONS[kind])


def varlen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature (``[1, heads, T, dim]`` in, ``[1, T, heads, dim]`` out) over
    packed samples, delimited by ``cu_seq_lens_q``; without it (an unpacked call) plain causal SDPA."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one row of packed samples, got a batch of {query.shape[0]}")
    if dropout:
        raise ValueError("packed attention has no dropout; train with attention_dropout=0")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, dim]
    out = causal_within_samples(q, k, v, cu_seqlens, int(kwargs["max_length_q"]), scaling)
    return out.unsqueeze(0), None


def causal_within_samples(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None,
) -> torch.Tensor:
    """Causal attention within each packed sample, ``[T, heads, dim]`` in (key and value may have fewer,
    grouped heads) and out: torch's varlen flash kernel on CUDA in a half dtype (``_flash_dtype``),
    else one causal SDPA call per sample. The transformers models' and megatron's packed attention."""
    half = _flash_dtype(query)
    if half is None:
        return _per_sample_causal(query, key, value, cu_seqlens, scale)
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (x.to(half).contiguous() for x in (query, key, value))
    if k.shape[1] != q.shape[1]:  # grouped-query: torch 2.11's varlen_attn has no enable_gqa
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    out = varlen_attn(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale, window_size=(-1, 0)
    )
    assert isinstance(out, torch.Tensor)  # no auxiliary outputs asked for
    return out


@torch.compiler.disable
def _per_sample_causal(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """``causal_within_samples`` without the varlen kernel, ``[T, heads, dim]`` in and out: one causal SDPA
    call per sample, run eagerly under ``torch.compile`` (``train.compile_layers``). Its loop is over the
    samples' lengths read on the host: dynamo broke the layer's graph three times in it and compiled every
    sliver between the breaks (23 graphs for the tiny model's no-grad and training passes in
    tests/test_compiled.py, 10 with the loop left out: the layer breaks once, here)."""
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, heads, T, dim]
    return block_causal_sdpa(q, k, v, cu_seqlens, scale)[0].transpose(0, 1)


def _flash_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The half dtype the varlen kernel runs in on CUDA, or None (no CUDA, no half dtype in sight).

    Under autocast the query reaches attention in float32 whenever the weights are float32 (the
    torch backend's master weights): the rotary embedding's cos/sin follow the float32 embeddings and
    promote the bf16 projections back. The padded path's SDPA is on autocast's lower-precision list
    and runs in the autocast dtype; the packed path must too, or it falls back to one SDPA call per
    sample and layer (measured on an H200 at 135M: 1.8k tokens/s packed against 13k padded)."""
    if not query.is_cuda:
        return None
    if query.dtype in (torch.bfloat16, torch.float16):
        return query.dtype
    if torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        return dtype if dtype in (torch.bfloat16, torch.float16) else None
    return None


def block_causal_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Causal attention within each packed sample, ``[1, heads, T, dim]`` in and out: one causal SDPA
    call per sample (``sum_i L_i^2`` scores, where one masked call would compute ``T^2``)."""
    lengths = cu_seqlens.diff().tolist()
    gqa = key.shape[1] != query.shape[1]
    # split, not slicing: its backward is one concatenation, where each slice's would write a
    # zero-filled gradient of the whole row (quadratic in the samples per micro-batch).
    parts = [
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        for q, k, v in zip(
            query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2), strict=True
        )
    ]
    return torch.cat(parts, dim=2)


AttentionInterface.register(VARLEN, varlen_attention)
