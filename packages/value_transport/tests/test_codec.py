"""pack / unpack / pack_fields / unpack_fields through a real local Ray object store."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppo_value_transport import (
    SUPPORTED_DTYPES,
    Box,
    pack,
    pack_fields,
    unpack,
    unpack_fields,
)

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(120)]

TORCH = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def make(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 1000).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe), dtype and shape included."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1))


def test_every_dtype_round_trips_bit_exact() -> None:
    assert set(SUPPORTED_DTYPES) == set(TORCH)
    for i, (name, dtype) in enumerate(TORCH.items()):
        xs = [make(dtype, (n,), seed=i * 10 + n) for n in (7, 0, 33)]
        ys = unpack(pack(xs))
        assert len(ys) == 3, name
        assert all(same(x, y) for x, y in zip(xs, ys, strict=True)), name


def test_numpy_in_torch_out() -> None:
    xs = [np.arange(5, dtype=np.int64), np.linspace(0, 1, 4, dtype=np.float32), np.zeros(0, np.float32)]
    ids, floats = unpack(pack(xs[:1]))[0], unpack(pack(xs[1:]))
    assert isinstance(ids, torch.Tensor)
    assert all(isinstance(y, torch.Tensor) for y in floats)
    assert ids.dtype == torch.int64
    assert ids.tolist() == [0, 1, 2, 3, 4]
    assert floats[0].dtype == torch.float32
    assert np.array_equal(floats[0].numpy(), xs[1])
    assert floats[1].shape == (0,)
    out = unpack_fields(pack_fields({"ids": xs[:1], "empty": xs[2:], "bits": [np.array([True, False])]}))
    assert out["ids"][0].tolist() == [0, 1, 2, 3, 4]
    assert out["empty"][0].shape == (0,)
    assert out["empty"][0].dtype == torch.float32
    assert out["bits"][0].tolist() == [True, False]


def test_non_contiguous_and_grad_inputs() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    strided = base.t()  # non-contiguous
    reversed_np = np.arange(10, dtype=np.int32)[::-1]  # negative stride
    grad = torch.ones(3, requires_grad=True)
    ys = unpack(pack([strided, grad.view(1, 3).expand(2, 3)]))
    assert torch.equal(ys[0], strided)
    assert ys[0].shape == (6, 4)
    assert torch.equal(ys[1], torch.ones(2, 3))
    assert unpack(pack([reversed_np]))[0].tolist() == list(range(9, -1, -1))


def test_empty_inputs() -> None:
    assert unpack(pack([])) == []
    assert unpack_fields(pack_fields({})) == {}
    out = unpack_fields(pack_fields({"a": [], "b": [torch.zeros(0, dtype=torch.int64)] * 3}))
    assert out["a"] == []
    assert [t.shape for t in out["b"]] == [(0,)] * 3
    assert out["b"][0].dtype == torch.int64


def test_scalars_and_nd_shapes() -> None:
    xs = [torch.tensor(1.5), torch.tensor(-2.0)]
    ys = unpack(pack(xs))
    assert [y.shape for y in ys] == [(), ()]
    assert [y.item() for y in ys] == [1.5, -2.0]
    nd = [torch.randn(2, 0, 3), torch.randn(1, 4, 3)]
    assert all(same(x, y) for x, y in zip(nd, unpack(pack(nd)), strict=True))


def test_cpu_unpack_is_a_view_of_the_store_and_copy_is_private() -> None:
    box = pack([torch.arange(100_000, dtype=torch.float32)])  # large enough for shared memory
    first = unpack(box)[0]
    second = unpack(box)[0]
    # Both reads map the same object-store bytes: nothing was copied.
    assert first.data_ptr() == second.data_ptr()
    private = unpack(box, copy=True)[0]
    assert private.data_ptr() != first.data_ptr()
    private[0] = -1.0
    assert unpack(box)[0][0].item() == 0.0


def test_segments_are_aligned_and_nbytes_reported() -> None:
    box = pack_fields({"a": [torch.zeros(3, dtype=torch.int8)], "b": [torch.ones(5, dtype=torch.float64)]})
    assert box.nbytes == 128  # 3 bytes padded to 64, then 40 bytes padded to 64
    out = unpack_fields(box)
    assert out["b"][0].tolist() == [1.0] * 5
    assert out["b"][0].data_ptr() % 8 == 0


def test_training_batch_layout_round_trips() -> None:
    lengths = [(3, 4), (2, 0), (5, 7)]
    batch = {
        "tokens": [torch.arange(p + r, dtype=torch.int64) for p, r in lengths],
        "response_length": [torch.tensor([r], dtype=torch.int64) for _, r in lengths],
        "loss_mask": [torch.ones(r, dtype=torch.float32) for _, r in lengths],
        "reward": [torch.tensor([float(i)]) for i in range(3)],
        "rollout_log_probs": [-torch.rand(r) for _, r in lengths],
        "prompt_index": [torch.tensor([i // 2]) for i in range(3)],
    }
    out = unpack_fields(pack_fields(batch))
    assert list(out) == list(batch)
    for name, items in batch.items():
        assert all(same(x, y) for x, y in zip(items, out[name], strict=True)), name


@st.composite
def tensor_lists(draw: st.DrawFn) -> list[torch.Tensor]:
    dtype = TORCH[draw(st.sampled_from(sorted(TORCH)))]
    ndim = draw(st.integers(0, 3))
    count = draw(st.integers(0, 6))
    seed = draw(st.integers(0, 2**16))
    return [
        make(dtype, tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim))), seed + i)
        for i in range(count)
    ]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensor_lists())
def test_pack_round_trip_property(xs: list[torch.Tensor]) -> None:
    ys = unpack(pack(xs))
    assert len(ys) == len(xs)
    assert all(same(x, y) for x, y in zip(xs, ys, strict=True))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(min_size=0, max_size=5), tensor_lists(), max_size=4), st.booleans())
def test_pack_fields_round_trip_property(fields: dict[str, list[torch.Tensor]], as_numpy: bool) -> None:
    given_fields = {
        k: [x.numpy() if as_numpy and x.dtype != torch.bfloat16 else x for x in v] for k, v in fields.items()
    }
    out = unpack_fields(pack_fields(given_fields), copy=as_numpy)
    assert list(out) == list(fields)
    for name, xs in fields.items():
        assert all(same(x, y) for x, y in zip(xs, out[name], strict=True)), name


def test_mixed_dtype_in_one_list_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"pack: tensors\[1\]: dtype torch.int64 differs"):
        pack([torch.zeros(2), torch.zeros(2, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"field 'x'\[1\]: 2 dimensions"):
        pack_fields({"x": [torch.zeros(2), torch.zeros(2, 2)]})


def test_unsupported_inputs_are_rejected_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"dtype torch.complex64 cannot travel.*\.to\(torch.float32\)"):
        pack([torch.zeros(2, dtype=torch.complex64)])
    with pytest.raises(ValueError, match=r"dtype uint16 cannot travel"):
        pack([np.zeros(2, dtype=np.uint16)])
    with pytest.raises(ValueError, match=r"expected a torch.Tensor or numpy.ndarray, got list"):
        pack([[1.0, 2.0]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"wrap a single tensor as \[tensor\]"):
        pack(torch.zeros(3))
    with pytest.raises(ValueError, match=r"field names must be str"):
        pack_fields({1: [torch.zeros(1)]})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"expected a mapping"):
        pack_fields([torch.zeros(1)])  # type: ignore[arg-type]


def test_wrong_kind_foreign_payload_and_non_box() -> None:
    with pytest.raises(ValueError, match="use unpack_fields"):
        unpack(pack_fields({"a": [torch.zeros(1)]}))
    with pytest.raises(ValueError, match=r"use unpack$"):
        unpack_fields(pack([torch.zeros(1)]))
    with pytest.raises(ValueError, match="does not hold a ppo_value_transport payload"):
        unpack(Box(ray.put([torch.zeros(1)])))
    with pytest.raises(ValueError, match=r"expected a ppo_value_transport\.Box, got ObjectRef"):
        unpack(ray.put(1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Box\.ref must be a ray\.ObjectRef, got int"):
        Box(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is not a torch device"):
        unpack(pack([]), device="nowhere")


@ray.remote(num_cpus=0)
def _late() -> int:
    time.sleep(30)
    return 1


def test_unpack_times_out_naming_the_payload() -> None:
    ref = _late.remote()
    with pytest.raises(TimeoutError, match=rf"unpack: waited 0.2 s for payload {ref.hex()}"):
        unpack(Box(ref), timeout_s=0.2)
    ray.cancel(ref, force=True)
