"""The run configuration: one YAML file plus ``--set a.b=c`` overrides, validated once at load.

``RunConfig`` composes the packages' own settings: ``algorithm`` is ppo-trainer's ``AlgorithmConfig``,
``train`` extends ppo-trainer's ``TrainSettings`` and ``rollout`` ppo-rollout's ``RolloutSettings``
with the loop's fields; each setting is declared (default, bounds, description, the rules within its
section) once, in the package that uses it. The sections the driver alone reads (model, placement,
offload, checkpoint, logging, ray) are declared here.

Every section is frozen and forbids unknown keys, so a typo is an error that names the key (with a
"did you mean"), and no code downstream can edit the configuration in place. Rules that span sections
(a critic needs the ppo estimator, a shared critic needs offload, batch divisibility, ...) live in
``RunConfig._check_rules``: each raises a ``ValueError`` that names the field and the fix.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic.dataclasses import is_pydantic_dataclass
from pydantic.fields import FieldInfo

from ppo_lifecycle.plan import OffloadPlan
from ppo_rollout.config import RolloutSettings
from ppo_rollout.tasks import get_task
from ppo_trainer.config import AlgorithmConfig, DType, MemoryBackendName, TrainSettings

SECTION = ConfigDict(extra="forbid", validate_default=True)

# head sizes vLLM's CPU attention takes (vLLM 0.32.0, CPUAttentionBackend.get_supported_head_sizes):
# ppo_rollout.engine.vllm_server.CPU_HEAD_SIZES, not imported here (that module imports torch)
_VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class ConfigError(ValueError):
    """An invalid configuration; the message names each bad field and how to fix it."""


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, **SECTION)


class TinyModelConfig(_Section):
    """Size of the built-in tiny model (used when ``model.path`` is null)."""

    hidden_size: int = Field(default=64, ge=8, description="width of the transformer")
    num_layers: int = Field(default=2, ge=1, description="number of transformer blocks")
    num_heads: int = Field(default=4, ge=1, description="attention heads; must divide hidden_size")
    intermediate_size: int = Field(default=128, ge=8, description="MLP width")
    max_positions: int = Field(default=64, ge=8, description="longest prompt + response, in tokens")

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.tiny.hidden_size ({self.hidden_size}) must be divisible by model.tiny.num_heads "
                f"({self.num_heads}); pick a num_heads that divides it"
            )
        return self


def expand_home(value: Any) -> Any:
    """``~`` at the start of a path setting is the user's home, as in a shell (a YAML file and
    ``--set a=~/x`` do not expand it)."""
    return str(Path(value).expanduser()) if isinstance(value, str) and value.startswith("~") else value


class ModelConfig(_Section):
    path: str | None = Field(
        default=None, description="Hugging Face model folder; null: the built-in tiny model"
    )
    _home = field_validator("path", mode="before")(expand_home)
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: DType = Field(default="auto", description="compute dtype; auto: bfloat16 on cuda, float32 on cpu")


# Resources Ray defines itself, which placement.node_resources cannot name.
_RAY_OWN = ("CPU", "GPU", "memory", "object_store_memory")


class PlacementConfig(_Section):
    mode: Literal["colocate", "disaggregate"] = Field(
        default="colocate",
        description="colocate: engines share the training devices; disaggregate: own devices",
    )
    device: Literal["cpu", "cuda"] = "cpu"
    actor_gpus: int = Field(
        default=1, ge=1, description="actor data-parallel size (GPUs, or CPU workers on cpu)"
    )
    rollout_gpus: int | None = Field(
        default=None, ge=1, description="devices of all engines together; null: same as actor_gpus"
    )
    gpus_per_engine: int = Field(default=1, ge=1)
    critic: Literal["none", "shared", "dedicated"] = Field(
        default="shared", description="shared: time-shares the actor's devices; dedicated: own devices"
    )
    critic_gpus: int | None = Field(
        default=None, ge=1, description="dedicated critic only; null: same as actor"
    )
    cpus_per_bundle: float = Field(default=1.0, gt=0, description="CPUs per placement bundle on CPU runs")
    node_resources: dict[Literal["actor", "critic", "rollout"], str] = Field(
        default_factory=dict,
        description="role -> a custom resource its nodes were started with (ray start --resources "
        "'{\"train\": 1}'): the role runs only there, e.g. {actor: train, critic: train, rollout: "
        "engines}; empty: any node (docs/guide/cluster.md)",
    )

    @model_validator(mode="after")
    def _node_resources(self) -> PlacementConfig:
        for role, name in self.node_resources.items():
            if not name.strip() or name != name.strip() or name in _RAY_OWN or name.startswith("node:"):
                raise ValueError(
                    f"placement.node_resources.{role}={name!r}: name a custom resource the nodes were "
                    "started with (ray start --resources '{\"train\": 1}'), not one of Ray's own"
                )
        if "critic" in self.node_resources and self.critic == "none":
            raise ValueError("placement.node_resources.critic is set but placement.critic='none'; remove it")
        return self

    @property
    def colocate(self) -> bool:
        return self.mode == "colocate"

    @property
    def resolved_rollout_gpus(self) -> int:
        return self.actor_gpus if self.rollout_gpus is None else self.rollout_gpus

    @property
    def num_engines(self) -> int:
        return self.resolved_rollout_gpus // self.gpus_per_engine


# The packages declare their own sections (defaults, bounds, descriptions, the rules inside one section);
# the driver adds the loop's fields to them and checks the rules that span sections.


@pydantic_dataclass(frozen=True, kw_only=True, config=SECTION)
class RolloutSection(RolloutSettings):
    """The ``rollout`` section: ppo-rollout's ``RolloutSettings`` and how often the loop evaluates."""

    eval_interval: int = Field(
        default=0, ge=0, description="evaluate every N steps; 0: only at the last step"
    )
    eval_before_train: bool = Field(
        default=False,
        description="evaluate the untrained model before step 1 too (logged as step 0; not on a resume)",
    )


