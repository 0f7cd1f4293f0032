"""What a resume refuses before Ray starts, read from the latest checkpoint's driver.json: another
run's checkpoints, a model of another shape, a changed training file, a learning rate that would rise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ppo_driver import resume, resume_checks
from ppo_driver.config import ConfigError, RunConfig, load_config
from ppo_rollout.data import JsonlPrompts


def _checkpoint(
    root: Path, step: int, config: RunConfig, *, run_dir: Path | None, data: dict[str, Any] | None = None
) -> Path:
    """A complete checkpoint folder as the loop writes its driver.json (the weights do not matter here)."""
    folder = root / f"step_{step:06d}"
    folder.mkdir(parents=True)
    extra: dict[str, Any] = {"config": config.model_dump(mode="json")}
    if run_dir is not None:
        extra["run_dir"] = str(run_dir.resolve())
    rollout = {"version": 1, "data": data or {"kind": "task", "task": "copy_small", "seed": 1, "position": 0}}
    doc = {"format": 1, "step": step, "rollout": rollout, "rng": {}, "extra": extra}
    (folder / "driver.json").write_text(json.dumps(doc))
    (folder / "COMPLETE").write_text("")
    return folder


def _refusal(config: RunConfig, run_dir: Path, root: Path) -> str:
    with pytest.raises(ConfigError) as info:
        resume_checks.check(config, run_dir, root)
    return str(info.value)


def test_no_checkpoint_or_resume_off_checks_nothing(tmp_path: Path) -> None:
    resume_checks.check(load_config(), tmp_path / "run", tmp_path / "none")
    config = load_config(None, ["train.steps=10"])
    _checkpoint(
        tmp_path / "ck",
        5,
        load_config(None, ["model.tiny.hidden_size=32", "model.tiny.num_heads=2"]),
        run_dir=None,
    )
    resume_checks.check(load_config(None, ["checkpoint.resume=false"]), tmp_path / "run", tmp_path / "ck")
    assert "model.tiny.hidden_size is 64" in _refusal(config, tmp_path / "run", tmp_path / "ck")


def test_another_runs_checkpoints_are_refused(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    config = load_config(None, [f"checkpoint.dir={tmp_path / 'shared'}"])
    _checkpoint(tmp_path / "shared", 60, config, run_dir=first)
    text = _refusal(config, second, tmp_path / "shared")
    assert (
        f"checkpoint.dir {tmp_path / 'shared'} holds the checkpoints of the run in {first} (step 60)" in text
    )
    assert "checkpoint.accept_changes=[other_run]" in text
    resume_checks.check(config, first, tmp_path / "shared")  # its own run resumes
    ok = load_config(None, [f"checkpoint.dir={tmp_path / 'shared'}", "checkpoint.accept_changes=[other_run]"])
    resume_checks.check(ok, second, tmp_path / "shared")
    first.rmdir()  # a run folder moved elsewhere: the checkpoints go with the run that resumes them
    resume_checks.check(config, second, tmp_path / "shared")
    # A copied run folder holds its checkpoints inside it: the copy resumes, the original still exists.
    (tmp_path / "a").mkdir()
    _checkpoint(tmp_path / "copy" / "checkpoints", 60, load_config(), run_dir=tmp_path / "a")
    resume_checks.check(load_config(), tmp_path / "copy", tmp_path / "copy" / "checkpoints")


def _model(folder: Path, **shape: Any) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, **shape}))
    return folder


def test_a_model_of_another_shape_is_named_before_loading(tmp_path: Path) -> None:
    a, copy, b = _model(tmp_path / "a"), _model(tmp_path / "copy"), _model(tmp_path / "b", hidden_size=128)
    _checkpoint(tmp_path / "ck", 5, load_config(None, [f"model.path={a}"]), run_dir=None)
    text = _refusal(load_config(None, [f"model.path={b}"]), tmp_path / "run", tmp_path / "ck")
    assert f"model.path changed from '{a}' to '{b}', a model of another shape (hidden_size 64 -> 128)" in text
    resume_checks.check(load_config(None, [f"model.path={copy}"]), tmp_path / "run", tmp_path / "ck")
    text = _refusal(load_config(), tmp_path / "run", tmp_path / "ck")
    assert f"model.path is None; the checkpoint was written with model.path='{a}'" in text


def test_a_changed_training_file_is_refused_with_the_counts(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": str(i)}) + "\n" for i in range(128)))
    sets = ["rollout.task=null", "rollout.reward=exact_match", f"rollout.dataset={data}", "model.path=/m"]
    config = load_config(None, sets)
    source = JsonlPrompts(data, "prompt", config.train.seed)
    source.next_rows(90)
    _checkpoint(tmp_path / "ck", 5, config, run_dir=None, data=source.state_dict())
    resume_checks.check(config, tmp_path / "run", tmp_path / "ck")  # the same file
    data.write_text("".join(json.dumps({"prompt": str(i)}) + "\n" for i in range(64)))
    text = _refusal(config, tmp_path / "run", tmp_path / "ck")
    assert f"rollout.dataset {data}: the file changed since the checkpoint (128 rows, sha256 " in text
    assert "64 rows, sha256 " in text
    assert "the saved position (epoch 0, row 90) no longer names the same prompts" in text
    assert "set checkpoint.accept_changes=[dataset]" in text
    resume_checks.check(
        load_config(None, [*sets, "checkpoint.accept_changes=[dataset]"]), tmp_path / "run", tmp_path / "ck"
    )


def test_raising_train_steps_on_a_cosine_schedule_is_refused(tmp_path: Path) -> None:
    cosine = ["train.lr_schedule=cosine", "train.min_lr_ratio=0.1"]
    _checkpoint(tmp_path / "ck", 60, load_config(None, [*cosine, "train.steps=60"]), run_dir=None)
    text = _refusal(load_config(None, [*cosine, "train.steps=100"]), tmp_path / "run", tmp_path / "ck")
    assert (
        "train.steps=100 (the checkpoint's run: 60) with train.lr_schedule='cosine' would raise the " in text
    )
    assert "from 0.1 to 0.4" in text  # the cosine's floor, then 0.1 + 0.9 * (1 + cos(pi * 60/99)) / 2
    assert "checkpoint.accept_changes=[lr_rise]" in text
    ok = load_config(None, [*cosine, "train.steps=100", "checkpoint.accept_changes=[lr_rise]"])
    resume_checks.check(ok, tmp_path / "run", tmp_path / "ck")
    # A constant schedule extends without a rise; a resume in the middle of the same cosine too.
    constant = "train.lr_schedule=constant"
    _checkpoint(tmp_path / "c2", 60, load_config(None, [constant, "train.steps=60"]), run_dir=None)
    resume_checks.check(load_config(None, [constant, "train.steps=100"]), tmp_path / "run", tmp_path / "c2")
    _checkpoint(tmp_path / "c3", 30, load_config(None, [*cosine, "train.steps=60"]), run_dir=None)
    resume_checks.check(load_config(None, [*cosine, "train.steps=60"]), tmp_path / "run", tmp_path / "c3")


def test_settings_newer_than_a_checkpoint_are_no_change() -> None:
    saved = load_config().model_dump(mode="json")
    del saved["rollout"]["sglang"], saved["rollout"]["eval_sampling"], saved["rollout"]["reward_timeout_s"]
    assert resume.changed_fields(saved, load_config()) == []
    assert resume.changed_fields(saved, load_config(None, ["rollout.max_prompt_length=99"])) == [
        "rollout.max_prompt_length"
    ]
    now = load_config().model_dump(mode="json")
    assert resume.changed_fields(now, load_config(None, ["rollout.eval_sampling.temperature=0"])) != []


def test_a_checkpoint_folder_of_its_own_holds_one_run_at_a_time(tmp_path: Path) -> None:
    """Two run folders sharing one checkpoint.dir: the second run is refused while the first runs,
    naming the holder's run folder. The lock sits beside the folder (resume=false renames it)."""
    from ppo_driver.runlock import RunFolderBusyError, RunLock

    shared = tmp_path / "shared"
    with RunLock.checkpoints(shared, tmp_path / "first"):
        assert (tmp_path / ".shared.lock").is_file()
        with pytest.raises(RunFolderBusyError) as info, RunLock.checkpoints(shared, tmp_path / "second"):
            pass
        text = str(info.value)
        assert f"checkpoint.dir {shared} is in use by pid " in text
        assert f"run folder {tmp_path / 'first'}" in text
        assert "give each run its own checkpoint.dir" in text
    with RunLock.checkpoints(shared, tmp_path / "second"):  # released with its holder
        pass


