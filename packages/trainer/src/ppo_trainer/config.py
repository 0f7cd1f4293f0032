"""Frozen, validated configuration of the PPO algorithm and of one training role.

Each setting is declared once, here, with its default, its bounds and its description:
``AlgorithmConfig`` is the run config's ``algorithm`` section as it stands, and ``TrainSettings`` holds
the ``train`` section's fields that the trainer uses (the driver adds the loop's own fields to it).
``TrainerConfig`` is what one role's workers run: those settings plus what the driver derives from the
placement (role, model folder, device, memory backend, weight update group).

They are pydantic dataclasses: every field is checked on construction, an unknown keyword is an error,
and a bad value raises ``pydantic.ValidationError`` (a ``ValueError``) naming the field and the fix.
Nothing mutates them afterwards: derive a variant with ``dataclasses.replace`` (the driver makes the
critic's config that way, with its role), which validates again.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Annotated, Literal

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

import ppo_trainer.estimators as estimators
from ppo_trainer.algorithm_types import (
    CorrectionLevel,
    GaeUnit,
    KLEstimator,
    LossAggregation,
    OffPolicyReturns,
    WeightBound,
)

Role = Literal["actor", "critic"]
Device = Literal["cpu", "cuda"]
DType = Literal["auto", "float32", "bfloat16"]
MemoryBackendName = Literal["auto", "host", "pinned", "torch_memory_saver"]
DataParallelKind = Literal["auto", "replicate", "fsdp2"]
WeightSyncBackend = Literal["gloo", "nccl"]
WeightSyncDType = Literal["float32", "bfloat16", "float16"]
Backend = Literal["torch", "megatron"]
PackedAttention = Literal["varlen", "sdpa", "flex_attention"]
LrSchedule = Literal["constant", "cosine"]

# Shared by every config of this package (and the ones that extend them): unknown keys are errors,
# and defaults are validated like any input.
STRICT = ConfigDict(extra="forbid", validate_default=True)

# ``data_parallel="auto"`` shards when the replicated training state takes more than this share of a
# GPU: the other role and the engines share the device, and a model this large leaves them little.
AUTO_SHARD_FRACTION = 0.25


def megatron_installed() -> bool:
    """Whether megatron-core can be imported (found without importing it, nor torch)."""
    if importlib.util.find_spec("megatron") is None:
        return False
    return importlib.util.find_spec("megatron.core") is not None


@dataclass(frozen=True, kw_only=True, config=STRICT)
class RolloutCorrection:
    """``algorithm.rollout_correction``: importance weights and rejection for the gap between the
    engine's log-probs (``pi_rollout``, which drew the tokens) and the trainer's (``pi_old``).

    With ``log rho_t = log pi_old - log pi_rollout`` on the generated tokens of a sample, a *level* turns
    them into a ratio: ``token`` ``rho_t``; ``sequence`` ``exp(sum_t log rho_t)`` (the product);
    ``geometric`` ``exp(mean_t log rho_t)``; a sequence-wide ratio applies to all its tokens.
    ``weight`` multiplies each token's policy loss by that ratio, bounded by ``weight_bound``; ``reject``
    drops the tokens (or whole samples) whose ratio leaves ``[reject_lower, reject_upper]`` from the
    loss and its token count. IcePop is ``weight: token, weight_bound: none, reject: token``.
    """

    weight: CorrectionLevel = Field(default="none", description="level of the importance weight; none: off")
    weight_bound: WeightBound = Field(
        default="truncate",
        description="truncate: min(ratio, weight_upper) (TIS); clip: clamp(ratio, weight_lower, "
        "weight_upper); none: the ratio as it is (IcePop, with reject)",
    )
    weight_upper: float = Field(default=2.0, gt=0, description="truncate/clip: the weight's upper bound")
    weight_lower: float | None = Field(
        default=None, gt=0, description="clip: the weight's lower bound; null: 1 / weight_upper"
    )
    reject: CorrectionLevel = Field(
        default="none",
        description="level of the rejection (masked importance sampling): tokens, or whole samples, whose "
        "ratio is outside [reject_lower, reject_upper] leave the loss; none: off",
    )
    reject_upper: float = Field(default=2.0, gt=0, description="rejection band's upper bound")
    reject_lower: float | None = Field(
        default=None, gt=0, description="rejection band's lower bound; null: 1 / reject_upper"
    )

    def __post_init__(self) -> None:
        if self.weight_lower is not None and self.weight_bound != "clip":
            raise ValueError(
                f"algorithm.rollout_correction.weight_lower={self.weight_lower} only applies to "
                f"weight_bound='clip' (got {self.weight_bound!r}); remove weight_lower or set that bound"
            )
        if self.weight_bound == "clip" and not self.lower_weight < self.weight_upper:
            raise ValueError(
                f"algorithm.rollout_correction.weight_lower ({self.lower_weight}) must be below "
                f"weight_upper ({self.weight_upper})"
            )
        if not self.lower_reject < self.reject_upper:
            raise ValueError(
                f"algorithm.rollout_correction.reject_lower ({self.lower_reject}) must be below "
                f"reject_upper ({self.reject_upper})"
            )
        if self.weight == "none" and self.weight_bound == "none":
            raise ValueError(
                "algorithm.rollout_correction.weight_bound='none' bounds no weight with weight='none'; "
                "set rollout_correction.weight (e.g. 'token') or leave weight_bound at its default"
            )

    @property
    def lower_weight(self) -> float:
        return 1.0 / self.weight_upper if self.weight_lower is None else self.weight_lower

    @property
    def lower_reject(self) -> float:
        """The rejection band's lower bound, also the mismatch metric's band (``reject`` off or not)."""
        return 1.0 / self.reject_upper if self.reject_lower is None else self.reject_lower

    @property
    def active(self) -> bool:
        return self.weight != "none" or self.reject != "none"


@dataclass(frozen=True, kw_only=True, config=STRICT)
class AlgorithmConfig:
    """The PPO knobs, shared by actor and critic: the run config's ``algorithm`` section."""

    estimator: str = Field(
        default="ppo",
        description="; ".join(f"{e.name}: {e.summary}" for e in estimators.ESTIMATORS.values())
        + " (ppo_trainer.estimators)",
    )
    gamma: float = Field(default=1.0, ge=0, le=1, description="GAE discount")
    lam: float = Field(default=0.95, ge=0, le=1, description="GAE lambda (trace decay)")
    gae_unit: GaeUnit = Field(
        default="token",
        description="token: GAE steps over the generated tokens, skipping observation tokens (no decay "
        "through them); turn: one step per turn, its value read at the turn's first generated token, "
        "its reward the sum over the turn's tokens, the advantage and return broadcast over the turn's "
        "generated tokens (AReaL's gae_timestep_unit)",
    )
    gae_through_observations: bool = Field(
        default=False,
        description="the ablation of OpenRLHF and slime: values and rewards are zeroed on observation "
        "tokens but gamma * lam still decays across them (gae_unit=token only)",
    )
    eps_clip: float = Field(
        default=0.2, gt=0, lt=1, description="the ratio is clipped to [1 - eps_clip, 1 + eps_clip_high]"
    )
    eps_clip_high: float | None = Field(default=None, gt=0, description="null: same as eps_clip")
    eps_clip_c: float | None = Field(
        default=None, gt=1, description="dual-clip constant bounding negative-advantage losses; null: off"
    )
    value_clip: float = Field(
        default=0.2, gt=0, description="the critic's new value stays within this of its old value"
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        description="reward-level KL penalty -kl_coef * KL(rollout policy || reference) on every token; the "
        "critic computes these rewards once per step (it holds the reference) and the actor trains on them",
    )
    use_kl_loss: bool = Field(default=False, description="the KL to the reference as a loss term instead")
    kl_loss_coef: float = Field(default=0.0, ge=0)
    kl_estimator: KLEstimator = Field(
        default="low_var_kl",
        description="k1: log pi - log pi_ref; abs: |k1|; k2: k1^2 / 2; k3 (low_var_kl, its verl name): "
        "exp(-k1) - 1 + k1 with k1 clamped to [-20, 20] and the result to [-10, 10]",
    )
    # 0.01, not the references' 0: the embedded default run (a tiny model learning from scratch) needs the
    # exploration; without it some seeds settle early on a policy that never finds the better answer.
    # A pretrained LLM's config sets 0 (configs/smollm2-*.yaml): over a large vocabulary the bonus
    # pulls towards noise.
    entropy_coef: float = Field(default=0.01, ge=0, description="the loss subtracts entropy_coef * entropy")
    normalize_advantages: bool | None = Field(
        default=None,
        description="whiten advantages over the loss-masked tokens of all data-parallel ranks; null: the "
        "estimator's default (true: ppo, reinforce_plus_plus_baseline; false: grpo, rloo), resolved at "
        "construction; true with grpo is an error (its advantages are normalised per group already)",
    )
    norm_adv_by_std_in_grpo: bool = Field(
        default=True,
        description="grpo: divide each group's centred rewards by the group's std; false: Dr. GRPO (centred "
        "rewards only)",
    )
    loss_aggregation: LossAggregation = Field(
        default="token_mean",
        description="token_mean: over all loss tokens of the global batch; seq_mean_token_mean: mean over "
        "each sample's tokens, then over samples; seq_mean_token_sum: sum over each sample's tokens, mean "
        "over samples; seq_mean_token_sum_norm (Dr. GRPO): that sum divided by loss_scale_factor",
    )
    loss_scale_factor: int | None = Field(
        default=None,
        ge=1,
        description="seq_mean_token_sum_norm: the constant each sample's token sum is divided by; null: "
        "rollout.sampling.max_new_tokens (the driver fills it in)",
    )
    ppo_epochs: int = Field(default=1, ge=1, description="passes over each step's batch")
    num_mini_batches: int = Field(default=4, ge=1, description="optimizer steps per pass")
    critic_ppo_epochs: int | None = Field(
        default=None, ge=1, description="the critic's passes over each step's batch; null: ppo_epochs"
    )
    critic_num_mini_batches: int | None = Field(
        default=None, ge=1, description="the critic's optimizer steps per pass; null: num_mini_batches"
    )
    tis_cap: float | None = Field(
        default=None,
        ge=1,
        description="truncated importance sampling: weight each token's policy loss by "
        "min(pi_old / pi_rollout, tis_cap); null: off. The same as rollout_correction.weight=token, "
        "weight_upper=tis_cap (set one of the two)",
    )
    rollout_correction: RolloutCorrection = Field(
        default=RolloutCorrection(),
        description="importance weights and rejection for the engine-trainer mismatch (RolloutCorrection); "
        "train.async=one_step_off needs a weight (or tis_cap)",
    )
    off_policy_returns: OffPolicyReturns = Field(
        default="none",
        description="none: the critic's targets and the advantages as the estimator computes them (GAE for "
        "ppo), as if the current policy drew every token; vtrace: V-trace's (IMPALA) for estimators with a "
        "critic, each token weighted by its ratio rho = pi_old / pi_rollout truncated at vtrace_rho_bar, "
        "the traces at vtrace_c_bar (the weights are in the advantages: no rollout_correction weight or "
        "tis_cap with it)",
    )
    vtrace_rho_bar: float = Field(
        default=1.0,
        gt=0,
        description="off_policy_returns=vtrace: each TD error and advantage is weighted by min(rho_bar, rho)",
    )
    vtrace_c_bar: float = Field(
        default=1.0, gt=0, description="off_policy_returns=vtrace: the traces are lam * min(c_bar, rho)"
    )

    def __post_init__(self) -> None:
        info = estimators.get(self.estimator)
        if self.normalize_advantages is None:
            # Resolved once, so the dumped config says what runs (frozen: set through object).
            object.__setattr__(self, "normalize_advantages", info.whiten_by_default)
        if self.use_kl_loss and self.kl_loss_coef == 0.0:
            raise ValueError(
                "algorithm.use_kl_loss=true with algorithm.kl_loss_coef=0 has no effect; "
                "set algorithm.kl_loss_coef>0 or algorithm.use_kl_loss=false"
            )
        if not info.may_whiten and self.normalize_advantages:
            raise ValueError(
                f"algorithm.normalize_advantages=true with algorithm.estimator={self.estimator!r} would "
                "whiten the group-normalised advantages again over the whole batch (a group of equal "
                "rewards would get non-zero advantages); set algorithm.normalize_advantages=null or false"
            )
        if not info.reads_norm_by_std and not self.norm_adv_by_std_in_grpo:
            raise ValueError(
                "algorithm.norm_adv_by_std_in_grpo=false has no effect with algorithm.estimator="
                f"{self.estimator!r}; set algorithm.estimator='grpo' or remove norm_adv_by_std_in_grpo"
            )
        if self.loss_scale_factor is not None and self.loss_aggregation != "seq_mean_token_sum_norm":
            raise ValueError(
                f"algorithm.loss_scale_factor={self.loss_scale_factor} only applies to "
                f"algorithm.loss_aggregation='seq_mean_token_sum_norm' (got {self.loss_aggregation!r}); "
                "remove loss_scale_factor or set that aggregation"
            )
        if self.gae_unit == "turn" and self.gae_through_observations:
            raise ValueError(
                "algorithm.gae_through_observations=true decays GAE per token through observations; "
                "algorithm.gae_unit='turn' takes one step per turn: set one of them back to its default"
            )
        if not info.uses_critic and (self.gae_unit != "token" or self.gae_through_observations):
            raise ValueError(
                f"algorithm.gae_unit / gae_through_observations shape GAE, which "
                f"algorithm.estimator={self.estimator!r} does not run; remove them or use estimator='ppo'"
            )
        if not info.uses_critic and self.kl_coef > 0.0:
            raise ValueError(
                "algorithm.kl_coef > 0 (a KL reward penalty, shaped by the critic) needs an estimator "
                f"with a critic (ppo); with {self.estimator!r} use algorithm.use_kl_loss=true and "
                "algorithm.kl_loss_coef instead"
            )
        if not info.uses_critic and (self.critic_ppo_epochs or self.critic_num_mini_batches):
            raise ValueError(
                f"algorithm.critic_ppo_epochs / critic_num_mini_batches shape the critic's training, and "
                f"algorithm.estimator={self.estimator!r} has no critic; remove them or use estimator='ppo'"
            )
        if self.tis_cap is not None and self.rollout_correction.weight != "none":
            raise ValueError(
                f"algorithm.tis_cap={self.tis_cap} and algorithm.rollout_correction.weight="
                f"{self.rollout_correction.weight!r} both set an importance weight; keep one (tis_cap=C is "
                "rollout_correction: {weight: token, weight_upper: C})"
            )
        self._check_off_policy_returns(info)

    def _check_off_policy_returns(self, info: estimators.Estimator) -> None:
        """V-trace corrects a critic's targets, per token, with the importance weight in the advantage."""
        if self.off_policy_returns != "vtrace":
            if (self.vtrace_rho_bar, self.vtrace_c_bar) != (1.0, 1.0):
                raise ValueError(
                    "algorithm.vtrace_rho_bar / vtrace_c_bar apply to algorithm.off_policy_returns='vtrace' "
                    f"(got {self.off_policy_returns!r}); remove them or set off_policy_returns=vtrace"
                )
            return
        if not info.uses_critic:
            raise ValueError(
                "algorithm.off_policy_returns='vtrace' corrects a critic's returns and algorithm.estimator="
                f"{self.estimator!r} has no critic; set algorithm.off_policy_returns=none (the policy "
                "loss's importance weights, tis_cap, correct it) or algorithm.estimator=ppo"
            )
        if self.gae_unit != "token" or self.gae_through_observations:
            raise ValueError(
                "algorithm.off_policy_returns='vtrace' steps over the generated tokens; remove "
                "algorithm.gae_unit / gae_through_observations or set off_policy_returns=none"
            )
        if self.correction.weight != "none":
            raise ValueError(
                "algorithm.off_policy_returns='vtrace' puts each token's importance weight in its advantage; "
                "a policy-loss weight (algorithm.tis_cap or rollout_correction.weight) would apply it twice: "
                "remove it (rollout_correction.reject still works) or set off_policy_returns=none"
            )

    @property
    def estimator_info(self) -> estimators.Estimator:
        """The estimator's entry in ``ppo_trainer.estimators`` (its function and properties)."""
        return estimators.get(self.estimator)

    @property
    def correction(self) -> RolloutCorrection:
        """``rollout_correction`` with ``tis_cap`` folded in (``weight: token``, truncated at it)."""
        if self.tis_cap is None:
            return self.rollout_correction
        return RolloutCorrection(
            weight="token",
            weight_upper=self.tis_cap,
            reject=self.rollout_correction.reject,
            reject_upper=self.rollout_correction.reject_upper,
            reject_lower=self.rollout_correction.reject_lower,
        )

    def epochs_for(self, role: Role) -> int:
        """The passes ``role`` makes over each step's batch (``critic_ppo_epochs`` for the critic)."""
        if role == "critic" and self.critic_ppo_epochs is not None:
            return self.critic_ppo_epochs
        return self.ppo_epochs

    def mini_batches_for(self, role: Role) -> int:
        """``role``'s optimizer steps per pass (``critic_num_mini_batches`` for the critic)."""
        if role == "critic" and self.critic_num_mini_batches is not None:
            return self.critic_num_mini_batches
        return self.num_mini_batches

    @property
    def whiten_advantages(self) -> bool:
        """``normalize_advantages`` as resolved at construction (null: GAE's whitened, GRPO's not)."""
        return bool(self.normalize_advantages)

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def needs_reference(self) -> bool:
        """Whether some role needs a frozen reference model (a KL term is on)."""
        return self.kl_coef > 0.0 or self.use_kl_loss

    def reference_for(self, role: Role) -> bool:
        """Whether ``role`` holds the reference: the critic for reward-level KL (it computes the
        KL-shaped rewards before anyone trains), the actor for the KL loss term."""
        return self.kl_coef > 0.0 if role == "critic" else self.use_kl_loss


