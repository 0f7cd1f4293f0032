"""The engine protocol declared once: every implementation has its exact operations, replies are typed,
errors are chosen from structured fields, and the HTTP routes validate as SGLang's do."""

from __future__ import annotations

import inspect
import pickle
from typing import Any

import pytest
import torch

from ppo_weight_sync import (
    EngineOps,
    EngineRejectedError,
    EngineReply,
    EngineTimeoutError,
    EngineUnavailableError,
    HttpEngineEndpoint,
    NonFiniteTensorsError,
    RayEngineEndpoint,
    WeightOps,
    WeightReceiver,
    check_reply,
    non_finite_names,
)
from ppo_weight_sync.endpoints import EngineEndpoint
from ppo_weight_sync.finite import fused_abs_sums, start_finite_check
from ppo_weight_sync.requests import UpdateRequest
from ppo_weight_sync.routes import serve_engine_route
from ppo_weight_sync.testing import TensorEngine

WEIGHT_OPS = [
    "init_weights_update_group",
    "update_weights_from_distributed",
    "destroy_weights_update_group",
    "get_weight_version",
]
ENDPOINT_OPS = [*WEIGHT_OPS, "pause_generation", "continue_generation", "flush_cache"]
ENGINE_OPS = [*ENDPOINT_OPS, "release_memory_occupation", "resume_memory_occupation"]


def _params(fn: Any) -> list[tuple[str, Any]]:
    """Parameter names and defaults, without self: the part of a signature that can drift."""
    sig = inspect.signature(fn)
    # ray.remote(cls) adds a tracing parameter of its own to the class's methods
    return [(p.name, p.default) for p in sig.parameters.values() if p.name not in ("self", "_ray_trace_ctx")]


@pytest.mark.parametrize(
    ("impl", "ops", "protocol"),
    [
        (TensorEngine, ENGINE_OPS, EngineOps),
        (WeightReceiver, WEIGHT_OPS, WeightOps),
        (RayEngineEndpoint, ENDPOINT_OPS, EngineEndpoint),
        (HttpEngineEndpoint, ENDPOINT_OPS, EngineEndpoint),
    ],
)
def test_every_implementation_has_the_protocols_parameters_and_no_defaults(
    impl: type, ops: list[str], protocol: type
) -> None:
    for op in ops:
        theirs, ours = _params(getattr(impl, op)), _params(getattr(EngineOps, op))
        assert [n for n, _ in theirs] == [n for n, _ in ours], f"{impl.__name__}.{op} drifted"
        assert all(d is inspect.Parameter.empty for _, d in theirs), f"{impl.__name__}.{op} has defaults"
        assert not any(
            p.kind is inspect.Parameter.VAR_KEYWORD
            for p in inspect.signature(getattr(impl, op)).parameters.values()
        ), f"{impl.__name__}.{op} takes **kwargs"


def test_a_tensor_engine_is_engine_ops_and_answers_typed_replies() -> None:
    engine = TensorEngine({"w": ("float32", [2])})
    assert isinstance(engine, EngineOps)
    assert isinstance(engine.receiver, WeightOps)
    assert engine.pause_generation() == EngineReply(True, "Generation paused.")
    reply = engine.update_weights_from_distributed(
        UpdateRequest(
            names=["w"],
            dtypes=["float32"],
            shapes=[[2]],
            group_name="none",
            weight_version="v1",
            flush_cache=True,
            load_format=None,
        )
    )
    assert reply == EngineReply(False, "Group 'none' is not joined; call init_weights_update_group first.")
    assert engine.get_weight_version() is None


def test_reply_json_round_trip() -> None:
    for reply in (EngineReply.ok("fine"), EngineReply.refused("no"), EngineReply.lost("gone")):
        assert EngineReply.from_json(reply.to_json()) == reply
    assert EngineReply.ok("fine").to_json() == {"success": True, "message": "fine"}  # SGLang's shape
    assert EngineReply.lost("gone").to_json() == {"success": False, "message": "gone", "group_lost": True}


