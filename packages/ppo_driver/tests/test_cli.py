"""The ppo-driver CLI: help, parsing, validate, plot, and config errors before anything starts."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from ppo_driver.cli import build_parser, main, resolve
from ppo_driver.metrics import MetricsLog

REPO = Path(__file__).resolve().parents[3]


def test_help_lists_every_command_and_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for word in ("train", "validate", "plot", "--set", "--ray-address", "examples:"):
        assert word in out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for word in ("--config", "--set", "--ray-address", "--run-dir", "metrics.jsonl"):
        assert word in out


def test_import_model_names_a_bad_source_and_an_existing_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["import-model", str(tmp_path / "missing.gguf"), str(tmp_path / "out")]) == 1
    assert (
        "no such file or folder; give a GGUF file or a Hugging Face model folder" in capsys.readouterr().err
    )
    (tmp_path / "weights.bin").write_bytes(b"x")
    assert main(["import-model", str(tmp_path / "weights.bin"), str(tmp_path / "out")]) == 1
    assert "not a .gguf file" in capsys.readouterr().err
    assert main(["import-model", str(tmp_path), str(tmp_path / "out")]) == 1
    assert "neither config.json" in capsys.readouterr().err


def test_import_model_copies_a_hugging_face_folder_and_checks_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ppo_rollout.tasks import make_tiny_model

    src = make_tiny_model("copy", tmp_path / "src", seed=0)
    out = tmp_path / "out"
    assert main(["import-model", str(src), str(out)]) == 0
    text = capsys.readouterr().out
    assert "chat template: no" in text
    assert "checked: the actor, the critic" in text
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    assert not (tmp_path / "out.partial").exists()
    assert main(["import-model", str(src), str(out)]) == 1
    assert "already exists; remove it or pass --force" in capsys.readouterr().err
    assert main(["import-model", str(src), str(out), "--force", "--no-check"]) == 0


def test_console_script_is_installed() -> None:
    exe = shutil.which("ppo-driver")
    assert exe is not None
    done = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0
    assert "usage: ppo-driver" in done.stdout


def test_train_flags_become_config_fields(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "train",
            "--set",
            "train.steps=3",
            "--set",
            "train.seed=5",
            "--ray-address",
            "auto",
            "--run-dir",
            str(tmp_path / "123"),
        ]
    )
    config = resolve(args)
    assert (config.train.steps, config.train.seed) == (3, 5)
    assert config.ray.address == "auto"
    assert config.logging.run_dir == str(tmp_path / "123")  # a string, even when it looks like a number


def test_validate_prints_resolved_config_and_layout(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["validate", str(REPO / "configs" / "2gpu-disaggregate.yaml"), "--set", "train.steps=9"])
    out = capsys.readouterr().out
    assert code == 0
    assert "steps: 9" in out
    assert "mode: disaggregate" in out
    assert "bundles=2 (GPUs)" in out
    assert "actor    bundles [0, 1)" in out
    assert "rollout  bundles [1, 2)" in out
    assert "critic   bundles [0, 1)" in out


def test_validate_rejects_with_the_field_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  micro_batch_size: 5\n")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "train.micro_batch_size" in err


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = MetricsLog(tmp_path, tensorboard=False)
    for step in range(1, 6):
        log.log(
            step,
            {
                "reward/mean": step / 5,
                "actor/loss": 1 / step,
                "time/step": 0.5,
                "offload/transitions": ["actor:sleep"],
            },
        )
    log.close()
    assert main(["plot", str(tmp_path)]) == 0
    png = tmp_path / "curves.png"
    with Image.open(png) as image:
        assert image.format == "PNG"
        assert image.size[0] > 500
    assert "wrote" in capsys.readouterr().out


def test_plot_of_a_folder_without_metrics_fails_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plot", str(tmp_path)]) == 1
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_metrics_log_truncates_on_resume(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path, tensorboard=False)
    for step in range(1, 5):
        log.log(step, {"x": step})
    log.close()
    log = MetricsLog(tmp_path, tensorboard=False, start_step=2)
    log.log(3, {"x": 30})
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["x"]) for r in lines] == [(1, 1), (2, 2), (3, 30)]


def test_tables_are_printed_whole_when_the_output_is_not_a_terminal() -> None:
    """`tee`, `nohup` and CI logs: Rich would fit a table to 80 columns and cut its names short."""
    import io

    from rich.console import Console
    from rich.table import Table

    from ppo_driver.cli import print_whole

    table = Table("part", *(f"generate_{i}_seconds" for i in range(6)))
    table.add_row("TFLOP/s", *("12.5" for _ in range(6)))
    out = io.StringIO()
    print_whole(Console(file=out, soft_wrap=True), table)
    text = out.getvalue()
    assert "…" not in text
    assert all(f"generate_{i}_seconds" in text for i in range(6))
    assert max(len(line) for line in text.splitlines()) > 80


def test_every_declared_rollout_setting_is_reachable_from_yaml(tmp_path: Path) -> None:
    """rollout.sglang, rollout.eval_sampling and rollout.reward_timeout_s: set in a file, validated,
    handed to the rollout manager's config."""
    from ppo_driver import build
    from ppo_driver.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text(
        "rollout:\n"
        "  reward_timeout_s: 30\n"
        "  eval_sampling: {temperature: 0, max_new_tokens: 9, n_samples_per_prompt: 1}\n"
        "  sglang:\n"
        "    mem_fraction_static: 0.7\n"
        "    extra_args: [--max-running-requests, 64]\n"
    )
    config = load_config(path)
    rollout = build.rollout_config(config, tmp_path)
    assert rollout.reward_timeout_s == 30
    assert rollout.eval_sampling is not None
    assert rollout.eval_sampling.max_new_tokens == 9
    assert rollout.sglang.mem_fraction_static == 0.7
    assert rollout.sglang.extra_args == ("--max-running-requests", "64")
    with pytest.raises(ConfigError, match=r"rollout.sglang.mem_fraction_static: Input should be less than 1"):
        load_config(None, ["rollout.sglang.mem_fraction_static=1.5"])
    with pytest.raises(
        ConfigError, match=r"unknown field 'rollout.sglang.extra_arg'; did you mean 'extra_args'"
    ):
        load_config(None, ["rollout.sglang.extra_arg=[x]"])