@pydantic_dataclass(frozen=True, kw_only=True, config=SECTION | ConfigDict(serialize_by_alias=True))
class TrainSection(TrainSettings):
    """The ``train`` section: ppo-trainer's ``TrainSettings`` and the loop's own fields."""

    steps: int = Field(default=120, ge=1)
    # ``async`` is a Python keyword: the field is ``async_`` in code, ``async`` in YAML and in dumps.
    async_: Literal["off", "one_step_off"] = Field(
        default="off",
        alias="async",
        description="one_step_off: generate step t+1's batch while step t trains (disaggregated "
        "placements; the batch is one weight version old, corrected by algorithm.tis_cap)",
    )
    seed: int = Field(default=1234, description="seeds the models, the prompts and every step's sampling")

    @field_validator("async_", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false.
        return "off" if value is False else value

    global_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="samples per step; null: rollout.prompts_per_step x n_samples_per_prompt",
    )
    num_critic_only_steps: int = Field(default=0, ge=0, description="first steps train the critic only")
    check_weights: bool = Field(
        default=False,
        description="after every weight update, compare each engine's weights checksum with the "
        "actor's and stop on a mismatch (SGLang: read back through /get_weights_by_name, "
        "rollout.sglang.check_rows; the step budget's check_weights part)",
    )


