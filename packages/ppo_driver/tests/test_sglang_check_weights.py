"""train.check_weights with SGLang engines: accepted where the weights read back are whole and merged."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppo_driver.config import ConfigError, load_config


def test_check_weights_with_sglang_needs_one_gpu_servers_and_merged_updates(tmp_path: Path) -> None:
    sglang = ["rollout.engine=sglang", "placement.device=cuda", f"model.path={tmp_path}"]
    config = load_config(None, [*sglang, "train.check_weights=true", "rollout.sglang.check_rows=8"])
    assert config.train.check_weights
    assert config.rollout.sglang.check_rows == 8
    with pytest.raises(ConfigError, match=r"whole only from a server of one GPU"):
        load_config(
            None,
            [*sglang, "train.check_weights=true", "placement.actor_gpus=2", "placement.gpus_per_engine=2"],
        )
    adapters = [*sglang, "train.lora.rank=4", "train.lora.update=adapters", "train.check_weights=true"]
    with pytest.raises(ConfigError, match=r"merged only without adapter-only updates"):
        load_config(None, adapters)
    with pytest.raises(ConfigError, match="check_rows"):
        load_config(None, [*sglang, "rollout.sglang.check_rows=0"])


def test_sglang_refuses_a_float32_model_before_start(tmp_path: Path) -> None:
    """Seen on SGLang 0.5.17 (one H100): a float32 server dies at start in the CUDA rmsnorm kernel."""
    sglang = ["rollout.engine=sglang", "placement.device=cuda", f"model.path={tmp_path}"]
    assert load_config(None, sglang).model.dtype == "auto"
    assert load_config(None, [*sglang, "model.dtype=bfloat16"]).model.dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"SGLang's CUDA rmsnorm takes no float32.*model.dtype=auto"):
        load_config(None, [*sglang, "model.dtype=float32"])
