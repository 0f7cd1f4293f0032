"""``rollout.task: reasoning_gym:<name>``: reasoning-gym's generators as prompt streams (fixed for a
seed, held-out questions and templates never trained on), their own scorers as the reward, the
settings' errors, and a rollout manager step on such a task."""

from __future__ import annotations

import hashlib
import string
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ppo_rollout.config import RolloutConfig, SamplingSettings
from ppo_rollout.data import TaskPrompts, open_prompts
from ppo_rollout.reasoning_gym_task import (
    ANSWER_INSTRUCTION,
    HELD_OUT_EVERY,
    HELD_OUT_TEMPLATE_EVERY,
    INSTALL,
    ReasoningGymTask,
    extract_answer,
    generator_names,
)
from ppo_rollout.rewards import RewardError, RewardInput, compute_rewards, resolve_reward
from ppo_rollout.scoring import reward_spec
from ppo_rollout.tasks import get_task, make_tiny_model
from ppo_rollout.tokenizer import build_char_tokenizer

GSM = "reasoning_gym:gsm_symbolic"
# A tiny question space (a + b or a - b of single digits: 200 questions), where two seeds' streams
# of a few hundred rows would share questions if they were split by seed alone.
SMALL_SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def _sample(response: str, row: dict[str, object]) -> RewardInput:
    return RewardInput(
        prompt=str(row.get("prompt", "")),
        response=response,
        response_token_ids=(),
        finish_reason="stop",
        row=row,
    )


def _question(row: dict[str, object]) -> str:
    return str(row["prompt"]).removesuffix(f"\n\n{ANSWER_INSTRUCTION}")


def test_rows_are_a_function_of_index_and_seed() -> None:
    first = [ReasoningGymTask(GSM).row(i, 7) for i in range(6)]
    # a new task object (nothing cached), rows asked for out of order: the same rows
    again = ReasoningGymTask(GSM)
    assert [again.row(i, 7) for i in reversed(range(6))] == first[::-1]
    assert [r["prompt"] for r in first] != [ReasoningGymTask(GSM).row(i, 8)["prompt"] for i in range(6)]
    for i, row in enumerate(first):
        assert row["index"] == i
        assert str(row["prompt"]).endswith(f"Do not include units.\n\n{ANSWER_INSTRUCTION}")
        assert row["label"] == row["entry"]["answer"]  # type: ignore[index]
        assert row["task"] == GSM
    # resumes: a data position names the same rows
    source = TaskPrompts(GSM, 7)
    source.next_rows(3)
    state = source.state_dict()
    resumed = TaskPrompts(GSM, 7)
    resumed.load_state_dict(state)
    assert [r["prompt"] for r in resumed.next_rows(3)] == [r["prompt"] for r in first[3:]]
    # other generator settings draw other rows: a position saved with them is refused
    countdown = TaskPrompts("reasoning_gym:countdown", 7, {"min_numbers": 3, "max_numbers": 3})
    saved = countdown.state_dict()
    assert saved["task_args"] == {"min_numbers": 3, "max_numbers": 3}
    with pytest.raises(ValueError, match=r"saved with rollout\.task_args=\{'min_numbers': 3, 'max_"):
        TaskPrompts("reasoning_gym:countdown", 7).load_state_dict(saved)


def test_gsm_symbolic_trains_and_evaluates_on_disjoint_templates() -> None:
    task = ReasoningGymTask(GSM)
    train = [task.row(i, 0) for i in range(300)]
    held_out = [task.eval_row(i, 0) for i in range(60)]
    train_templates = {r["template"] for r in train}
    held_templates = {r["template"] for r in held_out}
    assert len(train_templates) > 30  # both sides draw from many
    assert len(held_templates) > 8
    assert train_templates.isdisjoint(held_templates)
    assert all(t % HELD_OUT_TEMPLATE_EVERY == 0 for t in held_templates)  # type: ignore[operator]
    assert all(t % HELD_OUT_TEMPLATE_EVERY != 0 for t in train_templates)  # type: ignore[operator]
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in held_out)
    # the evaluation stream is fixed whatever the training position, and kept once made
    assert [task.eval_row(i, 0) for i in range(5)] == held_out[:5]
    assert [ReasoningGymTask(GSM).eval_row(i, 0)["prompt"] for i in range(5)] == [
        r["prompt"] for r in held_out[:5]
    ]


