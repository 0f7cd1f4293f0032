"""Invalid configs: each is rejected by `ppo-driver train` before anything starts, naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import ray
from conftest import run_cli

from ppo_driver.cli import main

# A dataset run over an existing model folder ({tmp}: the test's folder, see _args).
DATASET = ["rollout.task=null", "model.path={tmp}/model", "rollout.reward=exact_match"]

# (case id, YAML file content or None, --set overrides, text the error must contain)
BAD: list[tuple[str, str | None, list[str], str]] = [
    ("critic needs ppo", None, ["algorithm.estimator=grpo"], "algorithm.estimator"),
    ("ppo needs a critic", None, ["placement.critic=none"], "algorithm.estimator='ppo' needs a critic"),
    ("shared critic needs offload", None, ["offload.enabled=false"], "offload.allow_resident_shared_critic"),
    ("one-step-off colocated", None, ["train.async=one_step_off", "algorithm.tis_cap=2"], "disaggregate"),
    (
        "critic size splits a prompt",
        None,
        [
            "placement.mode=disaggregate",
            "placement.critic=dedicated",
            "placement.critic_gpus=3",
            "rollout.prompts_per_step=4",
            "rollout.sampling.n_samples_per_prompt=3",
            "algorithm.num_mini_batches=1",
            "train.micro_batch_size=1",
        ],
        "placement.critic_gpus",
    ),
    ("micro-batch divides per-rank batch", None, ["train.micro_batch_size=7"], "train.micro_batch_size"),
    ("batch divisible by dp", None, ["placement.actor_gpus=3"], "placement.actor_gpus"),
    ("global batch matches rollout", None, ["train.global_batch_size=12"], "train.global_batch_size"),
    ("unknown field", None, ["train.learning_rate=0.1"], "unknown field 'train.learning_rate'"),
    ("wrong type", None, ["train.steps=many"], "train.steps"),
    ("out of range", None, ["algorithm.gamma=1.5"], "algorithm.gamma"),
    (
        "grpo whitened twice",
        None,
        ["algorithm.estimator=grpo", "placement.critic=none", "algorithm.normalize_advantages=true"],
        "algorithm.normalize_advantages=true with algorithm.estimator='grpo'",
    ),
    (
        "grpo std switch under ppo",
        None,
        ["algorithm.norm_adv_by_std_in_grpo=false"],
        "algorithm.estimator='grpo'",
    ),
    (
        "vtrace needs a critic",
        None,
        ["algorithm.estimator=grpo", "placement.critic=none", "algorithm.off_policy_returns=vtrace"],
        "algorithm.off_policy_returns='vtrace' corrects a critic's returns and algorithm.estimator='grpo' "
        "has no critic; set algorithm.off_policy_returns=none",
    ),
    ("unknown enum", None, ["placement.mode=spread"], "placement.mode"),
    ("sglang on cpu", None, ["rollout.engine=sglang"], "rollout.engine"),
    ("cuda backend on cpu", None, ["offload.backend=torch_memory_saver"], "offload.backend"),
    ("task and dataset", "rollout:\n  task: copy\n  dataset: p.jsonl\n", [], "rollout.task"),
    ("unknown section in file", "trainer:\n  steps: 3\n", [], "unknown field 'trainer'"),
    (
        "warm-up longer than run",
        None,
        ["train.steps=3", "train.num_critic_only_steps=3"],
        "train.num_critic_only_steps",
    ),
    ("colocate with other rollout size", None, ["placement.rollout_gpus=2"], "placement.rollout_gpus"),
    ("unknown task", None, ["rollout.task=sudoku"], "rollout.task"),
    (
        "unknown reasoning-gym generator",
        None,
        ["rollout.task=reasoning_gym:gsm_symbolc"],
        "rollout.task='reasoning_gym:gsm_symbolc': reasoning-gym has no generator 'gsm_symbolc' (did you "
        "mean gsm_symbolic?)",
    ),
    (
        "reasoning-gym setting unknown",
        None,
        ["rollout.task=reasoning_gym:countdown", "rollout.task_args={min_number: 3}"],
        "rollout.task_args.min_number: not a setting of reasoning-gym's countdown",
    ),
    ("bad --set syntax", None, ["train.steps"], "--set 'train.steps'"),
    # Pre-flight: what only the run used to find out, after Ray had started.
    ("reward module does not import", None, ["rollout.reward=no_such_mod_x:score"], "does not import"),
    ("reward function missing", None, ["rollout.reward=json:no_such_fn"], "has no 'no_such_fn'"),
    ("reward name unknown", None, ["rollout.reward=bleu"], "not a registered reward"),
    ("model path missing", None, ["model.path=/no/such/model"], "model.path='/no/such/model' does not exist"),
    ("dataset missing", None, [*DATASET, "rollout.dataset={tmp}/none.jsonl"], "does not exist"),
    ("dataset empty", None, [*DATASET, "rollout.dataset={tmp}/empty.jsonl"], "is empty"),
    ("dataset line not JSON", None, [*DATASET, "rollout.dataset={tmp}/bad.jsonl"], "bad.jsonl:2: not JSON"),
    ("duplicate section", "train:\n  steps: 3\ntrain:\n  seed: 1\n", [], "duplicate key 'train'"),
    # What only the run found, after Ray had started (or what Ray waited minutes for).
    (
        "model weights cut short",
        None,
        ["model.path={tmp}/cut"],
        "model.safetensors is truncated or damaged (",
    ),
    ("model config not JSON", None, ["model.path={tmp}/badjson"], "config.json is not valid JSON"),
    ("model without tokenizer", None, ["model.path={tmp}/notok"], "the folder has no tokenizer"),
    ("local model path missing", None, ["model.path={tmp}/models/x"], "`ppo-driver import-model SRC "),
    ("ray address closed", None, ["ray.address=127.0.0.1:1"], "nothing answers at 127.0.0.1:1"),
    (
        "object store under ray's floor",
        None,
        ["ray.object_store_memory_mb=64"],
        "greater than or equal to 75",
    ),
    (
        "more GPUs than the machine has",
        None,
        [
            "placement.device=cuda",
            "placement.actor_gpus=64",
            "rollout.prompts_per_step=64",
            "train.micro_batch_size=2",
        ],
        "placement needs 64 GPUs but ",
    ),
    (
        "eval file missing",
        None,
        [*DATASET, "rollout.dataset={tmp}/ok.jsonl", "rollout.eval_dataset={tmp}/no.jsonl"],
        "rollout.eval_dataset=",
    ),
]


def _model_folders(tmp_path: Path) -> None:
    """Damaged copies of a model folder: weights cut short, config not JSON, tokenizer missing."""
    from ppo_rollout.tasks import make_tiny_model

    whole = make_tiny_model("copy", tmp_path / "whole", seed=0)
    for name in ("cut", "badjson", "notok"):
        shutil.copytree(whole, tmp_path / name)
    weights = tmp_path / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    (tmp_path / "badjson" / "config.json").write_text('{"hidden_size": 64,')
    (tmp_path / "notok" / "tokenizer.json").unlink()


def _args(tmp_path: Path, text: str | None, overrides: list[str]) -> list[str]:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    (tmp_path / "ok.jsonl").write_text('{"prompt": "1", "label": "1"}\n')
    if any("model.path={tmp}/" in o and "/model" not in o and "/models/" not in o for o in overrides):
        _model_folders(tmp_path)
    args = ["train", "--run-dir", str(tmp_path / "run")]
    if text is not None:
        (tmp_path / "config.yaml").write_text(text)
        args += ["--config", str(tmp_path / "config.yaml")]
    for item in overrides:
        args += ["--set", item.replace("{tmp}", str(tmp_path))]
    return args


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("case", "text", "overrides", "expected"), BAD, ids=[b[0] for b in BAD])
def test_bad_config_is_rejected_before_start(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
    text: str | None,
    overrides: list[str],
    expected: str,
) -> None:
    code = main(_args(tmp_path, text, overrides))
    out, err = capsys.readouterr()
    assert code == 2, (case, out, err)
    assert expected in err, (case, err)
    # Nothing started: no run folder, no Ray session.
    assert not (tmp_path / "run").exists()
    assert not ray.is_initialized()


@pytest.mark.timeout(120)
# a rule of the config; pre-flight checks (a dataset's line, a damaged model folder)
@pytest.mark.parametrize(
    "index",
    [3, *(i for i, b in enumerate(BAD) if b[0] in ("dataset line not JSON", "model weights cut short"))],
)
def test_validate_rejects_what_train_rejects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], index: int
) -> None:
    case, text, overrides, expected = BAD[index]
    args = _args(tmp_path, text if text is not None else "{}\n", overrides)
    sets = [a for a in args if a.startswith("--set") or "=" in a]
    code = main(["validate", str(tmp_path / "config.yaml"), *sets])
    _, err = capsys.readouterr()
    assert code == 2, (case, err)
    assert expected in err


@pytest.mark.timeout(120)
def test_console_script_rejects_with_exit_2(tmp_path: Path) -> None:
    """The same path through the installed command, as a user meets it."""
    case, text, overrides, expected = BAD[3]
    done = run_cli(*_args(tmp_path, text, overrides), cwd=tmp_path, timeout=100)
    assert done.returncode == 2, (case, done.stdout, done.stderr)
    assert expected in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ppo_rollout.tasks import make_tiny_model

    return make_tiny_model("copy", tmp_path_factory.mktemp("tiny") / "model", seed=0)


# Rows only the whole dataset shows to be bad (the tiny model's tokenizer: one token per character plus
# <bos>; 64 positions; max_new_tokens 4). The third field: found before Ray and the run folder (the
# file's rows read), else by the tokenizing check that runs while Ray and the roles start
# (``preflight.DatasetCheck``), which stops the run before its first step.
DATASET_ROWS = [
    ("bad JSON past the first lines", {9: '{"prompt": "12",'}, "d.jsonl:9: not JSON", True),
    (
        "prompt over max_prompt_length",
        {7: json.dumps({"prompt": "1" * 300, "label": "1"})},
        "d.jsonl:7: prompt '1111",
        False,
    ),
    (
        "prompt past the model's positions",
        {12: json.dumps({"prompt": "1" * 62, "label": "1"})},
        "d.jsonl:12: the prompt is 63 tokens; with max_new_tokens 4 that is more than the model's "
        "max_position_embeddings 64",
        False,
    ),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("case", "bad", "expected", "before_ray"), DATASET_ROWS, ids=[d[0] for d in DATASET_ROWS]
)
def test_a_bad_dataset_row_is_named_before_the_first_step(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    tiny_model: Path,
    case: str,
    bad: dict[int, str],
    expected: str,
    before_ray: bool,
) -> None:
    lines = [json.dumps({"prompt": "12", "label": "12"}) for _ in range(20)]
    for number, text in bad.items():
        lines[number - 1] = text
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    sets = [
        "rollout.task=null",
        f"model.path={tiny_model}",
        "rollout.reward=exact_match",
        f"rollout.dataset={tmp_path / 'd.jsonl'}",
    ]
    code = main(["train", "--run-dir", str(tmp_path / "run"), *[a for s in sets for a in ("--set", s)]])
    out, err = capsys.readouterr()
    assert code == 2, (case, out, err)
    assert expected in err, (case, err)
    assert "Traceback" not in err
    assert (tmp_path / "run").exists() != before_ray
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step ran
    assert not ray.is_initialized()


def test_table_is_large_enough() -> None:
    assert len(BAD) >= 10


# --- a chat dataset, through the command line -------------------------------------------------------

CHAT = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template in its tokenizer."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(tiny_model, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT
    tokenizer.save_pretrained(folder)
    return folder


def _chat_sets(model: Path, data: Path) -> list[str]:
    rows = [{"prompt": [{"role": "user", "content": f"{i}{i}"}], "label": f"{i}{i}"} for i in range(16)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [
        "rollout.task=null",
        f"model.path={model}",
        "rollout.reward=exact_match",
        f"rollout.dataset={data}",
        "rollout.chat_template=true",
        "rollout.prompts_per_step=4",
        "rollout.eval_prompts=4",
        "train.micro_batch_size=1",
        "train.steps=2",
    ]
    return [a for s in sets for a in ("--set", s)]


@pytest.mark.timeout(120)
def test_validate_takes_a_chat_dataset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], chat_model: Path
) -> None:
    (tmp_path / "c.yaml").write_text("{}\n")
    code = main(["validate", str(tmp_path / "c.yaml"), *_chat_sets(chat_model, tmp_path / "chat.jsonl")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "dataset: 16 prompts" in out


@pytest.mark.timeout(400)
def test_train_takes_a_chat_dataset(tmp_path: Path, chat_model: Path) -> None:
    """The run's reader and pre-flight's agree: a list of {role, content} messages trains (GRPO, without
    a critic: a role process fewer to start, and the critic reads no prompts)."""
    done = run_cli(
        "train",
        "--run-dir",
        str(tmp_path / "run"),
        *_chat_sets(chat_model, tmp_path / "chat.jsonl"),
        *("--set", "placement.critic=none", "--set", "algorithm.estimator=grpo"),
        cwd=tmp_path,
        timeout=380,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert "A worker died" not in done.stdout + done.stderr


# --- a resume that would mix data, refused before Ray --------------------------------------------


@pytest.mark.timeout(120)
def test_a_changed_dataset_is_refused_on_resume_before_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_model: Path
) -> None:
    from ppo_driver.config import load_config
    from ppo_rollout.data import JsonlPrompts

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": str(i), "label": str(i)}) + "\n" for i in range(128)))
    sets = [
        "rollout.task=null",
        f"model.path={tiny_model}",
        "rollout.reward=exact_match",
        f"rollout.dataset={data}",
    ]
    source = JsonlPrompts(data, "prompt", 1234)
    source.next_rows(96)
    step = tmp_path / "run" / "checkpoints" / "step_000003"
    step.mkdir(parents=True)
    extra = {
        "config": load_config(None, sets).model_dump(mode="json"),
        "run_dir": str((tmp_path / "run").resolve()),
    }
    doc = {
        "format": 1,
        "step": 3,
        "rollout": {"version": 1, "data": source.state_dict()},
        "rng": {},
        "extra": extra,
    }
    (step / "driver.json").write_text(json.dumps(doc))
    (step / "COMPLETE").write_text("")
    data.write_text("".join(json.dumps({"prompt": str(i), "label": str(i)}) + "\n" for i in range(64)))
    code = main(["train", "--run-dir", str(tmp_path / "run"), *[a for s in sets for a in ("--set", s)]])
    _, err = capsys.readouterr()
    assert code == 2, err
    assert "the file changed since the checkpoint (128 rows" in err
    assert "64 rows" in err
    assert "checkpoint.accept_changes=[dataset]" in err
    assert not ray.is_initialized()
    assert not (tmp_path / "run" / "config.yaml").exists()  # nothing of the run was started
