"""Two runs of the loop on real Ray workers on CPU, one local Ray instance for the module, each
checked by several tests:

- overlapped transitions (``offload.overlap``): the same training as the sequential order, bit for bit;
  the step budget still adds up, with the hidden seconds apart; a background sleep or wake that fails is
  reported in the phase that started it (two runs of the CLI of their own);
- the start order on GPUs (the sequential run starts its roles in it): the trainers' processes start
  before the engines (their imports overlap the engines' start) and are set up after the engines exist
  (the engines size their GPU memory before a trainer makes a CUDA context); the run then trains and
  its engines hold the actor's weights;
- ``startup.warm_up`` (the sequential run warms up, the overlapped one does not): a run with the
  warm-up computes what a run without it computes, step for step (every figure that is not a clock, a
  byte count, a rate or the offload's, and the final weights), and its start-up table has the warm-up's
  row with each trainer's own warm-up under it.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from conftest import run_cli
from rich.console import Console

from ppo_driver import checkpoint as ck
from ppo_driver.config import RunConfig, load_config
from ppo_driver.loop import RunResult, train
from ppo_driver.ray_start import start_local_ray
from ppo_driver.roles import Roles, create_roles

QUIET = ["logging.progress=false", "logging.tensorboard=false"]
# Three steps with a checkpoint after the second (a save while transitions overlap) and the final one.
RUN = [*QUIET, "train.steps=3", "checkpoint.interval=2", "rollout.eval_interval=2"]
TRANSITIONS = [f"{r}/{a}" for r in ("actor", "critic", "engines") for a in ("sleep", "wake")]
SAME = ("rollout/reward_mean", "actor/loss", "critic/loss", "critic/values_mean", "actor/grad_norm")
# Figures that measure time, bytes or rates: they differ from one run to the next.
RolesFactory = Callable[[RunConfig, Path, float], Roles]
_MEASURED = ("time/", "bytes/", "weight_sync/", "offload/", "/sleep", "/wake", "tflops", "_per_s", "seconds")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    start_local_ray(load_config(None, QUIET), Console(stderr=True))
    yield
    ray.shutdown()


def _train(
    tmp_path: Path, name: str, sets: list[str], roles_factory: RolesFactory = create_roles
) -> tuple[RunResult, str]:
    out = io.StringIO()
    config = load_config(None, [*RUN, *sets])
    result = train(config, tmp_path / name, console=Console(file=out, width=200), roles_factory=roles_factory)
    return result, out.getvalue()


def _digest(path: Path) -> str:
    """The file's content: its bytes, or for safetensors its tensors' bytes and its metadata (the file
    lists the metadata in a hash map's order, which differs from process to process)."""
    if path.suffix != ".safetensors":
        return hashlib.sha256(path.read_bytes()).hexdigest()
    from safetensors import safe_open

    digest = hashlib.sha256()
    with safe_open(str(path), "pt") as f:
        digest.update(json.dumps(f.metadata(), sort_keys=True).encode())
        for name in sorted(f.keys()):
            tensor = f.get_tensor(name)
            digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
            digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): _digest(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def _in_gpu_order(monkeypatch: pytest.MonkeyPatch, events: list[str]) -> RolesFactory:
    """The roles started as on GPUs (``together=False``), each start logged to ``events``."""
    from ppo_rollout import manager
    from ppo_trainer import group

    spawn, make_rollout, make_group = (
        group.spawn_workers,
        manager.RolloutManager.__init__,
        group.TrainGroup.__init__,
    )

    def spawn_logged(role: Any, *args: Any, **kwargs: Any) -> Any:
        events.append(f"spawn {role}")
        return spawn(role, *args, **kwargs)

    def rollout_logged(self: Any, *args: Any, **kwargs: Any) -> None:
        make_rollout(self, *args, **kwargs)
        events.append("engines made")

    def group_logged(self: Any, role: Any, *args: Any, **kwargs: Any) -> None:
        events.append(f"set up {role} ({'adopted' if kwargs.get('spawned') else 'spawned there'})")
        make_group(self, role, *args, **kwargs)

    monkeypatch.setattr(group, "spawn_workers", spawn_logged)
    monkeypatch.setattr(manager.RolloutManager, "__init__", rollout_logged)
    monkeypatch.setattr(group.TrainGroup, "__init__", group_logged)

    def in_gpu_order(config: RunConfig, model_path: Path, timeout_s: float) -> Roles:
        return create_roles(config, model_path, timeout_s, together=False)

    return in_gpu_order


@dataclass(frozen=True)
class Runs:
    # offload.overlap=auto (sequential on cpu), roles in GPU order, startup.warm_up=true
    sequential: tuple[RunResult, str]
    overlapped: tuple[RunResult, str]  # offload.overlap=on, no warm-up
    start_order: list[str]  # the sequential run's roles' starts, in order


@pytest.fixture(scope="module")
def runs(local_ray: None, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("overlap")
    events: list[str] = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        # auto on cpu: the rule picks the sequential order (no shared GPU to measure). The warm-up is
        # this run's too: each run is mostly its start-up, and the warm-up must change no figure.
        sets = ["offload.overlap=auto", "startup.warm_up=true"]
        sequential = _train(root, "sequential", sets, _in_gpu_order(monkeypatch, events))
    overlapped = _train(root, "overlapped", ["offload.overlap=on"])
    return Runs(sequential, overlapped, events)


@pytest.mark.timeout(600)
def test_the_rule_is_logged_and_followed(runs: Runs) -> None:
    seq, seq_out = runs.sequential
    ovl, ovl_out = runs.overlapped
    assert "transitions: sequential (offload.overlap=auto on placement.device=cpu" in seq_out
    assert "transitions: overlapped (offload.overlap=on; memory not checked)" in ovl_out
    for result, overlapped in ((seq, False), (ovl, True)):
        recorded = json.loads((result.run_dir / "summary.json").read_text())["transitions"]
        assert recorded["overlap"] is overlapped
        assert recorded["reason"].startswith("offload.overlap=")
    assert {r["offload/overlap"] for r in seq.history} == {0}
    assert {r["offload/overlap"] for r in ovl.history} == {1}
    # Overlapped, the wakes start one phase ahead and the actor's sleep runs under the next generate;
    # the critic woken ahead at the end of a step stays through the next generate (no extra moves).
    # Step 2 saves: its checkpoint waits for the critic's sleep, so the critic is not woken ahead at
    # its end, but when step 3 generates.
    expected = [
        [
            "critic:wake",
            "rollout:sleep",
            "actor:wake",
            "critic:sleep",
            "rollout:wake",
            "actor:sleep",
            "critic:wake",
        ],
        ["rollout:sleep", "actor:wake", "critic:sleep", "rollout:wake", "actor:sleep"],
        ["critic:wake", "rollout:sleep", "actor:wake", "critic:sleep", "rollout:wake", "actor:sleep"],
    ]
    assert [r["offload/transitions"] for r in ovl.history] == expected
    assert seq.history[1]["offload/transitions"] == [
        "rollout:sleep", "critic:wake", "critic:sleep", "actor:wake", "rollout:wake", "actor:sleep",
    ]  # fmt: skip


@pytest.mark.timeout(600)
def test_overlapped_training_is_bit_identical_to_sequential(runs: Runs) -> None:
    seq, _ = runs.sequential
    ovl, _ = runs.overlapped
    assert [r["step"] for r in ovl.history] == [1, 2, 3]
    for a, b in zip(seq.history, ovl.history, strict=True):
        for key in SAME:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        assert a.get("eval/reward_mean") == b.get("eval/reward_mean"), a["step"]
    assert seq.actor_checksum == ovl.actor_checksum
    assert ovl.weights_match
    assert seq.weights_match
    # The checkpoints hold the same bytes (the driver's state records the wall time: left out).
    for step in ("step_000002", "step_000003"):
        for role in ("actor", "critic"):
            ours = _digests(ovl.run_dir / "checkpoints" / step / role)
            assert ours, (step, role)
            assert ours == _digests(seq.run_dir / "checkpoints" / step / role), (step, role)


@pytest.mark.timeout(600)
def test_overlapped_budget_adds_up_with_hidden_seconds_apart(runs: Runs) -> None:
    ovl, _ = runs.overlapped
    parts = [
        "generate", "critic_train", "actor_train", "save", "generate_wait", "eval",
        *TRANSITIONS, "weight_update", "handoff", "check_weights",
    ]  # fmt: skip
    hidden_total = 0.0
    for r in ovl.history:
        named = sum(r[f"time/{p}_s"] for p in parts)
        assert named + r["time/other_s"] == pytest.approx(r["time/step_s"], abs=1e-9), r["step"]
        assert r["time/other_s"] >= -1e-6, r["step"]
        overhead = sum(r[f"time/{p}_s"] for p in (*TRANSITIONS, "weight_update", "handoff"))
        method_s = r["time/step_s"] - r["time/check_weights_s"]
        assert r["time/overhead_fraction"] == pytest.approx(overhead / method_s)
        for t in TRANSITIONS:
            assert r[f"time/{t}_hidden_s"] >= 0.0, (r["step"], t)
        hidden_total += sum(r[f"time/{t}_hidden_s"] for t in TRANSITIONS)
    assert hidden_total > 0  # something ran under other work
    # Every transition's bytes are booked once over the run: as many as the sequential run moved,
    # but for the start-up (not a step's) and the last step (its sleep is waited for in that step).
    seq, _ = runs.sequential
    for t in TRANSITIONS:
        moved = sum(r[f"bytes/{t}"] for r in ovl.history)
        assert moved == pytest.approx(sum(r[f"bytes/{t}"] for r in seq.history), rel=0.5), t
    summary = json.loads((ovl.run_dir / "summary.json").read_text())["budget"]
    rows = {p["part"]: p for p in summary["parts"]}
    assert rows["actor/sleep"]["mean_hidden_s"] is not None
    assert rows["generate"]["mean_hidden_s"] is None  # not a transition


@pytest.mark.timeout(600)
def test_trainers_spawn_before_the_engines_and_set_up_after_them(runs: Runs) -> None:
    assert runs.start_order == [
        "spawn actor",
        "spawn critic",
        "engines made",
        "set up actor (adopted)",
        "set up critic (adopted)",
    ]
    result, _ = runs.sequential
    assert result.last_step == 3
    assert result.weights_match, (result.actor_checksum, result.engine_checksums)
    assert result.startup is not None


def _computed(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if not any(m in k for m in _MEASURED) and not k.endswith("_s")}


@pytest.mark.timeout(600)
def test_a_warmed_run_computes_what_an_unwarmed_one_does(runs: Runs) -> None:
    warm, cold = runs.sequential[0], runs.overlapped[0]
    assert [_computed(r) for r in warm.history] == [_computed(r) for r in cold.history]  # bit for bit
    assert [r["step"] for r in warm.history] == [1, 2, 3]
    assert warm.actor_checksum == cold.actor_checksum
    assert warm.weights_match
    warm_summary = json.loads((warm.run_dir / "summary.json").read_text())
    cold_summary = json.loads((cold.run_dir / "summary.json").read_text())
    warm_parts = [p["part"] for p in warm_summary["startup"]["parts"]]
    assert "warm-up (after roles)" in warm_parts
    assert warm_parts.index("warm-up (after roles)") < warm_parts.index("offload plan")
    detail = warm_summary["startup"]["alongside"]["warm-up (after roles)"]
    assert detail["actor"] > 0  # the trainers ran their phases
    assert detail["critic"] > 0
    assert detail["rollout"] == 0.0  # the CPU engine decodes in a loop: no graphs to capture
    assert "warm-up (after roles)" not in [p["part"] for p in cold_summary["startup"]["parts"]]
    first = warm_summary["first_step_time"]
    assert first["seconds"] > 0
    assert first["over_steady"] > 0


def _run_with_fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str) -> str:
    monkeypatch.setenv("PPO_FAULT_TRANSITION", fault)  # inherited by every process of the run
    done = run_cli(
        "train",
        "--run-dir",
        "run",
        *("--set", "offload.overlap=on"),
        *("--set", "train.steps=3"),
        *("--set", "checkpoint.interval=0"),
        *("--set", "logging.progress=false"),
        cwd=tmp_path,
        timeout=420,
    )
    assert done.returncode != 0, done.stdout[-3000:]
    return done.stdout + done.stderr


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("fault", "started"),
    [
        # The actor's 1st sleep is start-up's, its 2nd the background one that ends step 1: it fails
        # under step 2's generate, and is found when the loop next collects or needs the actor.
        ("actor:sleep:2", "the actor's sleep, started in the background on entering generate (step 1)"),
        # The critic's 2nd wake is woken ahead at the end of step 1 (its 1st, at step 1's generate).
        ("critic:wake:2", "the critic's wake, started in the background on entering generate (step 1)"),
    ],
)
def test_a_failing_background_transition_is_reported_in_its_phase(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str, started: str
) -> None:
    text = _run_with_fault(tmp_path, monkeypatch, fault)
    assert "the run stopped at step 1, phase generate: TransitionFailed: " in text, text[-3000:]
    assert started in text, text[-3000:]
    assert f"PPO_FAULT_TRANSITION={fault}" in text
    assert "every process the run started was ended" in text
    # Step 1 was logged whole before the failure surfaced or not at all; no checkpoint passes for
    # complete (only the final one was due) and the run left no summary.
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    steps = [json.loads(line)["step"] for line in lines]
    assert steps in ([], [1]), steps
    assert ck.latest_complete(tmp_path / "run" / "checkpoints") is None
    assert not (tmp_path / "run" / "summary.json").exists()
