"""Adapter-only updates to SGLang: the request against SGLang 0.5.23's decoding (rebuilt in
``ppo_weight_sync.testing.sglang_lora`` from ``managers/tp_worker.py``, ``utils/common.py`` and
``weight_sync/tensor_bucket.py``) and the LoRA routes' rules."""

from __future__ import annotations

import json
import pickle
import pickletools
import threading
from base64 import b64decode

import pytest
import torch

from ppo_weight_sync.lora import merge_lora
from ppo_weight_sync.sglang import SGLangProtocol
from ppo_weight_sync.sglang_lora import PEFT_PREFIX, AdapterPayload, server_args
from ppo_weight_sync.testing.sglang_lora import SGLangLora, decode_adapter_tensors, normalized_modules

# The globals of SGLang 0.5.23's SafeUnpickler.ALLOWED_GLOBALS (utils/common.py) that a tensor bucket may
# name, and the one it maps (torch.storage._load_from_bytes -> _safe_load_torch_storage).
SGLANG_ALLOWED = {
    ("builtins", "dict"),
    ("builtins", "list"),
    ("collections", "OrderedDict"),
    ("types", "SimpleNamespace"),
    ("torch", "Size"),
    ("torch", "float32"),
    ("torch", "bfloat16"),
    ("torch", "uint8"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.storage", "_load_from_bytes"),
}


def _adapters(dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for path, (o, i) in {
        "model.layers.0.self_attn.q_proj": (8, 6),
        "model.layers.1.mlp.down_proj": (6, 10),
    }.items():
        out.append((f"{path}.lora_A.weight", torch.randn(2, i, generator=g).to(dtype)))
        out.append((f"{path}.lora_B.weight", torch.randn(o, 2, generator=g).to(dtype)))
    return out


def _globals(payload: str) -> set[tuple[str, str]]:
    """The globals a pickle names (protocol 4+: STACK_GLOBAL after two strings)."""
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(b64decode(payload)):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            found.add((strings[-2], strings[-1]))
        elif op.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_request_decodes_as_sglang_decodes_it_bit_for_bit(dtype: torch.dtype) -> None:
    items = _adapters(dtype)
    payload = AdapterPayload.encode(items, alpha=8.0)
    assert payload.nbytes == sum(t.numel() * t.element_size() for _, t in items)
    assert _globals(payload.bucket) <= SGLANG_ALLOWED
    assert payload.config == {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 2,
        "lora_alpha": 8.0,
        "target_modules": ["down_proj", "q_proj"],
        "bias": "none",
    }
    # 0.5.17 on: one entry per TP rank, each rank reading its own; through JSON, as over HTTP
    body = json.loads(json.dumps(payload.request("ppo_actor", tp_size=2, per_rank=True)))
    assert body["lora_name"] == "ppo_actor"
    assert body["load_format"] == "flattened_bucket"
    assert len(body["serialized_named_tensors"]) == 2
    assert "serialized_tensors" not in body
    for rank in (0, 1):
        got = decode_adapter_tensors(body, rank, per_rank=True)
        assert list(got) == [PEFT_PREFIX + n for n, _ in items]
        for name, tensor in items:
            back = got[PEFT_PREFIX + name]
            assert back.dtype == dtype
            assert torch.equal(back.view(torch.uint8), tensor.contiguous().view(torch.uint8))
    # 0.5.15.post1 and 0.5.16: one payload in serialized_tensors
    old = payload.request("ppo_actor", tp_size=2, per_rank=False)
    assert "serialized_named_tensors" not in old
    assert set(decode_adapter_tensors(old, 0, per_rank=False)) == {PEFT_PREFIX + n for n, _ in items}


def test_the_version_decides_the_payload_field_and_the_server_args() -> None:
    assert not SGLangProtocol.for_version("0.5.15.post1").lora_payload_per_rank
    assert not SGLangProtocol.for_version("0.5.16").lora_payload_per_rank
    assert SGLangProtocol.for_version("0.5.17").lora_payload_per_rank
    assert SGLangProtocol.for_version("0.5.23").lora_payload_per_rank
    assert server_args(16, ()) == ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all"]
    assert server_args(4, ("q_proj", "v_proj"))[-2:] == ["q_proj", "v_proj"]


def test_only_adapters_of_one_rank_are_sent() -> None:
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' is not a LoRA adapter tensor"):
        AdapterPayload.encode([("model.norm.weight", torch.ones(4))], alpha=1.0)
    mixed = [("a.q_proj.lora_A.weight", torch.ones(2, 3)), ("b.q_proj.lora_A.weight", torch.ones(4, 3))]
    with pytest.raises(ValueError, match=r"ranks \[2, 4\]"):
        AdapterPayload.encode(mixed, alpha=1.0)
    # a global outside SGLang's allow-list is refused as SGLang refuses it
    body = {"serialized_tensors": __import__("base64").b64encode(pickle.dumps(threading.Lock)).decode()}
    with pytest.raises(RuntimeError, match="Blocked unsafe global"):
        decode_adapter_tensors(body, 0, per_rank=False)


def _server(**kw: object) -> tuple[SGLangLora, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    weights = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 6, generator=g),
        "model.layers.1.mlp.down_proj.weight": torch.randn(6, 10, generator=g),
        "model.norm.weight": torch.ones(6),
    }

    def load(named: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            weights[name] = tensor.clone()

    options: dict = {"per_rank": True, "enabled": True, "max_rank": 4, "target_modules": ["all"]}
    return SGLangLora(lambda: dict(weights), load, **(options | kw)), weights  # type: ignore[arg-type]


def _load(server: SGLangLora, name: str, items: list[tuple[str, torch.Tensor]], alpha: float = 8.0) -> tuple:
    body = AdapterPayload.encode(items, alpha).request(name, 1, per_rank=True)
    answer = server.handle("POST", "/load_lora_adapter_from_tensors", body)
    assert answer is not None
    return answer.status, answer.body


def test_the_server_generates_with_base_plus_scaled_adapter_and_back() -> None:
    server, weights = _server()
    base = {n: t.clone() for n, t in weights.items()}
    items = _adapters()
    status, body = _load(server, "ppo_actor", items)
    assert (status, body["success"], body["loaded_adapters"]) == (200, True, {"ppo_actor": "__tensor__"})
    a, b = items[0][1], items[1][1]
    q = "model.layers.0.self_attn.q_proj.weight"
    expected = merge_lora(base[q], a, b, 8.0 / 2)
    assert torch.equal(weights[q], expected)  # the newest adapter is what the engine holds
    assert torch.allclose(expected, base[q] + 4.0 * b @ a, atol=1e-5)
    with server.use(None):  # a request without lora_path: the base
        assert all(torch.equal(weights[n], base[n]) for n in base)
    with server.use("ppo_actor"):
        assert torch.equal(weights[q], expected)
    models = server.handle("GET", "/v1/models", None)
    assert models is not None
    assert [(c["id"], c["parent"]) for c in models.body["data"]] == [("model", None), ("ppo_actor", "model")]
    # a whole-weight update replaces the base; the adapter is merged again onto it
    weights[q] = torch.zeros(8, 6)
    server.base_updated([q])
    assert torch.equal(weights[q], merge_lora(torch.zeros(8, 6), a, b, 4.0))


def test_the_server_refuses_what_sglang_refuses() -> None:
    server, _ = _server()
    items = _adapters()
    assert _load(server, "x", items)[0] == 200
    status, body = _load(server, "x", items)
    assert (status, body["success"]) == (400, False)
    assert body["error_message"] == "Failed to load LoRA adapter x because it is already loaded"
    unload = server.handle("POST", "/unload_lora_adapter", {"lora_name": "y"})
    assert unload is not None
    assert unload.status == 400
    assert unload.body["error_message"].startswith("LoRA with name y does not exist")
    with pytest.raises(ValueError, match="LoRA adapter that has never been loaded: y"), server.use("y"):
        pass
    ok = server.handle("POST", "/unload_lora_adapter", {"lora_name": "x"})
    assert ok is not None
    assert (ok.status, ok.body["loaded_adapters"]) == (200, {})
    small, _ = _server(max_rank=1)
    assert "incompatible with the current LoRA memory pool" in _load(small, "x", items)[1]["error_message"]
    narrow, _ = _server(target_modules=["q_proj", "k_proj", "v_proj"])
    assert _load(narrow, "x", items)[0] == 400  # down_proj is not among the server's modules
    off, _ = _server(enabled=False)
    assert "Please set `--enable-lora`" in _load(off, "x", items)[1]["error_message"]
    wrong = [("model.layers.0.self_attn.q_proj.lora_A.weight", torch.ones(2, 5)), *items[1:2]]
    assert "needs lora_A (2, 6)" in _load(server, "z", wrong)[1]["error_message"]
    assert normalized_modules(["q_proj", "v_proj", "up_proj"]) == {"qkv_proj", "gate_up_proj"}


def test_an_sglang_endpoint_reaches_another_process_whole() -> None:
    """The driver hands the rollout's endpoints to the actor's Ray workers: a copy keeps the protocol
    (which decides what an adapter update sends) and opens its own connections."""
    from ppo_weight_sync import HttpEngineEndpoint

    protocol = SGLangProtocol.for_version("0.5.16")
    endpoint = HttpEngineEndpoint(
        "http://127.0.0.1:1", 2, 5.0, "sglang-0", ("flattened_bucket",), sglang=protocol
    )
    endpoint.get_weight_version()  # a request in flight: its thread pool and connection stay here
    copy = pickle.loads(pickle.dumps(endpoint))
    assert (copy.base_url, copy.num_gpus, copy.timeout_s, copy.name) == (
        "http://127.0.0.1:1",
        2,
        5.0,
        "sglang-0",
    )
    assert (copy.load_formats, copy.sglang, copy.flush_retry_s) == (("flattened_bucket",), protocol, 60.0)
    endpoint.close()
    copy.close()
