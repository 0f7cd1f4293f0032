"""Frozen, validated configuration for sampling and rollout.

Each setting is declared once, here, with its default, bounds and description: ``SamplingSettings``
is the run config's ``rollout.sampling`` section and ``RolloutSettings`` its ``rollout`` section (the
driver adds its own loop fields to it). ``SamplingConfig`` is one generate call (the settings and a
seed); ``RolloutConfig`` is what the manager runs (the settings and what the driver derives from the
placement: model folder, engines, device, dtype, seed, timeouts).

They are pydantic dataclasses: every field is checked on construction, an unknown keyword is an error,
and a bad value raises ``pydantic.ValidationError`` (a ``ValueError``) naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator
from pydantic.dataclasses import dataclass

__all__ = [
    "AdapterUpdates",
    "DynamicSamplingSettings",
    "MultiTurnSettings",
    "OverlongSettings",
    "PartialSettings",
    "RolloutConfig",
    "RolloutSettings",
    "SGLangOptions",
    "SamplingConfig",
    "SamplingSettings",
    "VLLMOptions",
]

# Unknown keys are errors, and defaults are validated like any input.
STRICT = ConfigDict(extra="forbid", validate_default=True)

# Declared once and shared by the run's section and one generate call, whose defaults differ.
MaxNewTokens = Annotated[int, Field(ge=1, description="response length limit, in tokens")]
SamplesPerPrompt = Annotated[int, Field(ge=1, description="samples drawn for each prompt")]


@dataclass(frozen=True, kw_only=True, config=STRICT)
class SamplingSettings:
    """How responses are sampled: the ``rollout.sampling`` section.

    ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` turn those filters off. The
    defaults are a PPO rollout's: several samples of each prompt (PPO and GRPO compare them), a few
    tokens long (the built-in tasks' answers).
    """

    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False, description="0: greedy")
    top_p: float = Field(default=1.0, gt=0, le=1, description="1: off")
    top_k: int = Field(default=0, ge=0, description="0: no top-k")
    max_new_tokens: MaxNewTokens = 4
    n_samples_per_prompt: SamplesPerPrompt = 8
    stop_token_ids: tuple[Annotated[int, Field(ge=0)], ...] = Field(
        default=(), description="in addition to the model's eos token(s)"
    )
    ignore_eos: bool = Field(
        default=False,
        description="keep sampling past the model's eos token(s) (stop_token_ids still stop): every "
        "response is max_new_tokens long, for benchmarks of a fixed response length (SGLang's ignore_eos)",
    )


@dataclass(frozen=True, kw_only=True, config=STRICT)
class SamplingConfig(SamplingSettings):
    """One generate call: the sampling settings and the seed it draws from.

    A call's defaults are one sample of up to 16 tokens (what a caller of an engine expects); the
    rollout manager builds its calls from the run's ``SamplingSettings`` with ``of``.
    """

    max_new_tokens: MaxNewTokens = 16
    n_samples_per_prompt: SamplesPerPrompt = 1
    seed: int = 0

    @classmethod
    def of(cls, settings: SamplingSettings, seed: int) -> SamplingConfig:
        """``settings`` (a ``SamplingSettings`` or a ``SamplingConfig``) drawing from ``seed``."""
        values = {name: getattr(settings, name) for name in SamplingSettings.__dataclass_fields__}
        return cls(**values, seed=seed)


@dataclass(frozen=True, kw_only=True, config=STRICT)
class SGLangOptions:
    """How the SGLang adapter launches servers. ``command`` replaces ``python -m sglang.launch_server``."""

    command: tuple[str, ...] = Field(default=(), description="replaces `python -m sglang.launch_server`")
    extra_args: tuple[str, ...] = Field(
        default=(),
        description="appended to the server's command line verbatim, e.g. [--max-running-requests, 64]",
    )
    mem_fraction_static: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description="share of each GPU the server takes for weights and KV cache; null: 0.6 when the "
        "engines share GPUs with training (room for the trainers' CUDA contexts and what they keep while "
        "asleep), SGLang's own otherwise; --mem-fraction-static in extra_args wins over both",
    )
    attention_backend: str | None = Field(
        default="triton",
        description="--attention-backend; triton runs on every GPU and in deterministic mode (which "
        "falls back to fa3 on Hopper, absent from slim installs); null: SGLang's choice",
    )
    check_rows: int | None = Field(
        default=None,
        ge=1,
        description="train.check_weights reads each tensor's first check_rows rows back from the server "
        "(JSON floats, ~17 bytes a value) and the actor hashes the same rows; null: every row",
    )
    weights_cpu_backup: bool | None = Field(
        default=None,
        description="--enable-weights-cpu-backup: a server that releases its memory keeps a host copy of "
        "its weights (SGLang 0.5.17 resumes released weights as zeros); null: on where a resume is not "
        "always followed by a whole weight update (adapter-only LoRA updates, critic-only steps)",
    )
    host: str = Field(default="127.0.0.1", description="the address the servers listen on")
    startup_timeout_s: float = Field(default=600.0, gt=0, description="limit on a server's start")
    request_timeout_s: float = Field(default=600.0, gt=0, description="limit on one request")
    stop_grace_s: float = Field(default=15.0, ge=0, description="SIGTERM to SIGKILL at shutdown")

    @field_validator("command", "extra_args", mode="before")
    @classmethod
    def _words(cls, value: object) -> object:
        # YAML reads `[--max-running-requests, 64]` with a number in it: a command line holds words.
        if isinstance(value, list | tuple):
            return tuple(
                str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v for v in value
            )
        return value


@dataclass(frozen=True, kw_only=True, config=STRICT)
class VLLMOptions:
    """How the vLLM adapter launches servers (``python -m vllm.entrypoints.openai.api_server``)."""

    python: str | None = Field(
        default=None,
        description="the Python of the environment vLLM is installed in (e.g. a venv's bin/python: vLLM "
        "pins a torch of its own); null: this process's Python",
    )
    extra_args: tuple[str, ...] = Field(
        default=(), description="appended to the server's command line verbatim, e.g. [--max-num-seqs, 64]"
    )
    kv_cache_memory_bytes: int | None = Field(
        default=None,
        ge=1 << 20,
        description="the KV cache's size (--kv-cache-memory-bytes); null: 1 GiB on CPU (vLLM's own "
        "default reserves 92% of the host's memory), vLLM's --gpu-memory-utilization share on GPUs",
    )
    eager: bool = Field(
        default=True, description="--enforce-eager: no torch.compile of the model at start (minutes on CPU)"
    )
    host: str = Field(default="127.0.0.1", description="the address the servers listen on")
    startup_timeout_s: float = Field(default=600.0, gt=0, description="limit on a server's start")
    request_timeout_s: float = Field(default=600.0, gt=0, description="limit on one request")
    stop_grace_s: float = Field(default=15.0, ge=0, description="SIGTERM to SIGKILL at shutdown")

    @field_validator("extra_args", mode="before")
    @classmethod
    def _words(cls, value: object) -> object:
        # YAML reads `[--max-num-seqs, 64]` with a number in it: a command line holds words.
        if isinstance(value, list | tuple):
            return tuple(
                str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v for v in value
            )
        return value


@dataclass(frozen=True, kw_only=True, config=STRICT)
class MultiTurnSettings:
    """Limits of a multi-turn rollout: the ``rollout.multi_turn`` section (used with an environment or
    a rollout function of your own; ``rollout.sampling.max_new_tokens`` is each turn's limit)."""

    max_turns: int = Field(default=4, ge=1, description="model turns per trajectory")
    max_response_tokens: int = Field(
        default=512,
        ge=1,
        description="every turn's tokens and every observation's together, after the prompt; a "
        "trajectory that reaches it ends with status 'length'",
    )
    max_observation_tokens: int = Field(
        default=128,
        ge=8,
        description="an observation's content beyond it is cut and ends with a '...[truncated]' marker",
    )
    truncation_marker: str = Field(
        default=" ...[truncated]", min_length=1, description="ends an observation cut to the limit"
    )
    stop: tuple[str, ...] = Field(
        default=(),
        description="stop strings ending a turn (kept in the response), e.g. ['</calc>'] for a tool call",
    )
    observation_role: str = Field(
        default="user", min_length=1, description="chat role of an observation's message (chat_template)"
    )
    score_unfinished: bool = Field(
        default=False,
        description="give the outcome reward to a trajectory that ended by max_turns or a length limit "
        "before its environment said done; false: it gave no final answer and its outcome reward is 0 "
        "(its turn rewards stay)",
    )
    env_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="bound of each environment call (making it, reset, step), and of the time an async "
        "one may hold the event loop without awaiting",
    )
    on_env_error: Literal["stop", "zero"] = Field(
        default="stop",
        description="an environment that raises, hangs or answers wrongly: stop the run (naming the row, "
        "the turn and the environment) or end that trajectory with reward 0 and status env_error (each "
        "such error is written to env_errors.log in the run folder)",
    )
    max_env_error_share: float = Field(
        default=0.5,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="with on_env_error: zero, the run stops when more than this share of a step's "
        "trajectories ended by an environment error",
    )
    rollout_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="bound of one prompt's rollout function call; null: max_turns x (ray.timeout_s + "
        "env_timeout_s) + 2 x env_timeout_s",
    )
    turn_order: Literal["fixed", "arrival"] = Field(
        default="fixed",
        description="fixed: each turn's requests go to the engines together, in the trajectories' order, "
        "so that a run with the same seed gives the same numbers (it costs the wait for a turn's slowest "
        "environment: nothing measurable with configs/cpu-guess-multiturn.yaml's instant environment, "
        "generate 35% of the step either way); arrival: a request goes out as soon as its environment "
        "answers (faster when environments take varying time, but it trades repeatability: the batches, "
        "and so the samples, depend on timing)",
    )


@dataclass(frozen=True, kw_only=True, config=STRICT)
class OverlongSettings:
    """DAPO's soft overlong punishment: the ``rollout.overlong`` section (``ppo_rollout.overlong``).

    A trajectory's outcome reward gets ``reward_shaping.overlong_penalty`` of its generated tokens
    (observation tokens do not count), with ``max_len`` the rollout's ``train_response_limit``; its
    raw ``score`` is kept. ``buffer_len`` or ``penalty_factor`` 0 turns it off."""

    buffer_len: int = Field(
        default=0, ge=0, description="tokens before the response limit over which the penalty grows; 0: off"
    )
    penalty_factor: float = Field(
        default=1.0, ge=0, allow_inf_nan=False, description="the penalty at the response limit; 0: off"
    )

    @property
    def active(self) -> bool:
        return self.buffer_len > 0 and self.penalty_factor > 0


@dataclass(frozen=True, kw_only=True, config=STRICT)
class DynamicSamplingSettings:
    """DAPO's dynamic sampling: the ``rollout.dynamic_sampling`` section (``ppo_rollout.dynamic_sampling``).

    Groups whose raw scores (``Trajectory.score`` plus the environment's turn rewards, never the
    shaped reward) have a population std ``<= std_tolerance`` are dropped; more prompts are drawn
    and rolled out until ``prompts_per_step`` groups are kept, in at most ``max_rounds`` rounds."""

    enabled: bool = Field(default=False, description="drop groups whose raw scores do not vary, refill")
    std_tolerance: float = Field(
        default=1e-6,
        ge=0,
        allow_inf_nan=False,
        description="a group whose raw-score std is <= it is dropped (a tolerance: float32 scores of a "
        "constant group need not be exactly equal)",
    )
    max_rounds: int = Field(default=8, ge=1, description="generation rounds per step at most")
    over_sample: float = Field(
        default=1.0,
        ge=1,
        le=64,
        allow_inf_nan=False,
        description="each round draws ceil(over_sample x the groups still missing) prompts (at most 64: "
        "more only holds more prompts in memory)",
    )
    on_exhausted: Literal["stop", "pad"] = Field(
        default="stop",
        description="after max_rounds with too few kept groups: stop the run, or fill the batch with "
        "dropped (zero-variance) groups, first generated first",
    )


@dataclass(frozen=True, kw_only=True, config=STRICT)
class PartialSettings:
    """Partial rollouts: the ``rollout.partial`` section (``ppo_rollout.partial``).

    A step's generation ends once its budget is reached; the samples still running pause with their
    tokens, log-probs and weight versions, and continue at the next step under the new weights, first
    in line. A prompt's group trains once every one of its samples has finished."""

    enabled: bool = Field(default=False, description="end generation at the budget, continue the rest later")
    finish_fraction: float | None = Field(
        default=0.75,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="generation ends once this share of the step's samples has finished; null: off",
    )
    token_budget: int | None = Field(
        default=None,
        ge=1,
        description="or once the step has generated this many tokens, whichever comes first; null: off",
    )
    max_staleness: int = Field(
        default=2,
        ge=1,
        description="the most weight versions a trained token may be behind the weights it trains with; "
        "a sample that would be older is dropped or restarted (on_stale)",
    )
    on_stale: Literal["drop", "restart"] = Field(
        default="restart",
        description="a sample past max_staleness: drop its prompt's group, or restart the sample from its "
        "prompt under the current weights",
    )
    chunk_tokens: int = Field(
        default=256,
        ge=1,
        description="sglang and vllm engines: the tokens each sample generates between two checks of the "
        "budget (one generate request per chunk); the built-in engine checks at its own decode steps",
    )

    def __post_init__(self) -> None:
        if self.finish_fraction is None and self.token_budget is None:
            raise ValueError(
                "rollout.partial needs a budget: set rollout.partial.finish_fraction (a share of the "
                "step's samples) or rollout.partial.token_budget (tokens)"
            )


@dataclass(frozen=True, kw_only=True, config=STRICT)
class RolloutSettings:
    """What to generate and how to score it: the ``rollout`` section. Exactly one of ``task`` and
    ``dataset`` is set."""

    engine: Literal["builtin", "sglang", "vllm"] = Field(
        default="builtin", description="builtin, sglang (GPUs) or vllm (its own install, CPU or GPUs)"
    )
    task: str | None = Field(
        default="copy_small",
        description="built-in task name, or reasoning_gym:NAME (one of reasoning-gym's generators, "
        'e.g. reasoning_gym:gsm_symbolic; pip install "ppo-rollout[reasoning-gym]"); null when dataset '
        "is set",
    )
    task_args: dict[str, Any] = Field(
        default_factory=dict,
        description="reasoning_gym tasks only: settings of the generator (the fields of its config "
        "class, e.g. {min_numbers: 3, max_numbers: 4} for reasoning_gym:countdown); seed and size are "
        "set by the run",
    )
    dataset: str | None = Field(default=None, description="JSONL file of prompts (instead of task)")
    prompt_field: str = "prompt"
    reward: str | None = Field(
        default=None, description="reward name or 'module:function'; null: the task's own"
    )
    # 32 x 8 samples a step: the default run learns its task in 60 steps (8 prompts reached 0.34).
    prompts_per_step: int = Field(default=32, ge=1)
    sampling: SamplingSettings = SamplingSettings()
    # 64: with 16 each prompt is 1/16 of the greedy score, too coarse to tell a learnt task from luck
    eval_prompts: int = Field(
        default=64, ge=0, description="prompts of each evaluation (greedy, then the training sampling)"
    )
    eval_dataset: str | None = Field(
        default=None,
        description="JSONL file of held-out prompts to evaluate on (never trained on); null: the task's "
        "held-out stream, or the training file's first rows",
    )
    max_prompt_length: int = Field(default=256, ge=2, description="in tokens, including <bos>")
    chat_template: bool = Field(
        default=False,
        description="render each prompt with the tokenizer's chat template: the prompt field's list of "
        "messages, or its string as one user turn, with the generation prompt",
    )
    system_prompt: str | None = Field(
        default=None, description="chat_template only: a system message put before each chat"
    )
    rollout_function: str | None = Field(
        default=None,
        description="how one prompt's samples are rolled out: 'single_turn', 'multi_turn' (with "
        "rollout.environment) or 'package.module:function'; null: multi_turn with an environment, "
        "else single_turn",
    )
    environment: str | None = Field(
        default=None,
        description="multi-turn environment: a built-in name ('calculator', 'guess_number', "
        "'bfcl_multi_turn') or "
        "'package.module:factory'; null: the task's own, if any",
    )
    environment_args: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the environment's factory"
    )
    multi_turn: MultiTurnSettings = MultiTurnSettings()
    eval_sampling: SamplingSettings | None = Field(
        default=None, description="how evaluations sample; null: greedy with sampling.max_new_tokens"
    )
    sglang: SGLangOptions = Field(
        default=SGLangOptions(), description="how the servers of engine 'sglang' are launched"
    )
    vllm: VLLMOptions = Field(
        default=VLLMOptions(), description="how the servers of engine 'vllm' are launched"
    )
    reward_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="limit on one call of the reward function; past it the run stops naming the reward",
    )
    overlong: OverlongSettings | None = Field(
        default=None, description="DAPO's overlong reward shaping of training responses; null: off"
    )
    dynamic_sampling: DynamicSamplingSettings = Field(
        default=DynamicSamplingSettings(),
        description="DAPO's dynamic sampling: train only on groups whose raw scores vary",
    )
    partial: PartialSettings = Field(
        default=PartialSettings(),
        description="partial rollouts: a step trains on what finished by its budget; the rest continues",
    )

    @field_validator("dataset", "eval_dataset", mode="before")
    @classmethod
    def _home(cls, value: object) -> object:
        # ``~`` is the user's home, as in a shell: YAML and ``--set`` do not expand it.
        return str(Path(value).expanduser()) if isinstance(value, str) and value.startswith("~") else value

    def __post_init__(self) -> None:
        if (self.task is None) == (self.dataset is None):
            raise ValueError(
                "set exactly one of rollout.task (a built-in task name) and rollout.dataset (a JSONL "
                f"path); got task={self.task!r}, dataset={self.dataset!r}"
            )
        self._check_task()
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError(
                "rollout.system_prompt needs rollout.chat_template=true (the system message is part of "
                "the chat); set chat_template=true or remove system_prompt"
            )
        self._check_multi_turn()
        self._check_shaping()
        self._check_partial()

    def _check_partial(self) -> None:
        if not self.partial.enabled:
            return
        if self.dynamic_sampling.enabled:
            raise ValueError(
                "rollout.partial.enabled does not support rollout.dynamic_sampling.enabled yet; turn one "
                "of them off"
            )

    def _check_task(self) -> None:
        from .reasoning_gym_task import check_task, is_reasoning_gym
        from .tasks import TASKS  # the task table lives with the tasks

        if is_reasoning_gym(self.task):
            check_task(str(self.task), self.task_args)  # imports reasoning-gym
            return
        if self.task is not None and self.task not in TASKS:
            raise ValueError(
                f"rollout.task={self.task!r} is not a built-in task; use one of {sorted(TASKS)}, or "
                "reasoning_gym:<name>"
            )
        if self.task_args:
            raise ValueError(
                f"rollout.task_args is for reasoning_gym:<name> tasks, not rollout.task={self.task!r}; "
                "remove it"
            )

    def _check_shaping(self) -> None:
        if self.overlong is not None and self.overlong.buffer_len > self.train_response_limit:
            raise ValueError(
                f"rollout.overlong.buffer_len={self.overlong.buffer_len} exceeds the response limit "
                f"{self.train_response_limit} (rollout.sampling.max_new_tokens; "
                "rollout.multi_turn.max_response_tokens when multi-turn); make it at most that"
            )
        if self.dynamic_sampling.enabled and self.sampling.n_samples_per_prompt < 2:
            raise ValueError(
                "rollout.dynamic_sampling.enabled needs rollout.sampling.n_samples_per_prompt >= 2 (a group "
                "of one sample never varies); raise n_samples_per_prompt or disable dynamic sampling"
            )

    def _check_multi_turn(self) -> None:
        function, environment = self.resolved_rollout_function, self.resolved_environment
        if function == "multi_turn" and environment is None:
            raise ValueError(
                "rollout.rollout_function='multi_turn' needs rollout.environment (a built-in name such as "
                "'calculator', or 'package.module:factory')"
            )
        if function == "single_turn" and self.environment is not None:
            raise ValueError(
                f"rollout.environment={self.environment!r} is never called by rollout.rollout_function="
                "'single_turn'; set rollout.rollout_function=multi_turn (or null) or remove the environment"
            )
        if any(not stop for stop in self.multi_turn.stop):
            raise ValueError(
                "rollout.multi_turn.stop holds an empty string, which would end every turn at once"
            )

    @property
    def resolved_environment(self) -> str | None:
        """``environment``, else the task's own environment (``None`` for a single-turn task)."""
        if self.environment is not None or self.task is None:
            return self.environment
        from .tasks import get_task

        return get_task(self.task).environment

    @property
    def resolved_rollout_function(self) -> str:
        """``rollout_function``, else ``multi_turn`` with an environment and ``single_turn`` without."""
        if self.rollout_function is not None:
            return self.rollout_function
        return "multi_turn" if self.resolved_environment is not None else "single_turn"

    @property
    def train_response_limit(self) -> int:
        """The most tokens a training response may hold: ``multi_turn.max_response_tokens`` for a
        multi-turn rollout, else ``sampling.max_new_tokens``."""
        if self.resolved_rollout_function != "single_turn":
            return self.multi_turn.max_response_tokens
        return self.sampling.max_new_tokens

    @property
    def longest_response(self) -> int:
        """The most tokens a response may hold: ``multi_turn.max_response_tokens`` for a multi-turn
        rollout, else the longest ``max_new_tokens`` of training and evaluation."""
        if self.resolved_rollout_function != "single_turn":
            return self.multi_turn.max_response_tokens
        evaluation = self.eval_sampling.max_new_tokens if self.eval_sampling is not None else 0
        return max(self.sampling.max_new_tokens, evaluation)


@dataclass(frozen=True, kw_only=True, config=STRICT)
class AdapterUpdates:
    """LoRA adapters the engines take in a weight update instead of merged weights: ``train.lora``'s
    ``rank``, ``alpha`` and ``target_modules`` (each adapted weight is ``base + alpha / rank * B A``: the
    built-in engine merges it; an SGLang server, launched with ``--enable-lora``, runs the adapter)."""

    rank: int = Field(ge=1, description="the adapters' rank r")
    alpha: float = Field(gt=0, description="the update is scaled by alpha / rank")
    target_modules: tuple[str, ...] = Field(
        default=(),
        description="the adapted linear layers' names (SGLang's --lora-target-modules); empty: all",
    )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True, kw_only=True, config=STRICT)
class RolloutConfig(RolloutSettings):
    """What the rollout manager runs: the ``RolloutSettings`` plus where and how the engines run.

    ``seed`` seeds the prompt order, every step's sampling (a fixed function of seed, step and engine)
    and the SGLang servers; ``eval_sampling`` None is greedy with the training ``max_new_tokens``.
    """

    model_path: str
    num_engines: int = Field(default=1, ge=1)
    gpus_per_engine: int = Field(default=0, ge=0, description="0 on CPU runs")
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    seed: int = 0
    timeout_s: float = Field(default=600.0, gt=0, description="any single wait on an engine")
    lora: AdapterUpdates | None = Field(
        default=None, description="the engines take LoRA adapters in weight updates (None: merged)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.engine == "sglang" and self.gpus_per_engine < 1:
            raise ValueError(
                "rollout.gpus_per_engine must be >= 1 with engine 'sglang' (SGLang serves on GPUs)"
            )
        if self.device == "cuda" and self.gpus_per_engine < 1:
            raise ValueError("rollout.gpus_per_engine must be >= 1 with device 'cuda'")
        if self.engine == "builtin" and self.gpus_per_engine > 1:
            raise ValueError("the built-in engine runs on one device: set rollout.gpus_per_engine to 0 or 1")
        if self.engine == "vllm" and self.lora is not None:
            raise ValueError(
                "rollout.engine='vllm' takes merged weight updates only: set train.lora.update='merged'"
            )
        if self.dataset is not None and not Path(self.dataset).is_file():
            raise ValueError(f"rollout.dataset: no file at {self.dataset!r}; give a JSONL file path")
        if self.eval_dataset is not None and not Path(self.eval_dataset).is_file():
            raise ValueError(
                f"rollout.eval_dataset: no file at {self.eval_dataset!r}; give a JSONL file path"
            )