@dataclass(frozen=True, kw_only=True, config=STRICT)
class LoraSettings:
    """``train.lora``: low-rank adapters instead of training every weight (torch backend).

    Each chosen linear layer of the decoder layers trains ``A`` (``rank x in``) and ``B``
    (``out x rank``) beside its frozen weight ``W``; it computes ``W + (alpha / rank) B A``. The
    optimizer holds the adapters (and the critic's value head) only; the engines get merged weights,
    or the adapters alone (``update``).
    """

    rank: int = Field(default=16, ge=1, description="the adapters' rank r")
    alpha: float = Field(default=32.0, gt=0, description="the update is scaled by alpha / rank")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the adapters' input (training)")
    target_modules: tuple[str, ...] = Field(
        default=(),
        description="names of the decoder layers' linear layers to adapt (q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj in Llama); empty: all of them",
    )
    roles: tuple[Role, ...] = Field(
        default=("actor", "critic"),
        min_length=1,
        description="the roles trained with adapters; the others train every weight",
    )
    update: Literal["merged", "adapters"] | None = Field(
        default=None,
        description="what the actor's weight update sends: 'adapters' (the lora_A/lora_B tensors only, "
        "in the sync dtype: the built-in engine merges them onto the base it keeps, an SGLang server, "
        "launched with LoRA on, loads them as a LoRA adapter) or 'merged' (W + alpha/rank B A under the "
        "base's names, every tensor: any engine); null: 'adapters' with rollout.engine='builtin', "
        "'merged' with 'sglang'",
    )
    share_base: bool | Literal["auto"] = Field(
        default="auto",
        description="one copy of the frozen base weights for the actor and the critic on the same devices "
        "(placement.critic='shared', both roles in roles): the critic maps the actor's base, which stays "
        "resident while either sleeps; auto: on when possible; true: on, or a ValueError saying why not; "
        "false: each role holds its own copy",
    )

    def __post_init__(self) -> None:
        missing = [r for r in ("actor", "critic") if r not in self.roles]
        if self.share_base is True and missing:
            raise ValueError(
                f"train.lora.share_base=true shares the frozen base of two LoRA roles, but train.lora.roles="
                f"{list(self.roles)} lacks {missing}; add them to roles or set share_base='auto' or false"
            )


