"""Settings refused before anything starts (issue 54): YAML booleans for numbers, a truncation marker
that cannot fit, an absurd over-sampling, a missing SmolLM2 folder in a fresh clone; and a dataset set
without a task is accepted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ppo_driver import preflight
from ppo_driver.config import ConfigError, load_config


def _check(*overrides: str) -> None:
    preflight.check(load_config(None, list(overrides)))


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("train.actor_lr=true", "train.actor_lr"),
        ("train.steps=true", "train.steps"),
        ("rollout.sampling.temperature=false", "rollout.sampling.temperature"),
    ],
)
def test_a_yaml_boolean_is_refused_for_a_number(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"{field}: (true|false) is a YAML boolean, not a number"):
        load_config(None, [override])


def test_a_truncation_marker_longer_than_the_observation_limit_is_refused() -> None:
    multi = ("rollout.environment=guess_number", "rollout.task=guess_digit")
    with pytest.raises(
        ConfigError,
        match=r"rollout.multi_turn.truncation_marker \(20 characters.*max_observation_tokens \(16\)",
    ):
        _check(
            *multi,
            "rollout.multi_turn.max_observation_tokens=16",
            "rollout.multi_turn.truncation_marker=" + "x" * 20,
        )
    _check(*multi, "rollout.multi_turn.max_observation_tokens=16", "rollout.multi_turn.truncation_marker=cut")


def test_an_absurd_over_sample_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"over_sample"):
        load_config(
            None, ["rollout.dynamic_sampling.enabled=true", "rollout.dynamic_sampling.over_sample=1e9"]
        )


def test_a_dataset_without_a_task_is_enough(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "label": "1"}) + "\n")
    config = load_config(
        None, [f"rollout.dataset={data}", "model.path=/nonexistent-model-x", "rollout.reward=exact_match"]
    )
    assert config.rollout.task is None
    assert config.rollout.dataset == str(data)


def test_a_missing_smollm2_folder_in_a_fresh_clone_says_import_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no models/ folder here: a fresh clone
    with pytest.raises(ConfigError) as info:
        _check("model.path=models/smollm2-135m-instruct")
    text = str(info.value)
    assert "`ppo-driver import-model SRC models/smollm2-135m-instruct`" in text
    assert "docs/guide/real-model.md" in text
    assert "hf download" not in text


# -- train.lora against the model, before Ray ---------------------------------------------------------
SMOLLM2_135M = {  # SmolLM2-135M's config.json, the parts that size the model (134.5M parameters)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


def _model_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "smollm2-shape"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMOLLM2_135M))
    return folder


def test_lora_target_modules_are_checked_against_the_models_linear_layers(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        _check("train.lora={rank: 4, target_modules: [q_proj, qkv_proj]}")
    text = str(info.value)
    assert "train.lora.target_modules: qkv_proj is not a linear layer of LlamaForCausalLM's decoder" in text
    assert "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in text
    _check("train.lora={rank: 4, target_modules: [q_proj, v_proj]}")  # the tiny model's real names
    model = _model_folder(tmp_path)
    with pytest.raises(ConfigError, match=r"target_modules: c_attn is not a linear layer"):
        _check(f"model.path={model}", "train.lora={rank: 4, target_modules: [c_attn]}")


def _unshare_works() -> bool:
    probe = ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_mounts = pytest.mark.skipif(
    not _unshare_works(), reason="needs `unshare -rm` (user and mount namespaces) to mount as containers do"
)


@needs_mounts
def test_a_dev_shm_too_small_for_share_base_is_refused_in_one_line(tmp_path: Path) -> None:
    model = _model_folder(tmp_path)
    config = tmp_path / "lora.yaml"
    config.write_text(
        f"model: {{path: {model}}}\nplacement: {{device: cpu, critic: shared}}\n"
        "train: {lora: {rank: 4}}\n"
    )
    # Docker's default /dev/shm (64 MB) in a mount namespace of its own: the real check, as in a container.
    script = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" -m ppo_driver validate "$1"'
    run = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, sys.executable, str(config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    lines = [line for line in run.stderr.splitlines() if "share_base" in line]
    assert len(lines) == 1, run.stderr
    line = lines[0]
    assert "train.lora.share_base maps the frozen base from /dev/shm on CPU (538 MB per actor rank" in line
    assert "which has 67 MB free" in line
    assert "--shm-size=2g" in line
    assert "train.lora.share_base=false" in line
    assert "Traceback" not in run.stderr
    # Without share_base the same run passes the checks there.
    config.write_text(config.read_text().replace("{rank: 4}", "{rank: 4, share_base: false}"))
    ok = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, sys.executable, str(config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr


# -- the checkpoint folder's lock -----------------------------------------------------------------------
@needs_mounts
def test_a_checkpoint_dir_in_a_read_only_parent_is_locked_inside_it(tmp_path: Path) -> None:
    parent, run_dir = tmp_path / "shared", tmp_path / "run"
    ckpt = parent / "ckpt"
    ckpt.mkdir(parents=True)
    code = (
        "import sys, pathlib\n"
        "from ppo_driver.runlock import RunLock\n"
        "ckpt, run = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])\n"
        "with RunLock.checkpoints(ckpt, run):\n"
        "    print('locked', sorted(p.name for p in ckpt.iterdir()))\n"
    )
    # The parent read-only (a read-only mount), the checkpoint folder in it writable (a mount of its own).
    script = (
        'mount --bind "$1" "$1" && mount --bind "$2" "$2" && mount -o remount,bind,ro "$1" && '
        'exec "$0" -c "$4" "$2" "$3"'
    )
    run = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, sys.executable, str(parent), str(ckpt), str(run_dir), code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "locked ['.lock']"
    assert sorted(p.name for p in parent.iterdir()) == ["ckpt"]  # nothing written beside it


@needs_mounts
def test_starting_over_in_a_checkpoint_dir_whose_parent_is_read_only_is_refused(tmp_path: Path) -> None:
    parent, run_dir = tmp_path / "shared", tmp_path / "run"
    ckpt = parent / "ckpt"
    (ckpt / "step_000002").mkdir(parents=True)  # an earlier run's checkpoint, to be moved aside
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from ppo_driver import preflight\n"
        "from ppo_driver.config import ConfigError, load_config\n"
        "for resume in ('false', 'true'):\n"
        "    config = load_config(None, [f'checkpoint.dir={sys.argv[1]}', f'checkpoint.resume={resume}'])\n"
        "    try:\n"
        "        preflight.check(config, run_dir=Path(sys.argv[2]))\n"
        "        print(resume, 'ok')\n"
        "    except ConfigError as exc:\n"
        "        print(resume, str(exc).splitlines()[1])\n"
    )
    script = (
        'mount --bind "$1" "$1" && mount --bind "$2" "$2" && mount -o remount,bind,ro "$1" && '
        'exec "$0" -c "$4" "$2" "$3"'
    )
    run = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, sys.executable, str(parent), str(ckpt), str(run_dir), code],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    refused, resumed = run.stdout.splitlines()
    assert refused.startswith("false   - checkpoint.dir: checkpoint.resume=false moves the earlier")
    assert f"its parent {parent} is not writable" in refused
    assert resumed == "true ok"
