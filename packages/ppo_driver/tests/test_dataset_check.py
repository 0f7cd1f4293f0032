"""The dataset's pre-flight alongside Ray's and the roles' start (``preflight.DatasetCheck``): the same
answer and the same error as the check run in place, and the error stops a run with exit code 2."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from ppo_driver import preflight
from ppo_driver.config import ConfigError, load_config
from ppo_driver.step_record import Where
from ppo_driver.stops import report_failures


def _config(tmp_path: Path, rows: list[str], max_prompt_length: int = 64) -> object:
    from ppo_rollout.tasks import make_tiny_model

    model = tmp_path / "m"
    if not model.exists():
        make_tiny_model("copy", model, seed=0)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "label": p}) + "\n" for p in rows))
    return load_config(
        None,
        [
            "rollout.task=null",
            f"model.path={model}",
            "rollout.reward=exact_match",
            f"rollout.dataset={data}",
            f"rollout.max_prompt_length={max_prompt_length}",
        ],
    )


def test_the_check_alongside_answers_as_the_check_in_place(tmp_path: Path) -> None:
    config = _config(tmp_path, ["0123", "321", "210"])
    running = preflight.DatasetCheck(config)  # type: ignore[arg-type]
    got = running.result(timeout_s=120)
    assert got is not None
    assert got.startswith("3 prompts, the longest ")
    expected = preflight.check_dataset(config)  # type: ignore[arg-type]
    assert expected is not None
    assert got.split(", checked in")[0] == expected.split(", checked in")[0]
    assert not [t for t in threading.enumerate() if t.name == "dataset-check"]  # the thread ended


def test_a_prompt_the_run_would_fail_on_is_raised_by_result(tmp_path: Path) -> None:
    config = _config(tmp_path, ["0123", "0123012301230123012301230123"], max_prompt_length=8)
    running = preflight.DatasetCheck(config)  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match=r"d.jsonl:2: prompt '0123.*' is too long: .* > rollout.max_prompt_length 8"
    ):
        running.result(timeout_s=120)
    with pytest.raises(ConfigError, match=r"rollout\.max_prompt_length 8"):  # failed: raised at once
        running.raise_if_failed()
    good = preflight.DatasetCheck(_config(tmp_path, ["0123"]))  # type: ignore[arg-type]
    assert good.result(timeout_s=120) is not None
    good.raise_if_failed()  # done and passed: nothing raised


def test_a_late_config_error_is_not_turned_into_a_run_failure(tmp_path: Path) -> None:
    """The run's failure reporter lets it through: the CLI stops with exit code 2, as in pre-flight."""
    with pytest.raises(ConfigError, match="bad row"), report_failures(Where(), tmp_path, tmp_path):
        raise ConfigError("bad row")
