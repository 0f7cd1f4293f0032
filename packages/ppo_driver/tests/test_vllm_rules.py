"""What ``rollout.engine='vllm'`` refuses before Ray or a server starts, each refusal one line naming the
settings: the config's rules and the pre-flight check of a model folder."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ppo_driver import preflight
from ppo_driver.config import _VLLM_CPU_HEAD_SIZES, ConfigError, load_config
from ppo_rollout.engine.vllm_server import CPU_HEAD_SIZES

VLLM = ["rollout.engine=vllm", "model.tiny.num_heads=2"]  # the tiny model with heads of 32
CUDA = ["placement.device=cuda", "placement.mode=disaggregate", "placement.rollout_gpus=2"]


def _refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid config (1 error):"
    return lines[1].removeprefix("  - ")


def test_the_tiny_models_head_size_must_be_one_vllms_cpu_attention_runs() -> None:
    assert _refusal("rollout.engine=vllm") == (  # the defaults: hidden size 64, 4 heads of 16
        f"rollout.engine='vllm' on CPU takes head sizes {list(CPU_HEAD_SIZES)}; model.tiny gives 16 "
        "(hidden_size 64 / num_heads 4): set model.tiny.num_heads so that the quotient is one of them "
        "(e.g. 2 for hidden_size 64)"
    )
    assert "model.tiny gives 24" in _refusal("rollout.engine=vllm", "model.tiny.hidden_size=96")
    assert load_config(None, VLLM).model.tiny.num_heads == 2
    assert load_config(None, ["rollout.engine=vllm", *CUDA]).rollout.engine == "vllm"  # GPUs: any head
    assert _VLLM_CPU_HEAD_SIZES == CPU_HEAD_SIZES  # the config's copy of the adapter's list


def test_adapter_only_updates_are_refused() -> None:
    assert _refusal(*VLLM, "train.lora.rank=4", "train.lora.update=adapters") == (
        "rollout.engine='vllm' takes whole (merged) weight updates: set train.lora.update='merged'"
    )
    assert load_config(None, [*VLLM, "train.lora.rank=4", "train.lora.update=merged"]).train.lora is not None


def test_reading_weights_back_needs_servers_of_one_gpu() -> None:
    assert _refusal(
        "rollout.engine=vllm", *CUDA, "placement.gpus_per_engine=2", "train.check_weights=true"
    ) == (
        "train.check_weights reads a vLLM server's weights back from one worker: set "
        "placement.gpus_per_engine=1 or train.check_weights=false"
    )
    assert (
        load_config(
            None, ["rollout.engine=vllm", *CUDA, "placement.gpus_per_engine=2"]
        ).placement.gpus_per_engine
        == 2
    )


def test_partial_rollouts_are_taken() -> None:
    partial = ["rollout.partial.enabled=true", "rollout.partial.chunk_tokens=64", "algorithm.tis_cap=2.0"]
    assert load_config(None, [*VLLM, *partial]).rollout.partial.chunk_tokens == 64


def test_preflight_refuses_a_model_folder_whose_head_size_vllms_cpu_attention_cannot_run(
    tmp_path: Path,
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    model = [f"model.path={tmp_path}", "rollout.task=copy_small"]
    message = (
        f"rollout.engine='vllm' on CPU takes attention head sizes {list(CPU_HEAD_SIZES)}; "
        f"model.path='{tmp_path}' has 16 (hidden_size 64 / num_attention_heads 4): run vLLM on GPUs "
        "(placement.device='cuda'), or use rollout.engine='builtin'"
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        preflight.check(load_config(None, ["rollout.engine=vllm", *model]))
    preflight.check(load_config(None, ["rollout.engine=vllm", *model, *CUDA]))  # on GPUs: taken
    preflight.check(load_config(None, model))  # the built-in engine runs any head size
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 576, "num_attention_heads": 9}))
    preflight.check(load_config(None, ["rollout.engine=vllm", *model]))  # SmolLM2-135M's 64