def test_an_accepted_dataset_change_marks_the_saved_position(tmp_path: Path) -> None:
    """checkpoint.accept_changes=[dataset]: the data position the rollout loads is marked to start a
    new epoch of the changed file (ppo_rollout.data.JsonlPrompts.load_state_dict)."""
    from ppo_rollout.data import NEXT_EPOCH

    saved = {"version": 1, "data": {"kind": "jsonl", "epoch": 2, "offset": 90, "rows": 128, "sha256": "ab"}}
    assert resume._data_position(saved, load_config()) == saved
    marked = resume._data_position(saved, load_config(None, ["checkpoint.accept_changes=[dataset]"]))
    assert marked["data"] == {**saved["data"], "on_change": NEXT_EPOCH}
    assert "on_change" not in saved["data"]  # the checkpoint's own state is left as it was


def test_a_changed_lora_setting_is_refused(tmp_path: Path) -> None:
    lora = ["train.lora.rank=4"]
    _checkpoint(tmp_path / "ck", 5, load_config(None, lora), run_dir=None)
    resume_checks.check(
        load_config(None, [*lora, "train.lora.dropout=0.1"]), tmp_path / "run", tmp_path / "ck"
    )
    text = _refusal(load_config(None, ["train.lora.rank=8"]), tmp_path / "run", tmp_path / "ck")
    assert "train.lora is {rank: 8, alpha: 32.0" in text
    assert "the checkpoint was trained with {rank: 4, alpha: 32.0" in text
    assert "null (every weight trains)" in _refusal(load_config(), tmp_path / "run", tmp_path / "ck")