class OffloadSection(_Section):
    enabled: bool = True
    backend: MemoryBackendName = "auto"
    allow_resident_shared_critic: bool = Field(
        default=False, description="debug: keep a shared critic resident next to the actor (offload off)"
    )
    overlap: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="overlapped transitions: sleeps in the background, wakes ahead of their phase; "
        "auto: on cuda when every shared GPU keeps overlap_headroom_gb free with every role resident",
    )
    overlap_headroom_gb: float | None = Field(
        default=None,
        gt=0,
        description="offload.overlap=auto: GB each shared GPU must have free after start-up; null: half "
        "of its memory",
    )

    @field_validator("overlap", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        # YAML reads a bare on/off as a boolean: `overlap: on` means the word.
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class CheckpointSection(_Section):
    dir: str | None = Field(default=None, description="null: <run_dir>/checkpoints")
    _home = field_validator("dir", mode="before")(expand_home)
    interval: int = Field(default=60, ge=0, description="save every N steps; 0: only at the end")
    save_final: bool = True
    resume: bool = Field(default=True, description="resume from the latest complete checkpoint in dir")
    keep: int = Field(default=2, ge=1, description="complete checkpoints kept; older ones are deleted")
    accept_changes: tuple[Literal["dataset", "lr_rise", "other_run"], ...] = Field(
        default=(),
        description="what a resume takes on purpose, else refuses: dataset (the training file changed: "
        "go on from a new epoch of it), lr_rise (new train.steps or schedule raise the learning rate), "
        "other_run (the checkpoints in checkpoint.dir were written by a run in another folder)",
    )


class LoggingSection(_Section):
    run_dir: str | None = Field(default=None, description="null: runs/<date-time>; --run-dir overrides")
    _home = field_validator("run_dir", mode="before")(expand_home)
    tensorboard: bool = Field(
        default=True, description="write TensorBoard events when tensorboard is installed"
    )
    progress: bool = Field(
        default=True, description="print a line per step (rewards, accuracy, seconds) and the eval lines"
    )
    worker_logs: bool = Field(default=False, description="print the Ray workers' output in the console")
    critic_health: bool = Field(
        default=True,
        description="the critic's health metrics every step: explained variance (whole batch, per "
        "response tenth, per turn), calibration, first value vs score, advantage variance against "
        "GRPO's and RLOO's (docs/guide/algorithms.md)",
    )
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="WARNING", description="Python logging level of the driver and the libraries it uses"
    )


class RayConfig(_Section):
    address: str | None = Field(
        default=None, description="join this Ray cluster; null: start a local instance"
    )
    num_cpus: int = Field(default=4, ge=1, description="logical CPUs of the local instance")
    # Ray refuses an object store under 75 MB (ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES).
    object_store_memory_mb: int = Field(default=256, ge=75, description="the local instance's object store")
    timeout_s: float = Field(default=600.0, gt=0, description="limit on each cross-process wait")
    write_bytecode: bool = Field(
        default=True,
        description="the driver and a local instance's workers write Python's bytecode caches even where "
        "PYTHONDONTWRITEBYTECODE is set; without them every worker compiles torch and transformers from "
        "source at each start",
    )


class StartupSection(_Section):
    warm_up: bool | Literal["auto"] = Field(
        default="auto",
        description="before the first step, the built-in engines capture the decode graphs of a "
        "training step's generate and each trainer runs its train phase once on a dummy batch, undone bit "
        "for bit: the first step's one-time costs (graph captures, CUDA's first kernel loads) move into "
        "start-up, alongside the other roles' start; results are the same either way. auto: on with "
        "placement.device=cuda (on CPU a first step costs what the others do). The engines' warm-up holds "
        "their whole KV cache (samples x prompt and response tokens) while the trainers warm up: where "
        "the two do not fit on the device together, set false",
    )

    def enabled(self, device: str) -> bool:
        """Whether the run warms up on ``device`` (``placement.device``)."""
        return device == "cuda" if self.warm_up == "auto" else self.warm_up


def _section_fields(cls: Any) -> dict[str, FieldInfo]:
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return dict(cls.model_fields)
    if is_pydantic_dataclass(cls):
        return dict(cls.__pydantic_fields__)
    return {}


def _refuse_bools(cls: Any, data: Mapping[str, Any], prefix: str) -> None:
    """A YAML boolean (``true``, ``on``, ``yes``) given for a number refused: pydantic would read it as
    1 or 0 (``train.actor_lr: true`` trains at lr 1.0)."""
    fields = _section_fields(cls)
    for name, value in data.items():
        info = fields.get(name) or next((f for f in fields.values() if f.alias == name), None)
        if info is None:
            continue
        annotation = info.annotation
        choices = set(getattr(annotation, "__args__", ())) or {annotation}
        if isinstance(value, bool) and bool(choices & {int, float}) and bool not in choices:
            raise ValueError(
                f"{prefix}{name}: {str(value).lower()} is a YAML boolean, not a number; give a number"
            )
        if isinstance(value, Mapping) and _section_fields(annotation):
            _refuse_bools(annotation, value, f"{prefix}{name}.")


