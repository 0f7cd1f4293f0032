"""How ``create_roles`` starts the parts of a run: together on CPU, one after the other on GPUs, and
what a part that fails to start leaves behind (nothing: the parts made are shut down)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ppo_driver.roles import _make_all


class Part:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log
        log.append(f"made {name}")

    def shutdown(self) -> None:
        self.log.append(f"shutdown {self.name}")


def _maker(name: str, log: list[str], barrier: threading.Barrier | None = None) -> Callable[[], Any]:
    def make() -> Part:
        if barrier is not None:
            barrier.wait()  # returns only when every part is starting at the same time
        return Part(name, log)

    return make


def _failing(message: str, barrier: threading.Barrier | None = None) -> Callable[[], Any]:
    def make() -> Part:
        if barrier is not None:
            barrier.wait()
        raise RuntimeError(message)

    return make


def test_parts_start_together() -> None:
    log: list[str] = []
    barrier = threading.Barrier(3, timeout=30)
    made = _make_all({n: _maker(n, log, barrier) for n in ("rollout", "actor", "critic")}, together=True)
    assert list(made) == ["rollout", "actor", "critic"]
    assert [p.name for p in made.values()] == ["rollout", "actor", "critic"]
    assert sorted(log) == ["made actor", "made critic", "made rollout"]


def test_a_part_failing_together_shuts_down_the_others_once_they_started() -> None:
    log: list[str] = []
    barrier = threading.Barrier(3, timeout=30)
    makers = {
        "rollout": _maker("rollout", log, barrier),
        "actor": _failing("actor rank 0: setup failed", barrier),
        "critic": _maker("critic", log, barrier),
    }
    with pytest.raises(RuntimeError, match="actor rank 0: setup failed"):
        _make_all(makers, together=True)
    assert sorted(log[:2]) == ["made critic", "made rollout"]
    assert log[2:] == ["shutdown critic", "shutdown rollout"]


def test_the_first_failure_is_raised() -> None:
    makers = {"rollout": _failing("engine failed"), "actor": _failing("actor failed")}
    with pytest.raises(RuntimeError, match="engine failed"):
        _make_all(makers, together=True)


def test_one_after_the_other_stops_at_the_first_failure() -> None:
    log: list[str] = []
    makers = {
        "rollout": _maker("rollout", log),
        "actor": _failing("actor failed"),
        "critic": _maker("critic", log),
    }
    with pytest.raises(RuntimeError, match="actor failed"):
        _make_all(makers, together=False)
    assert log == ["made rollout", "shutdown rollout"]  # the critic was never started
    made = _make_all({"rollout": _maker("rollout", log), "actor": _maker("actor", log)}, together=False)
    assert list(made) == ["rollout", "actor"]
    assert log[-2:] == ["made rollout", "made actor"]


REPO = Path(__file__).resolve().parents[3]
GRPO = ["algorithm.estimator=grpo", "placement.critic=none"]


@pytest.mark.parametrize(
    ("config_file", "overrides", "expected"),
    [
        (None, [], "the rollout engine, the actor (1 rank), the critic (1 rank)"),
        ("2gpu-colocate.yaml", [], "2 rollout engines, the actor (2 ranks), the critic (2 ranks)"),
        (None, GRPO, "the rollout engine, the actor (1 rank)"),
    ],
)
def test_the_start_up_line_names_what_starts(
    config_file: str | None, overrides: list[str], expected: str
) -> None:
    from ppo_driver.config import load_config
    from ppo_driver.roles import role_names as _role_names

    config = load_config(REPO / "configs" / config_file if config_file else None, overrides)
    assert _role_names(config) == expected