@dataclass(frozen=True, kw_only=True, config=STRICT)
class TrainSettings:
    """The optimizer and batching settings of both roles: the trainer's part of the ``train`` section."""

    micro_batch_size: int = Field(
        default=8, ge=1, description="samples per forward/backward; gradients accumulate over them"
    )
    max_tokens_per_micro_batch: int | None = Field(
        default=None,
        ge=1,
        description="tokens per forward/backward instead of micro_batch_size samples: each mini-batch is "
        "cut into the fewest micro-batches within this budget (packed: their real tokens; padded: samples "
        "x longest), balanced by token count, as many on every data-parallel rank; at least the longest "
        "sample; null: micro_batch_size samples each",
    )
    pack_sequences: bool = Field(
        default=False,
        description="run each micro-batch as its samples back to back in one row (positions "
        "restart at each sample, attention stays within it): no compute on padding, and log-probs from "
        "the response positions' hidden states in chunks (torch backend: no [tokens, vocabulary] logits; "
        "megatron: its own thd format, the attention of packed_attention=varlen)",
    )
    packed_attention: PackedAttention = Field(
        default="varlen",
        description="pack_sequences: varlen (torch's variable-length flash kernel on CUDA in bf16, a causal "
        "SDPA call per sample elsewhere), sdpa (transformers' dense block-diagonal mask) or "
        "flex_attention (transformers' FlexAttention block mask; torch backend only)",
    )
    compile_layers: bool = Field(
        default=False,
        description="torch backend: run each decoder layer through torch.compile (dynamic shapes; inductor "
        "fuses the norms, rotary and activations around the matmuls). With pack_sequences and a token "
        "budget on an H200 it made the train phases 1.35-1.6x faster at 135M and 0.82B; each phase's first "
        "call pays the compile (about 13 s per role at 0.82B)",
    )
    logprob_chunk_tokens: int = Field(
        default=4096,
        ge=1,
        description="positions per chunk of the float32 log-softmax and entropy (packed: of the LM head "
        "too); only one chunk's float32 logits exist at a time",
    )
    # 1e-3 (actor) and 2e-3 (critic): the driver's embedded default run (a tiny model learning copy_small
    # from scratch) learns on every seed with them. At 5e-3 it was a lottery: once the policy sharpened,
    # single steps moved it by a KL of 0.3-0.8 and the reward fell from 0.8 to 0.5 (one seed of four
    # learnt on one host). The seed sweep (ppo-driver's benchmarks/seed_sweep.py) measures it.
    actor_lr: float = Field(default=1e-3, gt=0, description="AdamW learning rate of the actor")
    critic_lr: float = Field(default=2e-3, gt=0, description="AdamW learning rate of the critic")
    critic_init_from: str | None = Field(
        default=None,
        description="a value model the critic starts from (its backbone and value head) instead of "
        "model.path with a fresh head: a run's critic checkpoint (a checkpoint folder step_N, or its critic "
        "folder) or a Hugging Face folder whose head is score.* (num_labels=1), v_head.summary.* (TRL) or "
        "value_head.*, of model.path's architecture; shapes checked before Ray; torch backend; a resumed "
        "run loads its checkpoint instead (docs/guide/algorithms.md)",
    )
    weight_decay: float = Field(default=0.0, ge=0)
    # cosine: the default run's late steps, where nearly every sample is right and the whitened
    # advantages are the critic's noise at full scale, otherwise move a sharp policy by a KL of 0.2-0.5
    # and undo what it learnt (the default seed fell from 0.99 to 0.6 at step 114 of 120 at a constant
    # rate).
    lr_schedule: LrSchedule = Field(
        default="cosine",
        description="constant: the rate after warm-up; cosine: decays to min_lr_ratio x the rate at "
        "the last step (train.steps)",
    )
    lr_warmup_steps: int = Field(default=0, ge=0, description="steps of linear warm-up from 0")
    min_lr_ratio: float = Field(
        default=0.1, ge=0, le=1, description="cosine: the last step's rate as a share of the rate"
    )
    grad_clip: float = Field(default=1.0, ge=0, description="max global gradient norm; 0: no clipping")
    data_parallel: DataParallelKind = Field(
        default="auto",
        description="replicate: each rank holds the whole model and optimizer; fsdp2: a shard each "
        "(torch fully_shard); auto: fsdp2 on CUDA with more than one rank when the replicated training "
        "state (16 bytes a parameter) would take over a quarter of a GPU, else replicate",
    )
    backend: Backend = Field(
        default="torch",
        description="torch: transformers models (replicated or FSDP2); megatron: megatron-core GPTModel with "
        "tensor and data parallelism (CUDA, Python >= 3.12, the ppo-trainer[megatron] extra; Llama and "
        "Qwen2 models, not Gemma 3)",
    )
    lora: LoraSettings | None = Field(
        default=None,
        description="LoRA adapters (LoraSettings: rank, alpha, dropout, target_modules, roles) instead of "
        "full fine-tuning; torch backend, replicated data parallelism; null: every weight trains",
    )
    tensor_parallel: int = Field(
        default=1,
        ge=1,
        description="megatron backend: GPUs each model is split over (must divide each role's GPUs and the "
        "model's attention and key-value heads); the other GPUs of the role are data parallel",
    )

    def __post_init__(self) -> None:
        if self.tensor_parallel > 1 and self.backend != "megatron":
            raise ValueError(
                f"train.tensor_parallel={self.tensor_parallel} needs train.backend='megatron' "
                "(the torch backend is data parallel only); set the backend or tensor_parallel=1"
            )
        if self.lora is not None and self.backend == "megatron":
            raise ValueError(
                "train.lora is a torch-backend option; set train.backend='torch' or remove train.lora"
            )
        if self.lora is not None and self.data_parallel == "fsdp2":
            raise ValueError(
                "train.lora trains replicated (the adapters and their optimizer state are small and the "
                "export merges whole tensors); set train.data_parallel='replicate' or 'auto'"
            )
        if self.critic_init_from is not None:
            self._check_critic_init()
        if self.compile_layers and self.backend == "megatron":
            raise ValueError(
                "train.compile_layers=true is a torch-backend option (it compiles transformers' decoder "
                "layers); the megatron backend has its own fused kernels: set compile_layers=false"
            )
        if self.pack_sequences and self.backend == "megatron" and self.packed_attention != "varlen":
            raise ValueError(
                f"train.packed_attention={self.packed_attention!r} is a transformers attention; the megatron "
                "backend packs with varlen (its own core attention): set packed_attention=varlen"
            )

    def _check_critic_init(self) -> None:
        if self.backend == "megatron":
            raise ValueError(
                "train.critic_init_from is a torch-backend option (the megatron backend builds its critic "
                "from model.path); set train.backend='torch' or remove train.critic_init_from"
            )
        if self.lora is not None and self.lora.share_base is True:
            raise ValueError(
                "train.lora.share_base=true gives the critic the actor's frozen base, and "
                "train.critic_init_from another backbone; set share_base='auto' or false"
            )

    def backend_problems(self, device: str, role_gpus: dict[str, int]) -> list[str]:
        """What stops ``backend`` from running here, one sentence each; imports neither torch nor megatron.

        ``role_gpus``: each training role's GPU count, by the field that sets it (tensor_parallel must
        divide it). The model's heads are checked by ``megatron_heads_problems``.
        """
        if self.backend != "megatron":
            return []
        problems = []
        if device != "cuda":
            problems.append(f"train.backend='megatron' needs placement.device='cuda' (got {device!r})")
        if sys.version_info < (3, 12):
            problems.append(
                "train.backend='megatron' needs Python >= 3.12 (megatron-core 0.19); this is "
                f"{sys.version_info.major}.{sys.version_info.minor}: use train.backend='torch'"
            )
        elif not megatron_installed():
            problems.append(
                "train.backend='megatron' needs megatron-core: install the extra ppo-trainer[megatron]"
            )
        for field, gpus in role_gpus.items():
            if gpus % self.tensor_parallel:
                problems.append(
                    f"train.tensor_parallel={self.tensor_parallel} must divide {field}={gpus} "
                    "(each model is split over tensor_parallel GPUs of its role)"
                )
        return problems

    def megatron_heads_problems(self, model_config: dict[str, object]) -> list[str]:
        """``tensor_parallel`` against a Hugging Face ``config.json`` (heads, key-value heads, MLP width)."""
        if self.backend != "megatron":
            return []
        # The family table; imported here, as ppo_weight_sync's package imports torch, which settings
        # of the torch backend never need (ppo-driver validate stays torch-free).
        from ppo_weight_sync.families import megatron_family

        problems = []
        try:
            megatron_family(model_config)
        except ValueError as exc:
            problems.append(f"train.backend='megatron': {exc}")
        heads = model_config.get("num_attention_heads")
        fields = {
            "num_attention_heads": heads,
            "num_key_value_heads": model_config.get("num_key_value_heads", heads),
            "intermediate_size": model_config.get("intermediate_size"),
        }
        for name, value in fields.items():
            if isinstance(value, int) and value % self.tensor_parallel:
                problems.append(
                    f"train.tensor_parallel={self.tensor_parallel} must divide the model's {name}={value}"
                )
        return problems


