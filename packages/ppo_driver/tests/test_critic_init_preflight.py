"""``train.critic_init_from`` before Ray: the value model's tensors (safetensors headers only) against
the critic of the run's model, a mismatch one line naming the setting, the tensor and both shapes; and
the settings it cannot go with."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaForTokenClassification

from ppo_driver import build, preflight
from ppo_driver.config import ConfigError, load_config
from ppo_rollout.tasks import tiny_model_config


def _value_model(folder: Path, hidden_size: int) -> Path:
    """A value model of the built-in tiny model's architecture (``model.tiny``'s defaults), but
    ``hidden_size`` wide."""
    config = tiny_model_config(hidden_size=hidden_size)  # the tiny model's vocabulary (20 characters)
    config.num_labels = 1
    LlamaForTokenClassification(config).save_pretrained(folder)
    return folder


def test_the_value_models_shapes_are_checked_before_ray(tmp_path: Path) -> None:
    fits = _value_model(tmp_path / "fits", hidden_size=64)
    preflight.check(load_config(None, [f"train.critic_init_from={fits}"]))

    narrow = _value_model(tmp_path / "narrow", hidden_size=32)
    with pytest.raises(ConfigError) as raised:
        preflight.check(load_config(None, [f"train.critic_init_from={narrow}"]))
    assert (
        f"  - train.critic_init_from='{narrow}': tensor 'model.embed_tokens.weight' has shape (20, 32) "
        "but the critic's 'backbone.embed_tokens.weight' has (20, 64); give a value model of model.path's "
        "architecture with one output"
    ) in str(raised.value).splitlines()

    with pytest.raises(ConfigError, match=r"train.critic_init_from='/no/such': is not a folder"):
        preflight.check(load_config(None, ["train.critic_init_from=/no/such"]))


def test_settings_the_source_cannot_go_with(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train.critic_init_from initialises the critic, and placement"):
        load_config(None, ["train.critic_init_from=/x", "placement.critic=none", "algorithm.estimator=grpo"])
    # LoRA with share_base=auto: the critic keeps a backbone of its own.
    lora = ["train.lora.rank=4", "train.data_parallel=replicate"]
    assert build.shares_base(load_config(None, lora))
    assert not build.shares_base(load_config(None, [*lora, "train.critic_init_from=/x"]))
