"""Decode attention that reads each row's own cache columns only (a Triton split-KV kernel).

The masked forms of decode attention (``matmul``, ``sdpa``) compute every row over the step's whole
KV bucket: with left-padded prompts over the padding, with continuous batching over the columns up to
the longest row's, so one long response makes every short row read its length in cache. Here row
``r`` attends to columns ``[starts[r], ends[r])`` of its cache and nothing else, so a step reads the
keys and values the outputs use (plus the bucket's split bookkeeping).

Two kernels, in the flash-decoding form: the first splits each row's range into chunks of
:data:`CHUNK` columns, one program per (row, query head, chunk), each an online softmax over its chunk
in float32 with a partial output, its maximum and its sum; the second combines a row's chunks.
Products and sums are elementwise float32 (no tensor-core dot with its reduced-precision inputs), so
in float32 the outputs equal the masked softmax's up to the order of additions.

The number of chunks is fixed by the KV bucket the step is captured for (``kv_len``), and the ranges
are device tensors, so one captured graph serves every step of its bucket as the masked forms do.
Triton kernels need a GPU (or ``TRITON_INTERPRET=1``, which runs them on CPU tensors: the tests).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch

__all__ = ["CHUNK", "available", "ranged_attention", "ranged_attention_reference"]

CHUNK = 256
"""Cache columns per program of the first kernel."""

_BLOCK_N = 32  # columns per inner tile


def available(device: torch.device) -> bool:
    """Whether the kernel can run on ``device``: CUDA with Triton, or any device under the interpreter."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return _kernels() is not None


@functools.cache
def _kernels() -> tuple[Any, Any] | None:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def chunk_kernel(  # type: ignore[no-untyped-def]
        q_ptr, k_ptr, v_ptr, starts_ptr, ends_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
        sq_b, sq_h, sk_b, sk_h, sk_c, sv_b, sv_h, sv_c,
        scale, heads, group, splits,
        CHUNK_: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):  # fmt: skip
        row_head = tl.program_id(0)
        split = tl.program_id(1)
        row = (row_head // heads).to(tl.int64)  # row * its stride can pass 2**31 in a large cache
        head = row_head % heads
        kv_head = head // group
        start = tl.load(starts_ptr + row) + split * CHUNK_
        end = tl.minimum(tl.load(ends_ptr + row), start + CHUNK_)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + row * sq_b + head * sq_h + dims, mask=dim_ok, other=0.0).to(tl.float32)
        k_base = k_ptr + row * sk_b + kv_head * sk_h
        v_base = v_ptr + row * sv_b + kv_head * sv_h
        best = tl.full([], -float("inf"), tl.float32)
        total = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for tile in range(start, end, BLOCK_N):
            cols = tile + tl.arange(0, BLOCK_N)
            col_ok = cols < end
            both = col_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_base + cols[:, None] * sk_c + dims[None, :], mask=both, other=0.0).to(tl.float32)
            scores = tl.sum(k * q[None, :], axis=1) * scale
            scores = tl.where(col_ok, scores, -float("inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=0))
            keep = tl.exp(best - new_best)
            weights = tl.exp(scores - new_best)
            v = tl.load(v_base + cols[:, None] * sv_c + dims[None, :], mask=both, other=0.0).to(tl.float32)
            acc = acc * keep + tl.sum(weights[:, None] * v, axis=0)
            total = total * keep + tl.sum(weights, axis=0)
            best = new_best
        part = row_head * splits + split
        tl.store(part_out_ptr + part * HEAD_DIM + dims, acc, mask=dim_ok)
        tl.store(part_max_ptr + part, best)
        tl.store(part_sum_ptr + part, total)

    @triton.jit
    def combine_kernel(  # type: ignore[no-untyped-def]
        part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, so_b, so_h, heads, splits,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):  # fmt: skip
        row_head = tl.program_id(0)
        row = (row_head // heads).to(tl.int64)
        head = row_head % heads
        parts = tl.arange(0, BLOCK_S)
        part_ok = parts < splits
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        base = row_head * splits
        maxes = tl.load(part_max_ptr + base + parts, mask=part_ok, other=-float("inf"))
        sums = tl.load(part_sum_ptr + base + parts, mask=part_ok, other=0.0)
        best = tl.max(maxes, axis=0)
        # Chunks past a row's range hold max -inf and sum 0: weight 0 (never exp(-inf - -inf)).
        weights = tl.where(maxes > -float("inf"), tl.exp(maxes - best), 0.0)
        outs = tl.load(
            part_out_ptr + (base + parts)[:, None] * HEAD_DIM + dims[None, :],
            mask=part_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        total = tl.sum(weights * sums, axis=0)
        out = tl.sum(weights[:, None] * outs, axis=0) / tl.maximum(total, 1e-30)
        tl.store(out_ptr + row * so_b + head * so_h + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)

    return chunk_kernel, combine_kernel


def ranged_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    kv_len: int,
    scale: float,
) -> torch.Tensor:
    """Attention of one query per row over cache columns ``[starts[r], ends[r])``.

    ``q`` [B, heads, 1, D] (any strides with a unit last one); ``keys``, ``values`` one layer's cache
    [>=B, kv_heads, capacity, D] (unit last stride); ``starts``, ``ends`` [B] int64 with
    ``ends[r] - starts[r]`` in ``[1, kv_len]``. Returns [B, heads, 1, D] in ``q``'s dtype.
    """
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("ranged attention needs Triton (it comes with CUDA builds of torch)")
    chunk_kernel, combine_kernel = kernels
    rows, heads, _, head_dim = q.shape
    kv_heads = keys.shape[1]
    splits = max(1, math.ceil(kv_len / CHUNK))
    dev = q.device
    part_out = torch.empty((rows * heads * splits, head_dim), dtype=torch.float32, device=dev)
    part_max = torch.empty(rows * heads * splits, dtype=torch.float32, device=dev)
    part_sum = torch.empty(rows * heads * splits, dtype=torch.float32, device=dev)
    out = torch.empty((rows, heads, 1, head_dim), dtype=q.dtype, device=dev)
    block_d = _next_power_of_2(head_dim)
    chunk_kernel[(rows * heads, splits)](
        q, keys, values, starts, ends, part_out, part_max, part_sum,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        scale, heads, heads // kv_heads, splits,
        CHUNK_=CHUNK, BLOCK_N=_BLOCK_N, BLOCK_D=block_d, HEAD_DIM=head_dim,
    )  # fmt: skip
    combine_kernel[(rows * heads,)](
        part_out, part_max, part_sum, out, out.stride(0), out.stride(1), heads, splits,
        BLOCK_S=_next_power_of_2(splits), BLOCK_D=block_d, HEAD_DIM=head_dim,
    )  # fmt: skip
    return out


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def ranged_attention_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same attention as a float32 masked softmax in PyTorch (tests and CPU comparisons)."""
    rows, heads = q.shape[:2]
    group = heads // keys.shape[1]
    k = keys[:rows].float().repeat_interleave(group, dim=1)
    v = values[:rows].float().repeat_interleave(group, dim=1)
    cols = torch.arange(k.shape[2], device=q.device)
    allowed = (cols[None, :] >= starts[:, None]) & (cols[None, :] < ends[:, None])
    scores = torch.matmul(q.float(), k.transpose(2, 3)) * scale
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).to(q.dtype)