@dataclass(frozen=True, kw_only=True, config=STRICT)
class TrainerConfig(TrainSettings):
    """One role's training setup: the ``TrainSettings`` plus what the driver derives for the role.

    - ``role``: ``"actor"`` or ``"critic"``; ``lr`` is ``actor_lr`` or ``critic_lr`` accordingly.
    - ``model_path``: a local Hugging Face folder (``config.json`` plus weights; a folder with only a
      config initialises randomly from ``seed``). The critic loads the same causal-LM checkpoint into its
      backbone and adds a fresh scalar value head.
    - ``dtype``: compute dtype under autocast; ``auto`` is bfloat16 on CUDA and float32 on CPU.
      Parameters and optimizer state stay float32.
    - ``betas``: AdamW's (``lr`` and ``weight_decay`` come from the settings).
    - ``memory_backend``: how ``sleep()`` frees memory (lifecycle backends); ``auto`` picks the default
      for the device.
    - ``weight_sync_backend``, ``bucket_bytes``, ``weight_sync_group``: the actor's weight update group;
      ``weight_sync_dtype``: the dtype weights are sent (and checksummed) in; match the engines' dtype.
    - ``cpu_threads``: torch intra-op threads of each worker process.
    - ``data_parallel``: ``replicate`` (every rank holds the whole model and its AdamW state; one
      gradient all-reduce per optimizer step), ``fsdp2`` (each rank holds ``1 / world_size`` of them,
      gathered layer by layer; ``torch.distributed.fsdp.fully_shard``), or ``auto``: ``fsdp2`` where it
      helps, on CUDA with more than one rank when the replicated training state would take more than
      ``AUTO_SHARD_FRACTION`` of a GPU, else ``replicate`` (faster while memory allows; measured in
      docs/benchmarks/trainer.md).
    """

    role: Role
    model_path: str = Field(min_length=1, description="a local Hugging Face model folder")
    algorithm: AlgorithmConfig = AlgorithmConfig()
    dtype: DType = "auto"
    betas: tuple[float, float] = (0.9, 0.999)
    seed: int = 1234
    device: Device = "cpu"
    total_steps: int | None = Field(
        default=None,
        ge=1,
        description="the run's training steps, the cosine schedule's length (the driver sets "
        "train.steps); null: the rate stays constant after warm-up",
    )
    memory_backend: MemoryBackendName = "auto"
    weight_sync_backend: WeightSyncBackend = "gloo"
    weight_sync_colocated: tuple[tuple[Annotated[int, Field(ge=0)], ...], ...] = Field(
        default=(),
        description="per actor rank, the engines (by index in connect_engines' list) on that rank's GPU: "
        "it sends to them over CUDA IPC; rank 0 sends to every other engine over the group",
    )
    weight_sync_colocated_tp: tuple[tuple[Annotated[int, Field(ge=0)], ...], ...] = Field(
        default=(),
        description="colocated engines of several GPUs served over CUDA IPC, each (engine, rank on its TP "
        "rank 0's GPU, rank on TP rank 1's GPU, ...): the first rank posts (list the engine in its "
        "weight_sync_colocated entry), the others feed their TP rank (ppo_weight_sync.SenderPlan.tp_wire)",
    )
    bucket_bytes: int = Field(default=512 << 20, ge=1)
    weight_sync_group: str = Field(default="ppo_weights", min_length=1)
    weight_sync_dtype: WeightSyncDType = "float32"
    cpu_threads: int = Field(default=1, ge=1, description="torch intra-op threads per worker")
    critic_health: bool = Field(
        default=True,
        description="the critic's health metrics every step (critic_health.py; the driver's "
        "logging.critic_health)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.backend == "megatron" and self.device != "cuda":
            raise ValueError("backend='megatron' needs device='cuda'; use backend='torch' on CPU")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas={self.betas!r} must be two numbers in [0, 1)")
        if self.device == "cpu" and self.memory_backend in ("pinned", "torch_memory_saver"):
            raise ValueError(
                f"memory_backend={self.memory_backend!r} needs device='cuda'; use 'host' or 'auto' on CPU"
            )
        colocated = self.weight_sync_colocated
        named = [i for engines in colocated for i in engines]
        if len(set(named)) != len(named):
            raise ValueError(
                f"weight_sync_colocated={colocated!r} names an engine twice (one sending rank each)"
            )
        if named and self.device != "cuda":
            raise ValueError("weight_sync_colocated needs device='cuda' (CUDA IPC); leave it empty on CPU")
        for entry in self.weight_sync_colocated_tp:
            if len(entry) < 3 or len(set(entry[1:])) != len(entry) - 1:
                raise ValueError(
                    f"weight_sync_colocated_tp entry {entry!r}: (engine, rank of TP rank 0, rank of TP "
                    "rank 1, ...) with at least two distinct ranks"
                )
        if self.weight_sync_colocated_tp and self.device != "cuda":
            raise ValueError("weight_sync_colocated_tp needs device='cuda' (CUDA IPC); leave it empty on CPU")
        if self.device == "cpu" and self.weight_sync_backend == "nccl":
            raise ValueError("weight_sync_backend='nccl' needs device='cuda'; use 'gloo' on CPU")
        if (
            self.algorithm.loss_aggregation == "seq_mean_token_sum_norm"
            and self.algorithm.loss_scale_factor is None
        ):
            raise ValueError(
                "algorithm.loss_aggregation='seq_mean_token_sum_norm' needs algorithm.loss_scale_factor (the "
                "constant each sample's token sum is divided by, e.g. the longest response); ppo-driver "
                "sets it to rollout.sampling.max_new_tokens when null"
            )
        if self.role == "critic" and not self.algorithm.estimator_info.uses_critic:
            raise ValueError(
                f"a critic is not used with estimator={self.algorithm.estimator!r}; drop the critic or "
                "use 'ppo'"
            )

    @property
    def lora_applies(self) -> bool:
        """Whether this role trains adapters (``train.lora`` set and naming the role)."""
        return self.lora is not None and self.role in self.lora.roles

    @property
    def lr(self) -> float:
        """This role's learning rate."""
        return self.actor_lr if self.role == "actor" else self.critic_lr

    def shards(self, world_size: int, state_share: float = 0.0) -> bool:
        """Whether a role of ``world_size`` ranks shards its models with FSDP2.

        ``state_share``: the replicated training state (float32 weights, gradients and two AdamW
        moments: 16 bytes a parameter) over one GPU's memory; only ``auto`` reads it.
        """
        if self.lora_applies:
            return False  # train.lora refuses fsdp2; auto replicates
        if self.data_parallel == "auto":
            return self.device == "cuda" and world_size > 1 and state_share > AUTO_SHARD_FRACTION
        return self.data_parallel == "fsdp2"

    @property
    def compute_dtype(self) -> str:
        if self.dtype == "auto":
            return "bfloat16" if self.device == "cuda" else "float32"
        return self.dtype