def test_the_error_class_comes_from_the_reply_fields_not_its_text() -> None:
    assert check_reply("e0", "op", EngineReply.ok("x")) == EngineReply.ok("x")
    # A refusal whose text looks like a receive failure is still a refusal ...
    with pytest.raises(EngineRejectedError, match="engine 'e0' rejected op: Failed to receive weights"):
        check_reply("e0", "op", EngineReply.refused("Failed to receive weights over group 'g'"))
    # ... and a lost group is unavailable whatever its text (SGLang's failures have their own words).
    with pytest.raises(EngineUnavailableError, match="engine 'e0': op failed: Failed to update parameter"):
        check_reply("e0", "op", EngineReply.lost("Failed to update parameter online: boom"))


@pytest.mark.parametrize(
    "error",
    [
        EngineUnavailableError("e0", "update_weights_from_distributed", "the actor died"),
        EngineTimeoutError("e1", "init_weights_update_group", 30.0),
        EngineRejectedError("e2", "update_weights_from_distributed", "tensor 'x' is not a weight"),
    ],
)
def test_errors_pickle_with_their_fields(error: Exception) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert copy.engine == error.engine  # type: ignore[attr-defined]
    assert copy.op == error.op  # type: ignore[attr-defined]


def test_routes_validate_like_sglang_and_fill_its_defaults() -> None:
    engine = TensorEngine({"w": ("float32", [2])})
    missing = serve_engine_route(engine, "POST", "/init_weights_update_group", {"master_address": "x"})
    assert missing is not None
    assert missing.status == 400
    assert missing.body["object"] == "error"
    assert "master_port" in missing.body["message"]
    wrong = serve_engine_route(engine, "POST", "/update_weights_from_distributed", {"names": "w"})
    assert wrong is not None
    assert wrong.status == 400
    assert wrong.body["object"] == "error"
    # group_name left out: SGLang's default, "weight_update_group" (io_struct.py)
    destroyed = serve_engine_route(engine, "POST", "/destroy_weights_update_group", {})
    assert destroyed is not None
    assert destroyed.status == 200
    assert destroyed.body == {
        "success": True,
        "message": "Group 'weight_update_group' is not joined; nothing to destroy.",
    }
    released = serve_engine_route(engine, "POST", "/release_memory_occupation", {"tags": ["weights"]})
    assert released is not None
    assert (released.status, released.body) == (200, None)
    assert serve_engine_route(engine, "POST", "/generate", {}) is None
    flushed = serve_engine_route(engine, "GET", "/flush_cache", None)
    assert flushed is not None
    assert (flushed.status, flushed.body) == (200, "Cache flushed.\n")
    assert engine.flushes == 1


def _raise_in_child(kind: str) -> None:
    errors = {
        "unavailable": EngineUnavailableError("e0", "update_weights_from_distributed", "the actor died"),
        "timeout": EngineTimeoutError("e1", "init_weights_update_group", 30.0),
        "rejected": EngineRejectedError(
            "e2", "update_weights_from_distributed", "tensor 'x' is not a weight"
        ),
    }
    raise errors[kind]


@pytest.mark.parametrize(
    ("kind", "cls", "text"),
    [
        (
            "unavailable",
            EngineUnavailableError,
            "engine 'e0': update_weights_from_distributed failed: the actor",
        ),
        (
            "timeout",
            EngineTimeoutError,
            "engine 'e1': init_weights_update_group failed: no answer within 30 s",
        ),
        ("rejected", EngineRejectedError, "engine 'e2' rejected update_weights_from_distributed: tensor 'x'"),
    ],
)
def test_errors_cross_a_process_boundary_as_themselves(kind: str, cls: type, text: str) -> None:
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        error = pool.submit(_raise_in_child, kind).exception(timeout=120)
    assert type(error) is cls
    assert str(error).startswith(text)
    assert error.engine == f"e{['unavailable', 'timeout', 'rejected'].index(kind)}"  # type: ignore[union-attr]


def test_non_finite_tensors_error_pickles_with_its_names() -> None:
    error = NonFiniteTensorsError(["a.weight", "b.bias"])
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is NonFiniteTensorsError
    assert copy.names == ["a.weight", "b.bias"]
    assert str(copy) == str(error)
    assert "a.weight, b.bias" in str(copy)


