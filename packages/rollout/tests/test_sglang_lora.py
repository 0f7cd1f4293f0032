"""Adapter-only weight updates to SGLang, over HTTP against the stand-in: the server starts with LoRA on,
loads each update as the adapter ``ppo_actor`` (SGLang 0.5.23's ``/load_lora_adapter_from_tensors``),
and generates with ``W + alpha / r * B A``: the same tokens as the merged model, the same checksum."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ppo_rollout.config import AdapterUpdates, RolloutConfig, SamplingConfig
from ppo_rollout.engine.core import GenerationCore
from ppo_rollout.engine.handles import SGLangEngineHandle
from ppo_rollout.engine.sglang import SGLangClient, SGLangError, SGLangServerSpec
from ppo_rollout.manager import RolloutManager
from ppo_weight_sync import WeightSender, checksum
from ppo_weight_sync.lora import merge_lora
from ppo_weight_sync.sglang_lora import SGLangAdapters

pytestmark = pytest.mark.timeout(300)

LORA = AdapterUpdates(rank=2, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


@pytest.fixture(scope="module")
def lora_manager(
    ray_session: None, standin_config: Callable[..., RolloutConfig], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RolloutManager, Path]]:
    record = tmp_path_factory.mktemp("standin-lora") / "requests.jsonl"
    manager = RolloutManager(standin_config(record, lora=LORA), None, dp_size=1)
    yield manager, record
    manager.shutdown()


def _adapters(model: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Random adapters on the layers LORA targets, large enough to change greedy tokens."""
    g = torch.Generator().manual_seed(seed)
    state = AutoModelForCausalLM.from_pretrained(model).state_dict()
    out = []
    for name, w in state.items():
        if name.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight")):
            path = name.removesuffix(".weight")
            out.append((f"{path}.lora_A.weight", torch.randn(LORA.rank, w.shape[1], generator=g)))
            out.append((f"{path}.lora_B.weight", torch.randn(w.shape[0], LORA.rank, generator=g)))
    return out


def _merged(model: Path, adapters: list[tuple[str, torch.Tensor]], folder: Path) -> Path:
    """The model folder with every adapted weight set to merge_lora(W, A, B, alpha / r)."""
    shutil.copytree(model, folder)
    hf = AutoModelForCausalLM.from_pretrained(model)
    named = dict(adapters)
    with torch.no_grad():
        for name, w in hf.state_dict().items():
            a = named.get(name.replace(".weight", ".lora_A.weight"))
            if a is not None:
                b = named[name.replace(".weight", ".lora_B.weight")]
                w.copy_(merge_lora(w, a, b, LORA.scale))
    hf.save_pretrained(folder)
    return folder


def _requests(record: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in record.read_text().splitlines()]


def test_the_server_starts_with_lora_on() -> None:
    argv = SGLangServerSpec(model_path="/m", port=1, lora=LORA).argv()
    at = argv.index("--enable-lora")
    assert argv[at : at + 7] == [
        "--enable-lora",
        "--max-lora-rank",
        "2",
        "--lora-target-modules",
        "q_proj",
        "v_proj",
        "down_proj",
    ]
    assert "--enable-lora" not in SGLangServerSpec(model_path="/m", port=1).argv()


def test_adapter_updates_over_http_generate_as_the_merged_model(
    lora_manager: tuple[RolloutManager, Path], tiny_model: Path, tmp_path: Path
) -> None:
    manager, record = lora_manager
    handle = manager.engines[0]
    assert isinstance(handle, SGLangEngineHandle)
    client: SGLangClient = handle.client
    assert client.adapter == "ppo_actor"
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=6)
    prompts = [[1, 5, 6, 14], [1, 7, 8, 9, 14]]
    with pytest.raises(SGLangError, match="LoRA adapter that has never been loaded: ppo_actor"):
        client.generate(prompts, greedy)  # no update yet: no adapter to name
    base = GenerationCore(tiny_model).generate(prompts, greedy)
    sender = WeightSender(
        backend="gloo", master_address="127.0.0.1", timeout_s=60.0, transports=[SGLangAdapters(LORA.alpha)]
    )
    sender.connect(manager.endpoints())
    try:
        for version, seed in (("1", 1), ("2", 2)):
            adapters = _adapters(tiny_model, seed)
            sender.update(adapters, version=version)
            sent = sender.pop_metrics()
            # the adapters alone: float32 x rank 2 x (in + out) of q (64, 64), v (64, 64) and down (64, 128),
            # two decoder layers
            assert sent["weight_sync/bytes"] == sum(t.numel() * 4 for _, t in adapters) == 7_168
            assert client.endpoint.get_weight_version().result(60) == version
            merged = _merged(tiny_model, adapters, tmp_path / f"merged-{version}")
            core = GenerationCore(merged)
            outs = client.generate(prompts, greedy)
            # the server runs each request alone, the reference both at once: log-probs to rounding
            for out, ref in zip(outs, core.generate(prompts, greedy), strict=True):
                assert (out.token_ids, out.finish_reason) == (ref.token_ids, ref.finish_reason)
                assert out.log_probs == pytest.approx(ref.log_probs, abs=1e-5)
            assert [o.token_ids for o in outs] != [o.token_ids for o in base]
            checksums = client.endpoint.request("GET", "/standin_tp_checksums")["checksums"]
            assert checksums == [checksum(core.named_tensors())]
    finally:
        sender.disconnect()
    updates = [r for r in _requests(record) if "lora" in r["path"] or r["path"] == "/update_weight_version"]
    assert [(r["path"], r["status"]) for r in updates] == [
        ("/load_lora_adapter_from_tensors", 200),
        ("/update_weight_version", 200),
        ("/unload_lora_adapter", 200),
        ("/load_lora_adapter_from_tensors", 200),
        ("/update_weight_version", 200),
    ]
    load = updates[0]["body"]
    assert load["lora_name"] == "ppo_actor"
    assert load["config_dict"]["r"] == 2
    assert load["config_dict"]["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert updates[1]["body"] == {"new_version": "1", "abort_all_requests": False}
    generate = [r for r in _requests(record) if r["path"] == "/generate"][-1]["body"]
    assert generate["lora_path"] == "ppo_actor"
    assert not any(r["path"] == "/update_weights_from_distributed" for r in _requests(record))
