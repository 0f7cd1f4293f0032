"""Pre-flight checks: what `validate` and `train` find without Ray or a GPU, each naming the field."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppo_driver import preflight
from ppo_driver.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[3]


def _check(*overrides: str, run_dir: Path | None = None) -> None:
    preflight.check(load_config(None, list(overrides)), run_dir=run_dir)


def test_default_config_passes(tmp_path: Path) -> None:
    _check(run_dir=tmp_path / "run")


def test_reward_import_and_function(tmp_path: Path) -> None:
    _check("rollout.reward=json:dumps")
    with pytest.raises(ConfigError, match=r"rollout.reward='no_mod_q:f': module 'no_mod_q' does not import"):
        _check("rollout.reward=no_mod_q:f")
    with pytest.raises(ConfigError, match=r"module 'json' has no 'nope'"):
        _check("rollout.reward=json:nope")
    with pytest.raises(ConfigError, match=r"'__doc__' in 'json' is a str, not a function"):
        _check("rollout.reward=json:__doc__")


def test_model_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.path='/no/model' does not exist; set it to a local"):
        _check("model.path=/no/model")
    with pytest.raises(ConfigError, match=r"hf download someorg/nomodel-xyz --local-dir DIR"):
        _check("model.path=someorg/nomodel-xyz")
    (tmp_path / "m").mkdir()
    with pytest.raises(ConfigError, match=r"a folder without config.json"):
        _check(f"model.path={tmp_path / 'm'}")
    (tmp_path / "m" / "config.json").write_text("{}")
    _check(f"model.path={tmp_path / 'm'}")


def test_dataset(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    base = ["rollout.task=null", f"model.path={tmp_path / 'm'}", "rollout.reward=exact_match"]
    data = tmp_path / "d.jsonl"
    with pytest.raises(ConfigError, match=r"rollout.dataset=.* does not exist"):
        _check(*base, f"rollout.dataset={data}")
    data.write_text("")
    with pytest.raises(ConfigError, match=r"is empty"):
        _check(*base, f"rollout.dataset={data}")
    data.write_text('{"text": "a"}\n')
    with pytest.raises(
        ConfigError,
        match=r"d.jsonl:1: field 'prompt' must be a string \(set rollout.prompt_field .*\['text'\]",
    ):
        _check(*base, f"rollout.dataset={data}")
    data.write_text('{"prompt": "a"}\n[1]\n')
    with pytest.raises(ConfigError, match=r"d.jsonl:2: a list, not a JSON object"):
        _check(*base, f"rollout.dataset={data}")
    data.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    _check(*base, f"rollout.dataset={data}")
    with pytest.raises(ConfigError, match=r"rollout.reward is required with rollout.dataset"):
        _check(*base[:2], f"rollout.dataset={data}")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_run_folder(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match=r"--run-dir / logging.run_dir: .* cannot be created"):
        _check(run_dir=locked / "run")


def test_run_folder_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"is a file, so the folder .* cannot be created"):
        _check(run_dir=tmp_path / "f" / "run")
    with pytest.raises(ConfigError, match=r"checkpoint.dir: "):
        _check(f"checkpoint.dir={tmp_path / 'f' / 'ck'}", run_dir=tmp_path / "run")


def test_duplicate_yaml_keys_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 3\nrollout:\n  task: copy_small\ntrain:\n  seed: 1\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'train' at line 5 \(first at line 1\)"):
        preflight.check_yaml_file(path)
    path.write_text("train:\n  steps: 3\n  steps: 4\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'steps' at line 3"):
        preflight.check_yaml_file(path)
    path.write_text("train:\n  steps: 3\n")
    preflight.check_yaml_file(path)


def test_validate_imports_neither_torch_nor_transformers() -> None:
    # What keeps `ppo-driver validate` to about a second on a loaded machine.
    code = (
        "import sys\nfrom ppo_driver.cli import main\n"
        f"assert main(['validate', {str(REPO / 'configs' / 'cpu-default.yaml')!r}]) == 0\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules)\n"
        "print('heavy:', heavy)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "heavy: []" in done.stdout


def test_megatron_backend_rules(tmp_path: Path) -> None:
    """train.backend='megatron': CUDA, Python >= 3.12 with megatron-core, tensor_parallel dividing each
    role's GPUs and the model's heads; all reported at once, with the field to change."""
    with pytest.raises(ConfigError) as info:
        _check("train.backend=megatron", "train.tensor_parallel=2")
    text = str(info.value)
    assert "train.backend='megatron' needs placement.device='cuda' (got 'cpu')" in text
    assert "train.tensor_parallel=2 must divide placement.actor_gpus=1" in text
    if sys.version_info < (3, 12):
        assert "needs Python >= 3.12 (megatron-core 0.19)" in text
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        '{"model_type": "llama", "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 64}'
    )
    with pytest.raises(ConfigError) as info:
        _check("train.backend=megatron", "train.tensor_parallel=2", f"model.path={model}")
    text = str(info.value)
    assert "train.tensor_parallel=2 must divide the model's num_key_value_heads=3" in text
    assert "num_attention_heads" not in text
    # The torch backend has no tensor parallelism: the config itself refuses the combination.
    with pytest.raises(ConfigError, match=r"train.tensor_parallel=2 needs train.backend='megatron'"):
        _check("train.tensor_parallel=2")
