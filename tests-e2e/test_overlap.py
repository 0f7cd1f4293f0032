"""Overlapped transitions (``offload.overlap``) on real Ray workers on CPU: the same training as the
sequential order, bit for bit; the step budget still adds up, with the hidden seconds apart; a
background sleep or wake that fails is reported in the phase that started it."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch
from conftest import run_cli
from rich.console import Console

from ppo_driver import checkpoint as ck
from ppo_driver.config import load_config
from ppo_driver.loop import RunResult, train
from ppo_driver.ray_start import start_local_ray

QUIET = ["logging.progress=false", "logging.tensorboard=false"]
# Three steps with a checkpoint after the second (a save while transitions overlap) and the final one.
RUN = [*QUIET, "train.steps=3", "checkpoint.interval=2", "rollout.eval_interval=2"]
TRANSITIONS = [f"{r}/{a}" for r in ("actor", "critic", "engines") for a in ("sleep", "wake")]
SAME = ("rollout/reward_mean", "actor/loss", "critic/loss", "critic/values_mean", "actor/grad_norm")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    start_local_ray(load_config(None, QUIET), Console(stderr=True))
    yield
    ray.shutdown()


def _train(tmp_path: Path, name: str, overlap: str) -> tuple[RunResult, str]:
    out = io.StringIO()
    config = load_config(None, [*RUN, f"offload.overlap={overlap}"])
    result = train(config, tmp_path / name, console=Console(file=out, width=200))
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


@pytest.fixture(scope="module")
def both(local_ray: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[RunResult, str]]:
    root = tmp_path_factory.mktemp("overlap")
    # auto on cpu: the rule picks the sequential order (no shared GPU to measure).
    return {"sequential": _train(root, "sequential", "auto"), "overlapped": _train(root, "overlapped", "on")}


@pytest.mark.timeout(600)
def test_the_rule_is_logged_and_followed(both: dict[str, tuple[RunResult, str]]) -> None:
    seq, seq_out = both["sequential"]
    ovl, ovl_out = both["overlapped"]
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
def test_overlapped_training_is_bit_identical_to_sequential(both: dict[str, tuple[RunResult, str]]) -> None:
    seq, _ = both["sequential"]
    ovl, _ = both["overlapped"]
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
def test_overlapped_budget_adds_up_with_hidden_seconds_apart(both: dict[str, tuple[RunResult, str]]) -> None:
    ovl, _ = both["overlapped"]
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
    seq, _ = both["sequential"]
    for t in TRANSITIONS:
        moved = sum(r[f"bytes/{t}"] for r in ovl.history)
        assert moved == pytest.approx(sum(r[f"bytes/{t}"] for r in seq.history), rel=0.5), t
    summary = json.loads((ovl.run_dir / "summary.json").read_text())["budget"]
    rows = {p["part"]: p for p in summary["parts"]}
    assert rows["actor/sleep"]["mean_hidden_s"] is not None
    assert rows["generate"]["mean_hidden_s"] is None  # not a transition


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