class RunConfig(_Section):
    model: ModelConfig = ModelConfig()
    placement: PlacementConfig = PlacementConfig()
    rollout: RolloutSection = RolloutSection()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    train: TrainSection = TrainSection()
    offload: OffloadSection = OffloadSection()
    checkpoint: CheckpointSection = CheckpointSection()
    logging: LoggingSection = LoggingSection()
    ray: RayConfig = RayConfig()
    startup: StartupSection = StartupSection()
    _offload_plan: OffloadPlan = PrivateAttr()

    @property
    def offload_plan(self) -> OffloadPlan:
        """Which roles are resident in each phase; built (and its rule checked) once, at validation."""
        return self._offload_plan

    @property
    def use_critic(self) -> bool:
        return self.placement.critic != "none"

    @property
    def samples_per_step(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.sampling.n_samples_per_prompt

    @model_validator(mode="before")
    @classmethod
    def _before(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            _refuse_bools(cls, data, "")
            rollout = data.get("rollout")
            # A dataset is enough: the task's default (copy_small) is for a config that sets neither.
            if isinstance(rollout, Mapping) and rollout.get("dataset") is not None and "task" not in rollout:
                data = {**data, "rollout": {**rollout, "task": None}}
        return data

    @model_validator(mode="after")
    def _check_rules(self) -> RunConfig:
        self._check_estimator()
        self._check_roles()
        self._check_devices()
        self._check_model()
        self._check_batches()
        return self

    def _check_estimator(self) -> None:
        """The critic and the estimator agree; one-step-off has its own engines and TIS."""
        p, a, t = self.placement, self.algorithm, self.train
        # The estimator's properties decide (ppo_trainer.estimators), never its name.
        uses_critic = a.estimator_info.uses_critic
        if self.use_critic and not uses_critic:
            raise ValueError(
                f"placement.critic={p.critic!r} needs an algorithm.estimator with a critic (ppo; got "
                f"{a.estimator!r}); set placement.critic=none for {a.estimator}, or algorithm.estimator=ppo"
            )
        if not self.use_critic and uses_critic:
            raise ValueError(
                f"algorithm.estimator={a.estimator!r} needs a critic (GAE uses its values); "
                "set placement.critic=shared or dedicated, or algorithm.estimator=grpo"
            )
        if t.async_ == "one_step_off":
            if p.colocate:
                raise ValueError(
                    "train.async='one_step_off' generates the next batch while this one trains, so the "
                    "engines need devices of their own: set placement.mode=disaggregate, or train.async=off"
                )
            if a.correction.weight == "none" and a.off_policy_returns != "vtrace":
                raise ValueError(
                    "train.async='one_step_off' trains on samples one weight version old: set "
                    "algorithm.tis_cap (truncated importance sampling, e.g. 2.0), "
                    "algorithm.rollout_correction.weight or algorithm.off_policy_returns=vtrace"
                )
        self._check_partial()

    def _check_partial(self) -> None:
        """Partial rollouts train on tokens of older weights: per-token importance weights, in the
        synchronous loop."""
        if not self.rollout.partial.enabled:
            return
        if self.train.async_ != "off":
            raise ValueError(
                "rollout.partial.enabled does not support train.async='one_step_off' yet; set "
                "train.async=off or rollout.partial.enabled=false"
            )
        if self.algorithm.correction.weight == "none" and self.algorithm.off_policy_returns != "vtrace":
            raise ValueError(
                "rollout.partial.enabled trains on tokens of older weight versions: set algorithm.tis_cap "
                "(e.g. 2.0), algorithm.rollout_correction.weight (each token's importance weight) or, with "
                "a critic, algorithm.off_policy_returns=vtrace"
            )

    def _check_roles(self) -> None:
        """The offload plan (ppo-lifecycle's rule) and what each role's settings need."""
        p, t, o = self.placement, self.train, self.offload
        # Which role is resident when: ppo-lifecycle owns that rule (a shared critic needs offload,
        # or warns once with ResidentSharedCriticWarning when allowed for debugging).
        try:
            self._offload_plan = OffloadPlan.build(
                colocate=p.colocate,
                critic=p.critic,
                offload=o.enabled,
                allow_resident_shared_critic=o.allow_resident_shared_critic,
            )
        except ValueError:
            raise ValueError(
                "placement.critic='shared' needs offload.enabled=true (actor and critic take turns on "
                "the same devices); set offload.enabled=true, or offload.allow_resident_shared_critic=true "
                "to debug with both resident"
            ) from None
        if p.critic_gpus is not None and p.critic != "dedicated":
            raise ValueError(
                f"placement.critic_gpus={p.critic_gpus} only applies to placement.critic='dedicated' "
                f"(got {p.critic!r}); remove placement.critic_gpus"
            )
        if t.lora is not None and t.lora.share_base is True and p.critic != "shared":
            raise ValueError(
                f"train.lora.share_base=true maps the actor's frozen base into the critic on the same "
                f"devices, but placement.critic={p.critic!r}; set placement.critic='shared' or "
                "train.lora.share_base='auto' or false"
            )
        if t.num_critic_only_steps:
            if not self.use_critic:
                raise ValueError(
                    "train.num_critic_only_steps needs a critic; set it to 0 or set placement.critic"
                )
            if t.num_critic_only_steps >= t.steps:
                raise ValueError(
                    f"train.num_critic_only_steps ({t.num_critic_only_steps}) must be below train.steps "
                    f"({t.steps}), or the actor never trains; lower it or raise train.steps"
                )
        if t.critic_init_from is not None and not self.use_critic:
            raise ValueError(
                "train.critic_init_from initialises the critic, and placement.critic='none'; remove it or "
                "set placement.critic"
            )

    def _check_devices(self) -> None:
        """Devices and engines."""
        p = self.placement
        if p.colocate and p.rollout_gpus is not None and p.rollout_gpus != p.actor_gpus:
            raise ValueError(
                f"placement.mode='colocate' runs the engines on the actor's devices, so "
                f"placement.rollout_gpus ({p.rollout_gpus}) must equal placement.actor_gpus "
                f"({p.actor_gpus}); remove placement.rollout_gpus or use mode=disaggregate"
            )
        if p.resolved_rollout_gpus % p.gpus_per_engine:
            raise ValueError(
                f"placement.rollout_gpus ({p.resolved_rollout_gpus}) must be divisible by "
                f"placement.gpus_per_engine ({p.gpus_per_engine})"
            )
        if p.device == "cpu" and p.gpus_per_engine != 1:
            raise ValueError("placement.gpus_per_engine must be 1 when placement.device='cpu'")

    def _check_model(self) -> None:
        """What the model (the built-in tiny one, or a folder) allows; what the engine and backend need."""
        p, r, o = self.placement, self.rollout, self.offload
        if self.model.path is None and r.task is None:
            raise ValueError(
                "model.path is null (the built-in tiny model, whose tokenizer is made for a built-in "
                "task) but rollout.task is null; set rollout.task, or model.path to a Hugging Face model"
            )
        if self.model.path is None and r.task is not None and get_task(r.task).needs_real_tokenizer:
            raise ValueError(
                f"rollout.task={r.task!r} needs a real model (its prompts are English, which the built-in "
                "tiny model's digit tokenizer cannot spell); set model.path to a model folder made by "
                "`ppo-driver import-model`, or pick a digit task (copy_small, copy, reverse)"
            )
        if self.model.path is None and r.chat_template:
            raise ValueError(
                "rollout.chat_template needs a tokenizer with a chat template, which the built-in tiny "
                "model lacks; set model.path to a chat model, or rollout.chat_template=false"
            )
        if r.engine == "sglang":
            self._check_sglang()
        if r.engine == "vllm":
            self._check_vllm()
        if o.backend in ("pinned", "torch_memory_saver") and p.device != "cuda":
            raise ValueError(
                f"offload.backend={o.backend!r} needs placement.device='cuda'; use 'host' or 'auto' on cpu"
            )
        if p.critic == "dedicated" and p.colocate:
            raise ValueError(
                "placement.critic='dedicated' with placement.mode='colocate': a colocated run shares "
                "every device; use placement.critic=shared, or placement.mode=disaggregate"
            )

    def _check_sglang(self) -> None:
        """What rollout.engine='sglang' needs: a model folder on CUDA served in a half dtype, and whole
        merged weights wherever they are read back."""
        p, t = self.placement, self.train
        adapters = t.lora is not None and t.lora.update == "adapters" and "actor" in t.lora.roles
        if t.check_weights and (adapters or p.gpus_per_engine > 1):
            raise ValueError(
                "train.check_weights reads an SGLang server's weights back (/get_weights_by_name), "
                "whole only from a server of one GPU and merged only without adapter-only updates; "
                "set train.check_weights=false, or placement.gpus_per_engine=1 and train.lora.update="
                "'merged'"
            )
        if adapters and p.colocate and p.gpus_per_engine > 1:
            raise ValueError(
                "train.lora.update='adapters' with SGLang loads the adapters over HTTP, which "
                "colocated engines of several GPUs (placement.gpus_per_engine > 1) do not take: "
                "set train.lora.update='merged' or placement.gpus_per_engine=1"
            )
        if p.device != "cuda":
            raise ValueError("rollout.engine='sglang' needs placement.device='cuda'")
        if self.model.path is None:
            raise ValueError(
                "rollout.engine='sglang' needs model.path (a Hugging Face model folder); "
                "the built-in tiny model runs on rollout.engine='builtin' only"
            )
        if self.model.dtype == "float32":
            raise ValueError(
                "rollout.engine='sglang' serves in model.dtype, and SGLang's CUDA rmsnorm takes no float32 "
                "(the server dies at start: 'failed to dispatch data type Float'); set model.dtype=auto "
                "(bfloat16 on cuda) or bfloat16"
            )

    def _check_vllm(self) -> None:
        """What rollout.engine='vllm' needs: merged updates, one GPU per engine to read weights back,
        and on CPU a head size vLLM's CPU attention takes (vllm/v1/attention/backends/cpu_attn.py)."""
        p, t = self.placement, self.train
        if t.lora is not None and t.lora.update == "adapters" and "actor" in t.lora.roles:
            raise ValueError(
                "rollout.engine='vllm' takes whole (merged) weight updates: set train.lora.update='merged'"
            )
        if t.check_weights and p.gpus_per_engine > 1:
            raise ValueError(
                "train.check_weights reads a vLLM server's weights back from one worker: set "
                "placement.gpus_per_engine=1 or train.check_weights=false"
            )
        tiny = self.model.tiny
        head = tiny.hidden_size // tiny.num_heads
        if p.device == "cpu" and self.model.path is None and head not in _VLLM_CPU_HEAD_SIZES:
            raise ValueError(
                f"rollout.engine='vllm' on CPU takes head sizes {list(_VLLM_CPU_HEAD_SIZES)}; model.tiny "
                f"gives {head} (hidden_size {tiny.hidden_size} / num_heads {tiny.num_heads}): set "
                "model.tiny.num_heads so that the quotient is one of them (e.g. 2 for hidden_size 64)"
            )

    def _check_batches(self) -> None:
        """Batch sizes: one optimizer step per rollout step, split evenly over data-parallel ranks."""
        p, a, t, r = self.placement, self.algorithm, self.train, self.rollout
        samples = self.samples_per_step
        if t.global_batch_size is not None and t.global_batch_size != samples:
            raise ValueError(
                f"train.global_batch_size ({t.global_batch_size}) must equal rollout.prompts_per_step x "
                f"rollout.sampling.n_samples_per_prompt ({r.prompts_per_step} x "
                f"{r.sampling.n_samples_per_prompt} = {samples}); remove it or change those two"
            )
        if r.prompts_per_step % p.actor_gpus:
            raise ValueError(
                f"rollout.prompts_per_step ({r.prompts_per_step}) must be divisible by placement.actor_gpus "
                f"({p.actor_gpus}): the samples of one prompt stay on one data-parallel rank"
            )
        dp_sizes = {"placement.actor_gpus": p.actor_gpus}
        if p.critic == "dedicated" and p.critic_gpus is not None:
            dp_sizes["placement.critic_gpus"] = p.critic_gpus
            if r.prompts_per_step % p.critic_gpus:
                raise ValueError(
                    f"rollout.prompts_per_step ({r.prompts_per_step}) must be divisible by "
                    f"placement.critic_gpus ({p.critic_gpus}): the samples of one prompt stay on one "
                    "data-parallel rank of the critic too"
                )
        for name, dp in dp_sizes.items():
            if samples % dp:
                raise ValueError(
                    f"the global batch ({samples} samples = rollout.prompts_per_step x "
                    f"n_samples_per_prompt) must be divisible by {name} ({dp}), the data-parallel size"
                )
            per_rank = samples // dp
            if per_rank % a.num_mini_batches:
                raise ValueError(
                    f"algorithm.num_mini_batches ({a.num_mini_batches}) must divide the samples per "
                    f"data-parallel rank ({samples} / {name} {dp} = {per_rank})"
                )
            critic_parts = a.mini_batches_for("critic")
            if self.use_critic and (
                per_rank % critic_parts
                or (t.max_tokens_per_micro_batch is None and (per_rank // critic_parts) % t.micro_batch_size)
            ):
                raise ValueError(
                    f"algorithm.critic_num_mini_batches ({critic_parts}) must divide the samples per "
                    f"data-parallel rank ({samples} / {name} {dp} = {per_rank}) into mini-batches that "
                    f"train.micro_batch_size ({t.micro_batch_size}) divides"
                )
            per_mini = per_rank // a.num_mini_batches
            # A token budget sizes the micro-batches itself; micro_batch_size is then unused.
            if t.max_tokens_per_micro_batch is None and per_mini % t.micro_batch_size:
                raise ValueError(
                    f"train.micro_batch_size ({t.micro_batch_size}) must divide the samples per "
                    f"data-parallel rank and mini-batch ({samples} / {name} {dp} / "
                    f"algorithm.num_mini_batches {a.num_mini_batches} = {per_mini})"
                )
        if a.estimator_info.groups_samples and r.sampling.n_samples_per_prompt < 2:
            raise ValueError(
                f"algorithm.estimator={a.estimator!r} compares samples of one prompt: "
                "set rollout.sampling.n_samples_per_prompt >= 2"
            )


# --- loading ----------------------------------------------------------------------------------


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"a.b=c"`` -> (["a", "b"], c) with ``c`` parsed as a YAML scalar (``1e-3``, ``true``, ``null``...)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, for example --set train.steps=10")
    parts = key.split(".")
    if any(not part for part in parts):
        raise ConfigError(f"--set {item!r}: empty name in the key {key!r}; use dotted names like a.b.c")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML ({exc})") from None
    # YAML 1.1 reads "1e-3" (no dot) as a string; on the command line it is meant as a number.
    if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
        value = float(value)
    return parts, value


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A new nested dict: ``data`` with each ``a.b=c`` applied in order (``data`` is not modified)."""
    result = _deep_copy(data)
    for item in overrides:
        parts, value = parse_override(item)
        node = result
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"--set {item!r}: {where} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return result


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass an existing YAML file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections at the top level")
    return data


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read ``path`` (or the embedded default when None), apply ``--set`` overrides, validate."""
    data = read_yaml(path) if path is not None else {}
    return validate_config(apply_overrides(data, overrides))


def validate_config(data: Mapping[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc)) from None


def format_errors(exc: ValidationError) -> str:
    lines = [f"invalid config ({exc.error_count()} error{'s' if exc.error_count() > 1 else ''}):"]
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            msg = f"unknown field {loc!r}" + _suggest(err["loc"])
        elif loc:
            msg = f"{loc}: {msg}"
            if err["type"] not in ("value_error", "assertion_error") and "input" in err:
                msg += f" (got {err['input']!r})"
        lines.append(f"  - {msg}")
    return "\n".join(lines)


def _suggest(loc: tuple[int | str, ...]) -> str:
    """'; did you mean ...' from the fields of the section that holds the unknown key."""
    fields: dict[str, FieldInfo] = dict(RunConfig.model_fields)
    for part in loc[:-1]:
        info = fields.get(str(part))
        inner = _fields(info.annotation) if info is not None else None
        if inner is None:
            return ""
        fields = inner
    names = list(fields)
    close = difflib.get_close_matches(str(loc[-1]), names, n=1)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; valid fields here: {', '.join(names)}"


def _fields(section: object) -> dict[str, FieldInfo] | None:
    """The fields of a section: a pydantic model or a pydantic dataclass; None for anything else."""
    if isinstance(section, type) and issubclass(section, BaseModel):
        return dict(section.model_fields)
    if isinstance(section, type) and is_pydantic_dataclass(section):
        return dict(section.__pydantic_fields__)
    return None


def dump_config(config: RunConfig) -> str:
    """The resolved config as YAML (every field, defaults included)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
