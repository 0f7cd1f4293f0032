from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_weight_sync import checksum, plan_buckets
from ppo_weight_sync.buckets import (
    TensorMeta,
    dtype_from_name,
    dtype_name,
    metas_from_request,
    pack_into,
    parse_stream_format,
    stream_format,
    unpack,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 1000), max_size=40), st.integers(1, 2000))
def test_plan_buckets_covers_every_tensor_in_order_within_the_limit(sizes: list[int], limit: int) -> None:
    plan = plan_buckets(sizes, limit)
    flat = [i for a, b in plan for i in range(a, b)]
    assert flat == list(range(len(sizes)))
    for a, b in plan:
        assert b > a
        # Over the limit only when the bucket is a single tensor larger than the limit.
        assert sum(sizes[a:b]) <= limit or b - a == 1
    # Greedy: no bucket could have taken the next tensor without exceeding the limit.
    for (a, b), (c, _) in itertools.pairwise(plan):
        assert sum(sizes[a:b]) + sizes[c] > limit


def test_plan_buckets_rejects_non_positive_limit() -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([1, 2], 0)


def test_pack_and_unpack_round_trip_mixed_dtypes() -> None:
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.randn(4).to(torch.bfloat16)]
    metas = [TensorMeta(f"t{i}", t.dtype, tuple(t.shape)) for i, t in enumerate(tensors)]
    buffer = torch.empty(sum(m.nbytes for m in metas) + 13, dtype=torch.uint8)
    used = pack_into(buffer, tensors)
    assert used.numel() == sum(m.nbytes for m in metas)
    for (name, out), meta, original in zip(unpack(used, metas), metas, tensors, strict=True):
        assert name == meta.name
        assert out.dtype == original.dtype
        assert out.shape == original.shape
        assert torch.equal(out, original)


def test_pack_handles_non_contiguous_input() -> None:
    t = torch.arange(12.0).reshape(3, 4).t()
    buffer = torch.empty(48, dtype=torch.uint8)
    ((_, out),) = unpack(pack_into(buffer, [t]), [TensorMeta("t", t.dtype, tuple(t.shape))])
    assert torch.equal(out, t)


def test_dtype_names_match_sglang_spelling() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_from_name("bfloat16") is torch.bfloat16
    assert dtype_from_name("torch.float16") is torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'nope'"):
        dtype_from_name("nope")


def test_metas_from_request_checks_lengths() -> None:
    with pytest.raises(ValueError, match="one entry per tensor"):
        metas_from_request(["a", "b"], ["float32"], [[1], [2]])


def test_stream_format_round_trip_and_bad_values() -> None:
    assert parse_stream_format(stream_format(4096)) == 4096
    with pytest.raises(ValueError, match="bucket bytes"):
        parse_stream_format("ppo_flat_stream:abc")


def test_checksum_is_order_independent_and_sees_every_field() -> None:
    a, b = torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.bfloat16)
    base = checksum([("a", a), ("b", b)])
    assert base == checksum([("b", b), ("a", a)])
    assert base != checksum([("a", a.reshape(3, 2)), ("b", b)])  # shape
    assert base != checksum([("a", a.double()), ("b", b)])  # dtype
    assert base != checksum([("x", a), ("b", b)])  # name
    changed = a.clone()
    changed[1, 2] += 1
    assert base != checksum([("a", changed), ("b", b)])  # bytes