def test_non_finite_names_finds_nan_and_inf_in_every_float_dtype() -> None:
    ok = torch.ones(3)
    items = [
        ("fine", ok),
        ("nan32", torch.tensor([1.0, float("nan")])),
        ("inf16", torch.tensor([float("-inf")], dtype=torch.bfloat16)),
        ("ints", torch.tensor([1, 2])),
        ("huge_but_finite", torch.tensor([3e38, 3e38])),  # its sum overflows: the exact check clears it
        ("nan64", torch.tensor([float("nan")], dtype=torch.float64)),
        ("complex_inf", torch.tensor([complex(1.0, float("inf"))])),
    ]
    if hasattr(torch, "float8_e5m2"):
        items.append(("inf8", torch.tensor([float("inf")]).to(torch.float8_e5m2)))
    expected = ["nan32", "inf16", "nan64", "complex_inf"] + (
        ["inf8"] if hasattr(torch, "float8_e5m2") else []
    )
    assert non_finite_names(items) == expected
    assert non_finite_names([("fine", ok), ("ints", torch.tensor([1]))]) == []


def test_the_fused_scan_of_cuda_devices_tells_finite_tensors_from_the_rest() -> None:
    # The multi-tensor kernel non_finite_names uses on CUDA devices also runs on CPU: the same
    # proof (a NaN or an infinity makes a tensor's L1 norm non-finite) checked on every float dtype.
    tensors = {
        "fine_bf16": torch.randn(1000, dtype=torch.bfloat16),
        "fine_fp32": torch.randn(33, 7),
        "nan_bf16": torch.tensor([1.0, float("nan"), 2.0], dtype=torch.bfloat16),
        "inf_fp16": torch.tensor([float("inf"), 1.0], dtype=torch.float16),
        "neg_inf_fp32": torch.tensor([[0.0, float("-inf")]]),
    }
    totals = fused_abs_sums(list(tensors.values()))
    finite = {name: bool(torch.isfinite(t)) for name, t in zip(tensors, totals, strict=True)}
    assert finite == {name: name.startswith("fine") for name in tensors}
    assert [t.dtype for t in totals] == [torch.float32] * len(tensors)
    assert float(totals[1]) == pytest.approx(float(tensors["fine_fp32"].abs().sum()), rel=1e-5)
    # float64 tensors are summed apart, in float64 (the scan groups them so)
    pair = [torch.ones(4, dtype=torch.float64), torch.tensor([float("nan")], dtype=torch.float64)]
    doubles = fused_abs_sums(pair, torch.float64)
    assert [t.dtype for t in doubles] == [torch.float64] * 2
    assert float(doubles[0]) == 4.0
    assert torch.isnan(doubles[1])


def test_the_scan_of_bfloat16_keeps_float32_range_and_names_bad_tensors_in_the_callers_order() -> None:
    # bfloat16 on the CPU is summed in its own dtype (no float32 copy): still float32's range, so big
    # finite values pass, a sum that overflows is cleared by the exact check, and NaN/inf are found
    # whatever the dtype groups the sums are read back in.
    big = torch.full((1 << 16,), 1e30, dtype=torch.bfloat16)  # sum 6.6e34: finite in float32's range
    overflow = torch.full((4,), 3e38, dtype=torch.bfloat16)  # sum 1.2e39: inf, every element finite
    bad16 = torch.ones(1 << 12, dtype=torch.bfloat16)
    bad16[100] = float("nan")
    items = [
        ("f32_inf", torch.tensor([float("inf")])),
        ("big", big),
        ("bf16_nan", bad16),
        ("overflow", overflow),
        ("f64_ok", torch.ones(2, dtype=torch.float64)),
        ("f16_inf", torch.tensor([1.0, float("inf")], dtype=torch.float16)),
    ]
    assert non_finite_names(items) == ["f32_inf", "bf16_nan", "f16_inf"]
    check = start_finite_check(items)
    assert check.result(10.0) == ["f32_inf", "bf16_nan", "f16_inf"]  # the same, read when asked