def test_held_out_questions_by_hash_where_there_are_no_templates() -> None:
    task = ReasoningGymTask("reasoning_gym:chain_sum", SMALL_SUMS)
    train = {_question(task.row(i, 0)) for i in range(400)}
    held_out = {_question(task.eval_row(i, 0)) for i in range(60)}
    assert len(train) > 100  # a small space: questions come round again
    assert len(held_out) > 5
    assert train.isdisjoint(held_out)
    marked = [hashlib.sha256(q.encode()).digest()[0] % HELD_OUT_EVERY == 0 for q in held_out]
    assert all(marked)
    # what the split prevents: the two seed streams alone share questions in so small a space
    import reasoning_gym

    one = reasoning_gym.create_dataset("chain_sum", seed=1, size=400, **SMALL_SUMS)
    two = reasoning_gym.create_dataset("chain_sum", seed=10**6, size=60, **SMALL_SUMS)
    assert {one[i]["question"] for i in range(400)} & {two[i]["question"] for i in range(60)}


def test_task_args_reach_the_generator() -> None:
    task = get_task("reasoning_gym:countdown", {"min_numbers": 3, "max_numbers": 3, "max_target": 150})
    rows = [task.row(i, 0) for i in range(4)]
    for row in rows:
        metadata = row["entry"]["metadata"]
        assert len(metadata["numbers"]) == 3
        assert 100 <= metadata["target"] <= 150
    settings = RolloutConfig(model_path="m", task="reasoning_gym:countdown", task_args={"min_numbers": 3})
    assert open_prompts(settings, 0).next_rows(1)[0]["task_args"] == {"min_numbers": 3}


def test_the_generators_scorer_is_the_reward() -> None:
    config = RolloutConfig(model_path="m", task=GSM)
    assert reward_spec(config) == "reasoning_gym"
    reward = resolve_reward(reward_spec(config))
    row = ReasoningGymTask(GSM).row(0, 0)
    gold = str(row["label"])
    responses = [
        f"First, 3 + 4 = 7. So the answer is <answer>{gold}</answer>",
        f"<answer>{int(gold) + 1}</answer> no, wait: <answer>{gold}</answer>",  # the last one counts
        f"Natalia sold 48/2 = 24 clips.\n#### {gold}",  # GSM8K's mark
        f"<answer>{int(gold) + 1}</answer>",  # a wrong number: gsm_symbolic gives 0.01
        f"The answer is {gold}.",  # no mark: nothing to score
    ]
    values = compute_rewards(reward, [_sample(r, row) for r in responses])
    assert values == [1.0, 1.0, 1.0, 0.01, 0.0]

    countdown = get_task("reasoning_gym:countdown", {"min_numbers": 3, "max_numbers": 3})
    row = countdown.row(0, 0)
    numbers = row["entry"]["metadata"]["numbers"]
    responses = [
        f"<answer>{row['label']}</answer>",
        f"<answer>{' + '.join(map(str, numbers))} + 1</answer>",  # a number it was not given: 0.05
    ]
    assert compute_rewards(reward, [_sample(r, row) for r in responses]) == [1.0, 0.05]


def test_extract_answer_reads_tags_then_hashes() -> None:
    assert extract_answer("x <answer> 12 </answer> y <answer>3 * 4</answer>") == "3 * 4"
    assert extract_answer("steps\n#### 1,234\nthanks") == "1,234"
    assert extract_answer("<answer>5</answer>\n#### 6") == "5"
    assert extract_answer("I think 42") is None


