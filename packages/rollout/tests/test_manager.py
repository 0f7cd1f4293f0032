"""The rollout manager on a local Ray instance: batches, splits, rewards, errors, offload, resume, sync."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ppo_rollout.batch import FIELDS
from ppo_rollout.config import RolloutConfig
from ppo_rollout.data import JsonlPrompts
from ppo_rollout.manager import RolloutManager
from ppo_rollout.rewards import RewardError, char_match, register_reward, response_text
from ppo_rollout.tasks import get_task
from ppo_value_transport import unpack_fields
from ppo_weight_sync import WeightSender, checksum

pytestmark = pytest.mark.timeout(600)


def _fields(batch) -> list[dict[str, list[torch.Tensor]]]:  # type: ignore[no-untyped-def]
    return [unpack_fields(box) for box in batch.boxes]


def test_batch_masks_splits_and_rewards(manager: RolloutManager, tiny_model: Path) -> None:
    position = manager.source.state_dict()["position"]
    batch = manager.generate(step=0)
    ranks = _fields(batch)
    assert len(ranks) == 2
    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = [get_task("copy").row(position + i, 3) for i in range(4)]
    seen: list[int] = []
    for fields in ranks:
        assert set(fields) == set(FIELDS)
        n = len(fields["tokens"])
        assert n == 6  # 2 prompts x 3 samples per rank
        ids = [int(t) for t in fields["prompt_index"]]
        assert ids == sorted(ids)
        assert all(ids.count(i) == 3 for i in set(ids))
        seen += sorted(set(ids))
        for k in range(n):
            tokens, rlen = fields["tokens"][k], int(fields["response_length"][k])
            row = rows[ids[k]]
            prompt_ids = tok(row["prompt"])["input_ids"]
            assert tokens.dtype == torch.int64
            assert tokens[: len(prompt_ids)].tolist() == prompt_ids
            assert len(tokens) == len(prompt_ids) + rlen
            assert fields["loss_mask"][k].dtype == torch.float32
            assert fields["loss_mask"][k].tolist() == [1.0] * rlen
            lp = fields["rollout_log_probs"][k]
            assert lp.shape == (rlen,)
            assert bool((lp <= 0).all())
            # as the reward reads it: special tokens kept but for the eos that ends it (else cut)
            response_ids = tokens[len(prompt_ids) :].tolist()
            response = response_text(tok, response_ids)
            finish = "stop" if response_ids[-1] == tok.eos_token_id else "length"
            assert float(fields["reward"][k]) == pytest.approx(char_match([_inp(row, response, finish)])[0])
    assert sorted(seen) == [0, 1, 2, 3]
    # The critic has the actor's size here: the same split, the same Boxes.
    assert batch.critic_boxes == batch.boxes
    assert batch.critic_sample_ids == batch.sample_ids
    assert sorted(i for ids in batch.sample_ids for i in ids) == list(range(12))
    assert batch.metrics["rollout/samples"] == 12.0
    assert 0.0 <= batch.metrics["rollout/reward_mean"] <= 1.0


def _inp(row, response, finish_reason="stop"):  # type: ignore[no-untyped-def]
    from ppo_rollout.rewards import RewardInput

    return RewardInput(
        prompt=row["prompt"], response=response, response_token_ids=(), finish_reason=finish_reason, row=row
    )


def test_engines_are_scheduled_in_the_given_placement_group(manager: RolloutManager, slots: Any) -> None:
    from ppo_rollout.engine.handles import BuiltinEngineHandle

    def placement_group_id(self):  # type: ignore[no-untyped-def]
        return ray.get_runtime_context().get_placement_group_id()

    for handle in manager.engines:
        assert isinstance(handle, BuiltinEngineHandle)
        pg_id = ray.get(handle.actor.__ray_call__.remote(placement_group_id), timeout=60)
        assert pg_id == slots.placement_group.id.hex()


def test_state_dict_resumes_the_same_prompts_and_samples(manager: RolloutManager) -> None:
    state = manager.state_dict()
    json.dumps(state)  # plain data: it goes into a checkpoint
    first = _fields(manager.generate(step=5))
    manager.load_state_dict(state)
    again = _fields(manager.generate(step=5))
    for a, b in zip(first, again, strict=True):
        for name in FIELDS:
            assert all(torch.equal(x, y) for x, y in zip(a[name], b[name], strict=True))
    with pytest.raises(ValueError, match="not a rollout state"):
        manager.load_state_dict({"data": {}})


def test_evaluate_is_greedy_and_fixed(manager: RolloutManager) -> None:
    a = manager.evaluate(step=1)
    b = manager.evaluate(step=2)
    assert a == b
    assert a["eval/samples"] == 4.0
    # the training sampling too: its draws do not depend on the step
    assert a["eval/sampled_samples"] == 4.0 * manager.config.sampling.n_samples_per_prompt
    assert 0.0 <= a["eval/accuracy"] <= 1.0


def test_bad_prompts_are_refused_with_the_row(manager: RolloutManager) -> None:
    with pytest.raises(ValueError, match="is empty"):
        manager.renderer.render({"prompt": "   "})
    with pytest.raises(ValueError, match=r"too long: 301 tokens > rollout.max_prompt_length 256"):
        manager.generation.groups([{"prompt": "1" * 300}], 1)


def test_bad_reward_result_names_the_function(manager: RolloutManager) -> None:
    @register_reward("test_manager_nan")
    def nan_reward(samples):  # type: ignore[no-untyped-def]
        return [float("nan")] * len(samples)

    saved = manager.scorer.reward_fn
    manager.scorer.reward_fn = nan_reward
    try:
        with pytest.raises(RewardError, match=r"nan_reward returned nan for sample 0"):
            manager.generate(step=9)
    finally:
        manager.scorer.reward_fn = saved


def test_offload_then_onload(manager: RolloutManager) -> None:
    sums = manager.weights_checksums()
    manager.pop_metrics()  # start from here
    manager.offload()
    manager.offload()  # idempotent: moves nothing more
    with pytest.raises(RuntimeError, match="offloaded; call onload"):
        manager.generate(step=0)
    out = manager.pop_metrics()
    assert out["offload/bytes"] > 0
    assert out["offload/seconds"] > 0
    assert out["onload/bytes"] == 0
    manager.onload()
    back = manager.pop_metrics()
    assert back["onload/bytes"] == out["offload/bytes"]  # everything released came back
    assert back["offload/bytes"] == 0
    assert set(manager.pop_metrics().values()) == {0.0}  # nothing moved since
    assert manager.weights_checksums() == sums
    assert len(manager.generate(step=0).boxes) == 2


def test_weight_update_reaches_every_engine(manager: RolloutManager, tmp_path: Path) -> None:
    from ppo_rollout.tasks import make_tiny_model

    original = [
        (n, t.clone())
        for n, t in AutoModelForCausalLM.from_pretrained(manager.config.model_path).state_dict().items()
    ]
    other = make_tiny_model("copy", tmp_path / "other", seed=5)
    new = [(n, t.clone()) for n, t in AutoModelForCausalLM.from_pretrained(other).state_dict().items()]
    before = manager.weights_checksums()
    sender = WeightSender(backend="gloo", master_address="127.0.0.1", timeout_s=60.0)
    sender.connect(manager.endpoints())
    try:
        sender.update(new, version="7")
        assert manager.weights_checksums() == [checksum(new)] * 2
        # Each sample records the version of the engine that generated it (7: both engines).
        batch = manager.generate(step=3)
        for fields in _fields(batch):
            assert [int(v) for v in fields["weight_version"]] == [7] * len(fields["tokens"])
        assert batch.metrics["rollout/weight_version_min"] == 7.0
        assert before != manager.weights_checksums()
        sender.update(original, version="step-2")  # back, for the other tests
        assert manager.weights_checksums() == before
    finally:
        sender.disconnect()


def test_config_and_split_errors(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"exactly one of rollout\.task"):
        RolloutConfig(model_path=str(tiny_model), task=None)
    with pytest.raises(ValueError, match=r"exactly one of rollout\.task"):
        RolloutConfig(model_path=str(tiny_model), dataset=str(tmp_path / "p.jsonl"))
    with pytest.raises(ValueError, match="no file at"):
        RolloutConfig(model_path=str(tiny_model), task=None, dataset=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="not a built-in task"):
        RolloutConfig(model_path=str(tiny_model), task="sudoku")
    cfg = RolloutConfig(model_path=str(tiny_model), task="copy", prompts_per_step=3)
    with pytest.raises(
        ValueError, match=r"prompts_per_step \(3\) must be a multiple of the data-parallel size \(2\)"
    ):
        RolloutManager(cfg, None, dp_size=2)
    cfg = RolloutConfig(model_path=str(tiny_model), task="copy", prompts_per_step=4)
    with pytest.raises(ValueError, match=r"multiple of the critic's data-parallel size \(3\)"):
        RolloutManager(cfg, None, dp_size=2, critic_dp_size=3)


def test_jsonl_prompts_shuffle_per_epoch_and_resume(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"{i}>", "label": str(i)}) for i in range(5)) + "\n")
    src = JsonlPrompts(path, "question", seed=1)
    epoch0 = [r["label"] for r in src.next_rows(5)]
    assert sorted(epoch0) == [str(i) for i in range(5)]
    state = src.state_dict()
    nxt = src.next_rows(3)
    src.load_state_dict(state)
    assert src.next_rows(3) == nxt
    assert [r["label"] for r in src.eval_rows(2)] == ["0", "1"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1>"}) + "\n" + json.dumps({"text": 3}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field 'prompt' must be a string"):
        JsonlPrompts(bad, "prompt", seed=0)
    assert ray.is_initialized()