def test_the_reward_refuses_rows_of_another_task() -> None:
    reward = resolve_reward("reasoning_gym")
    with pytest.raises(RewardError, match=r"scores rows of rollout\.task: reasoning_gym:<name>"):
        compute_rewards(reward, [_sample("<answer>1</answer>", {"prompt": "12>", "label": "21"})])


def test_errors_name_the_field_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"rollout\.task='reasoning_gym:gsm_symbolc'") as bad:
        RolloutConfig(model_path="m", task="reasoning_gym:gsm_symbolc")
    line = str(bad.value).splitlines()[1]  # pydantic's first line is its count of errors
    assert "reasoning-gym has no generator 'gsm_symbolc' (did you mean gsm_symbolic?)" in line
    assert ", ".join(generator_names()) in line  # every valid name, on the one line
    with pytest.raises(ValueError, match=r"rollout\.task_args\.nope: not a setting of reasoning-gym's "):
        RolloutConfig(model_path="m", task="reasoning_gym:countdown", task_args={"nope": 1})
    with pytest.raises(ValueError, match=r"rollout\.task_args\.seed: set by the run"):
        RolloutConfig(model_path="m", task="reasoning_gym:countdown", task_args={"seed": 1})
    with pytest.raises(ValueError, match="max_numbers must be >= min_numbers"):
        RolloutConfig(
            model_path="m", task="reasoning_gym:countdown", task_args={"min_numbers": 5, "max_numbers": 4}
        )
    with pytest.raises(ValueError, match=r"rollout\.task_args is for reasoning_gym:<name> tasks"):
        RolloutConfig(model_path="m", task="copy", task_args={"min_numbers": 3})
    with pytest.raises(ValueError, match=r"not a built-in task; .*, or reasoning_gym:<name>"):
        RolloutConfig(model_path="m", task="gsm_symbolic")
    with pytest.raises(ValueError, match="needs a real model's tokenizer"):
        make_tiny_model(GSM, "unused")


def test_a_missing_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # As Python sees a package that is not installed: importing it raises ImportError.
    for name in [m for m in sys.modules if m == "reasoning_gym" or m.startswith("reasoning_gym.")]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ValueError, match="needs the reasoning-gym package") as missing:
        RolloutConfig(model_path="m", task="reasoning_gym:countdown")
    assert (
        str(missing.value)
        .splitlines()[1]
        .strip()
        .startswith(
            "Value error, rollout.task='reasoning_gym:countdown' needs the reasoning-gym package, which is "
            f"not installed: {INSTALL}"
        )
    )
    assert INSTALL == 'pip install "ppo-rollout[reasoning-gym]"'


CHAT = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _printable_model(folder: Path) -> Path:
    """A random tiny Llama whose character tokenizer spells English, with a chat template."""
    tokenizer = build_char_tokenizer(string.printable.replace("\x0b", "").replace("\x0c", ""))
    tokenizer.chat_template = CHAT
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.timeout(300)
def test_a_rollout_manager_step_on_gsm_symbolic(ray_session: None, tmp_path: Path) -> None:
    from ppo_rollout.manager import RolloutManager

    config = RolloutConfig(
        model_path=str(_printable_model(tmp_path / "model")),
        task=GSM,
        chat_template=True,
        max_prompt_length=900,
        prompts_per_step=2,
        sampling=SamplingSettings(max_new_tokens=4, n_samples_per_prompt=2),
        eval_prompts=2,
        seed=5,
        timeout_s=120.0,
    )
    manager = RolloutManager(config, None, dp_size=1)
    try:
        assert manager.scorer.reward_name == "reasoning_gym"
        batch = manager.generate(step=0)
        assert batch.metrics["rollout/samples"] == 4.0
        # a random model marks no answer: gsm_symbolic's scorer gives it 0
        assert batch.metrics["rollout/reward_mean"] == 0.0
        held_out = manager.evaluate(step=0)
        assert held_out["eval/samples"] == 2.0
        assert held_out["eval/accuracy"] == 0.0
    finally:
        manager.shutdown()
