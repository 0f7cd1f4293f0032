"""The torch backend: one data-parallel rank's model, optimizer and PPO update.

``TorchTrainer`` knows nothing about Ray or the lifecycle: it takes a ``DataParallel`` (rank, world size
and a sum all-reduce) and a ``region`` context factory under which it allocates weights and optimizer
state (torch_memory_saver tags them; other memory backends ignore it). The Ray worker wires both.

Data parallelism comes in two kinds (``DataParallel.shard_group``):

- replication: every rank holds the whole model; after the micro-batches of one mini-batch, the
  gradients are summed over ranks in one flat buffer;
- FSDP2 (``ppo_trainer.sharding``): each rank holds a shard of every parameter, gradient and AdamW
  state; FSDP reduce-scatters the gradients after each backward.

Losses are divided by the token (or sequence) count of the whole global mini-batch, so the sum over
ranks equals the gradient of the global mean and a 2-rank run matches a 1-rank run on the same global
batch up to float summation order (on CUDA, also up to bf16 rounding: FSDP computes with bf16 copies
of the parameters where the replicated path autocasts). FSDP averages what it reduces, so the sharded
backward scales the loss by the group size to get that sum. Sharded, every forward and backward is a
collective, so all ranks must hold the same number of samples (checked, ``ValueError`` otherwise).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ppo_trainer import ppo_math as pm
from ppo_trainer import sharding
from ppo_trainer.batch import MicroBatch, Samples, chunks, collate, split_even
from ppo_trainer.config import TrainerConfig
from ppo_trainer.lr_schedule import scheduled_factor
from ppo_trainer.models import (
    CriticModel,
    load_causal_lm,
    load_critic,
    load_reference,
    map_policy_state_to_critic,
)

Region = Callable[[str], ContextManager[None]]


def _no_region(tag: str) -> ContextManager[None]:
    return contextlib.nullcontext()


@dataclass(frozen=True)
class Counts:
    """A mini-batch's global counts (all micro-batches, all ranks), the divisors of its micro-batch terms.

    ``loss``: the loss aggregation's ``D`` (tokens or samples); ``tokens``: the loss tokens, for the
    metrics that are token means whatever the aggregation (clip fractions, ``ppo_kl``), as in verl.
    """

    loss: torch.Tensor
    tokens: torch.Tensor


@dataclass(frozen=True)
class DataParallel:
    """Where this rank sits and how to sum a tensor over all ranks (returns the sum, same device).

    ``shard_group``: shard the models with FSDP2 over the group it returns (called at construction
    and after every rebuild of the groups, so it must return the live one); None: replicate them.
    """

    rank: int = 0
    world_size: int = 1
    sum_fn: pm.AllReduce | None = None
    shard_group: Callable[[], dist.ProcessGroup] | None = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.sum_fn is None else self.sum_fn(tensor)


class TorchTrainer:
    """One rank of the actor or the critic: model, optimizer, reference model (actor with a KL term)."""

    WEIGHTS_TAG = "weights"
    OPTIMIZER_TAG = "optimizer"

    def __init__(self, config: TrainerConfig, dp: DataParallel | None = None, region: Region | None = None):
        self.config = config
        self.alg = config.algorithm
        self.dp = dp or DataParallel()
        self.region: Region = region or _no_region
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if config.device == "cuda"
            else torch.device("cpu")
        )
        self.autocast_dtype = torch.bfloat16 if config.compute_dtype == "bfloat16" else None
        self.model: nn.Module
        self.reference: nn.Module | None = None
        self.sharded = self.dp.shard_group is not None
        # Sharded, the models stay in host memory until fully_shard moves them one block at a time:
        # the device never holds a whole model, only the shards and the block being split.
        load_to = torch.device("cpu") if self.sharded else self.device
        started = time.perf_counter()
        with self.region(self.WEIGHTS_TAG):
            if config.role == "actor":
                self.model = nn.Module.to(load_causal_lm(config.model_path, config.seed), load_to)
            else:
                self.model = load_critic(config.model_path, config.seed).to(load_to)
            # Reward-level KL: the critic holds the reference (it shapes the rewards before anyone
            # trains); the KL loss term: the actor does.
            if self.alg.reference_for(config.role):
                ref_dtype = torch.bfloat16 if self.autocast_dtype is not None else torch.float32
                reference = load_reference(config.model_path, config.seed, ref_dtype)
                self.reference = nn.Module.to(reference, load_to)
        if self.device.type == "cpu":
            # from_pretrained maps safetensors files into memory; give every tensor its own resizable
            # storage so the memory backend can release and restore it.
            with torch.no_grad():
                for module in self._models():
                    for t in [*module.parameters(), *module.buffers()]:
                        t.data = t.data.clone()
        # The class transformers writes into config.json; FSDP renames the class it wraps.
        self.architecture = type(self.model).__name__
        # FSDP averages gradients over its group; the losses are already divided by the global count.
        self._loss_scale = 1.0
        if self.dp.shard_group is not None:
            with self.region(self.WEIGHTS_TAG):
                group = self.dp.shard_group()
                sharding.shard_model(self.model, group, self.device.type, self.autocast_dtype)
                if self.reference is not None:
                    sharding.shard_model(self.reference, group, self.device.type, None)
            self._loss_scale = float(group.size())
        built = time.perf_counter()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=config.lr,
            betas=config.betas,
            weight_decay=config.weight_decay,
            foreach=self.device.type == "cuda",
        )
        # AdamW would create its state in the first step; made here, the memory backend tracks (and
        # the pinned one allocates host buffers for) the whole state at setup, not in the first sleep.
        with self.region(self.OPTIMIZER_TAG):
            init_adam_state(self.optimizer)
        # What the worker reports of its start-up: loading (and sharding) the models, the optimizer.
        self.setup_seconds = {"model": built - started, "optimizer": time.perf_counter() - built}

    def _models(self) -> list[nn.Module]:
        """The trained model and, with a KL term, the frozen reference."""
        return [m for m in (self.model, self.reference) if m is not None]

    # ------------------------------------------------------------------ tensors the lifecycle moves
    def weight_tensors(self) -> list[torch.Tensor]:
        """What the memory backend moves for the weights (the local shards when sharded)."""
        tensors = [t for m in self._models() for t in [*(p.data for p in m.parameters()), *m.buffers()]]
        return [t for t in sharding.local_tensors(tensors) if t.device.type == self.device.type]

    def optimizer_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for state in self.optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return [t for t in sharding.local_tensors(out) if t.device.type == self.device.type]

    def optimizer_state_entries(self) -> int:
        return len(self.optimizer.state)

    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's ``state_dict`` in Hugging Face names: parameters and persistent buffers, tied
        weights under each of their names (what an engine loading a Hugging Face checkpoint holds).

        Whole tensors, cast to ``dtype`` (None: as they are). Sharded, every rank must iterate in
        step: each tensor is gathered, in ``dtype``, by a collective over the ranks.
        """
        gathered: dict[int, torch.Tensor] = {}
        # keep_vars: tied weights come back as the same Parameter under each name (one gather each).
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            key = id(tensor)
            if key not in gathered:
                gathered[key] = sharding.full_tensor(tensor.detach(), dtype)
            yield name, gathered[key]

    @property
    def layout(self) -> str:
        """How the role is parallelised: ``fsdp2`` or ``replicate``."""
        return "fsdp2" if self.sharded else "replicate"

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole float32 CPU tensors in Hugging Face names (collective when sharded)."""
        return {name: t.float().cpu() for name, t in self.named_weights()}

    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Whole tensors in Hugging Face names (either backend's); a critic accepts a policy state.

        Every rank passes the whole state (sharded, each keeps its shard)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        own = self.model.state_dict(keep_vars=True)
        if isinstance(self.model, CriticModel):
            mapped, _ = map_policy_state_to_critic(self.model, state)
        else:
            mapped = {k: v for k, v in state.items() if k in own}
            # A tied alias (lm_head.weight) may be absent: its tensor arrives under the other name.
            present = {id(own[k]) for k in mapped}
            missing = [k for k in own if k not in mapped and id(own[k]) not in present]
            if missing:
                raise ValueError(f"the state lacks {len(missing)} tensors of the actor (e.g. {missing[:5]})")
        with self.region(self.WEIGHTS_TAG), torch.no_grad():
            if self.sharded:
                options = StateDictOptions(full_state_dict=True, strict=False)
                set_model_state_dict(self.model, dict(mapped), options=options)
            else:
                for name, tensor in mapped.items():
                    own[name].data.copy_(tensor)

    def hf_optimizer_state(self) -> dict[str, Any]:
        """AdamW's state keyed by name, whole tensors (``optimizer_format``; collective when sharded)."""
        from ppo_trainer.optimizer_format import torch_optimizer_state

        return torch_optimizer_state(self)

    def load_hf_optimizer_state(self, state: Mapping[str, Any]) -> None:
        """An ``optimizer.pt`` dict of either backend into AdamW (every rank passes the whole dict)."""
        from ppo_trainer.optimizer_format import load_torch_optimizer_state

        load_torch_optimizer_state(self, state)

    def after_groups_rebuilt(self) -> None:
        """Point FSDP at the rebuilt process group (a lifecycle post-wake hook; no-op unsharded)."""
        if self.dp.shard_group is None:
            return
        group = self.dp.shard_group()
        for module in self._models():
            sharding.rebind_process_groups(module, group)

    def release_gathered(self) -> None:
        """Free parameters FSDP keeps gathered after a forward without backward (before sleeping)."""
        if self.sharded:
            for module in self._models():
                sharding.reshard(module)

    # ------------------------------------------------------------------ forward passes
    def _autocast(self) -> ContextManager[object]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _policy(
        self, model: nn.Module, mb: MicroBatch, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self._autocast():
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
        index = mb.logit_positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        picked = logits.gather(1, index)  # [b, R, V]: the logits that predict each response token
        log_probs = pm.log_probs_from_logits(picked, mb.targets)
        entropy = pm.entropy_from_logits(picked) if with_entropy else None
        return log_probs, entropy

    def _values(self, mb: MicroBatch) -> torch.Tensor:
        with self._autocast():
            values = self.model(mb.input_ids, mb.attention_mask)  # [b, L]
        return values.float().gather(1, mb.logit_positions)

    @torch.no_grad()
    def _rank_log_probs(self, model: nn.Module, samples: Samples) -> torch.Tensor:
        was_training = model.training
        model.eval()
        out = torch.zeros(len(samples), samples.max_response)
        for rows in chunks(range(len(samples)), self.config.micro_batch_size):
            log_probs, _ = self._policy(model, collate(samples, rows, self.device), with_entropy=False)
            out[rows] = log_probs.float().cpu()
        model.train(was_training)
        self.release_gathered()
        return out * samples.response_mask

    def compute_log_probs(self, samples: Samples) -> torch.Tensor:
        """Log-probs of the response tokens under the current policy, ``[N, R_max]`` (0 on padding)."""
        self._require_even_split(samples)
        return self._rank_log_probs(self.model, samples)

    def _require_even_split(self, samples: Samples) -> None:
        """Sharded ranks run their forward passes in lockstep: all must hold as many samples."""
        if not self.sharded or self.dp.world_size == 1:
            return
        n = float(len(samples))
        # With sums only: the counts are all equal exactly when world_size * sum(n^2) == sum(n)^2.
        total, squares = self.dp.all_reduce(torch.tensor([n, n * n], dtype=torch.float64)).tolist()
        if self.dp.world_size * squares != total * total:
            raise ValueError(
                f"FSDP2 ranks must hold as many samples each: rank {self.dp.rank} holds {int(n)} of "
                f"{int(total)} over {self.dp.world_size} ranks; split the batch evenly over the ranks "
                "(or use data_parallel='replicate')"
            )

    @torch.no_grad()
    def compute_values(self, samples: Samples) -> torch.Tensor:
        """Critic values before each response token, ``[N, R_max]`` (0 on padding)."""
        self._require_even_split(samples)
        self.model.eval()
        out = torch.zeros(len(samples), samples.max_response)
        for rows in chunks(range(len(samples)), self.config.micro_batch_size):
            out[rows] = self._values(collate(samples, rows, self.device)).cpu()
        self.model.train()
        self.release_gathered()
        return out * samples.response_mask

    # ------------------------------------------------------------------ optimisation
    def set_step(self, step: int) -> float:
        """The learning rate of training step ``step`` (``lr_schedule``) into every param group."""
        lr = self.config.lr * scheduled_factor(self.config, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _optimizer_step(self) -> float:
        """Sum gradients over ranks, clip, step, clear; returns the global gradient norm before clipping."""
        if self.sharded:
            return self._clip_and_step()  # FSDP reduce-scattered each gradient in the backward
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.dp.world_size > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])
            flat = self.dp.all_reduce(flat)
            offset = 0
            for p, g in zip(self.params, grads, strict=True):
                n = g.numel()
                p.grad = flat[offset : offset + n].view_as(p).clone()
                offset += n
        else:
            for p, g in zip(self.params, grads, strict=True):
                p.grad = g
        return self._clip_and_step()

    def _clip_and_step(self) -> float:
        norm = sharding.total_grad_norm(self.params)
        if self.config.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.config.grad_clip, norm)
        with self.region(self.OPTIMIZER_TAG):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def _global_counts(self, mask: torch.Tensor) -> Counts:
        local = torch.stack(
            [
                pm.aggregation_denominator(mask, self.alg.loss_aggregation),
                pm.aggregation_denominator(mask, "token_mean"),
            ]
        )
        total = self.dp.all_reduce(local).clamp(min=1.0)
        return Counts(loss=total[0], tokens=total[1])

    def _aggregate(self, loss: torch.Tensor, mask: torch.Tensor, counts: Counts) -> torch.Tensor:
        """A loss term's share of the mini-batch's loss, by ``loss_aggregation``."""
        alg = self.alg
        scale = None if alg.loss_scale_factor is None else float(alg.loss_scale_factor)
        return pm.aggregate(loss, mask, alg.loss_aggregation, counts.loss, scale)

    @staticmethod
    def _token_mean(x: torch.Tensor, mask: torch.Tensor, counts: Counts) -> torch.Tensor:
        """A metric's share of its mean over the mini-batch's loss tokens."""
        return pm.aggregate(x, mask, "token_mean", counts.tokens)

    def _reduce_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        names = sorted(sums)
        total = self.dp.all_reduce(torch.stack([sums[n].detach().float().cpu() for n in names]))
        return {n: float(v) for n, v in zip(names, total.tolist(), strict=True)}

    def _masked_global_mean(self, x: torch.Tensor, mask: torch.Tensor) -> float:
        stats = self.dp.all_reduce(torch.stack([pm.masked_sum(x.float(), mask), mask.sum()]))
        return float(stats[0] / stats[1].clamp(min=1.0))

    def _run_epochs(
        self,
        samples: Samples,
        micro_loss: Callable[[list[int], MicroBatch, Counts], dict[str, torch.Tensor]],
    ) -> dict[str, float]:
        """PPO epochs x mini-batches of optimizer steps; ``micro_loss`` returns ``{"loss": .., metrics}``."""
        totals: dict[str, float] = {}
        steps = 0
        parts = self.alg.num_mini_batches
        short = self.dp.all_reduce(torch.tensor([float(len(samples) < parts)]))
        if short.item() > 0:
            # Every rank must take the same number of optimizer steps (each one is a collective).
            raise ValueError(
                f"{int(short.item())} rank(s) hold fewer samples than num_mini_batches={parts} "
                f"(rank {self.dp.rank} holds {len(samples)}); lower num_mini_batches or send more samples"
            )
        self.model.train()
        for _ in range(self.alg.ppo_epochs):
            for mini in split_even(len(samples), self.alg.num_mini_batches):
                counts = self._global_counts(samples.loss_mask[mini])
                sums: dict[str, torch.Tensor] = {}
                for rows in chunks(mini, self.config.micro_batch_size):
                    terms = micro_loss(rows, collate(samples, rows, self.device), counts)
                    (terms["loss"] * self._loss_scale).backward()
                    for name, value in terms.items():
                        sums[name] = sums.get(name, torch.zeros(())) + value.detach().float().cpu()
                reduced = self._reduce_metrics(sums)
                reduced["grad_norm"] = self._optimizer_step()
                for name, number in reduced.items():
                    totals[name] = totals.get(name, 0.0) + number
                steps += 1
        return {name: value / steps for name, value in totals.items()} | {"optimizer_steps": float(steps)}

    def token_rewards(self, samples: Samples) -> tuple[torch.Tensor, dict[str, float]]:
        """The step's per-token rewards, ``[N, R_max]``: the outcome reward on the last token minus
        ``kl_coef`` times the KL of the rollout policy to the reference on every token.

        The KL is estimated from the rollout's log-probs (the policy that drew the tokens) and the
        reference's, so it is known before any role trains; the critic computes it once and the
        actor trains on the same tensor.
        """
        alg = self.alg
        kl = None
        metrics: dict[str, float] = {}
        if alg.kl_coef > 0.0:
            if self.reference is None:
                raise RuntimeError(
                    f"{self.config.role}: kl_coef={alg.kl_coef} but no reference model is loaded; "
                    "the critic computes the KL-shaped rewards"
                )
            ref_log_probs = self._rank_log_probs(self.reference, samples)
            kl = pm.kl_estimate(samples.rollout_log_probs, ref_log_probs, alg.kl_estimator)
            metrics["reward_kl"] = self._masked_global_mean(kl, samples.response_mask)
        rewards = pm.token_rewards(samples.reward, samples.response_mask, kl, alg.kl_coef)
        metrics["token_reward_sum_mean"] = self._sample_mean(rewards.sum(dim=1))
        return rewards, metrics

    def _sample_mean(self, per_sample: torch.Tensor) -> float:
        stats = self.dp.all_reduce(torch.tensor([float(per_sample.double().sum()), float(len(per_sample))]))
        return float(stats[0] / stats[1].clamp(min=1.0))

    def train_critic(self, samples: Samples) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        """Token rewards, values (before the update), GAE returns, value-loss steps.

        Returns ``(metrics, old_values, token_rewards)``: the actor trains on the same rewards.
        """
        if self.config.role != "critic":
            raise RuntimeError("train_critic called on an actor")
        alg = self.alg
        rewards, reward_metrics = self.token_rewards(samples)
        old_values = self.compute_values(samples)
        _, returns = pm.compute_gae(rewards, old_values, samples.response_mask, alg.gamma, alg.lam)

        def micro_loss(rows: list[int], mb: MicroBatch, counts: Counts) -> dict[str, torch.Tensor]:
            mask = samples.loss_mask[rows].to(self.device)
            values = self._values(mb)
            loss, clipped = pm.value_loss(
                values, old_values[rows].to(self.device), returns[rows].to(self.device), alg.value_clip
            )
            value_loss = self._aggregate(loss, mask, counts)
            return {
                "loss": value_loss,
                "value_loss": value_loss,
                "value_clip_fraction": self._token_mean(clipped, mask, counts),
            }

        metrics = self._run_epochs(samples, micro_loss)
        metrics["values_mean"] = self._masked_global_mean(old_values, samples.loss_mask)
        metrics["returns_mean"] = self._masked_global_mean(returns, samples.loss_mask)
        return metrics | reward_metrics, old_values, rewards

    def train_actor(
        self, samples: Samples, values: torch.Tensor | None, rewards: torch.Tensor | None = None
    ) -> dict[str, float]:
        """Old (and reference) log-probs, advantages (GAE with ``values``, or GRPO), policy-loss steps.

        ``rewards``: the critic's per-token rewards (:meth:`token_rewards`); required with ``kl_coef > 0``
        (only the critic holds the reference for them), else the outcome rewards are used.
        """
        if self.config.role != "actor":
            raise RuntimeError("train_actor called on a critic")
        alg = self.alg
        old_log_probs = self.compute_log_probs(samples)
        ref_log_probs = self._rank_log_probs(self.reference, samples) if self.reference is not None else None
        metrics_extra: dict[str, float] = {}
        if alg.estimator == "ppo":
            if values is None:
                raise ValueError("estimator='ppo' needs the critic's values")
            if rewards is None:
                if alg.kl_coef > 0.0:
                    raise ValueError(
                        f"kl_coef={alg.kl_coef}: the actor trains on the critic's KL-shaped token rewards; "
                        "pass the rewards train_critic returned"
                    )
                rewards = pm.token_rewards(samples.reward, samples.response_mask)
            metrics_extra["token_reward_sum_mean"] = self._sample_mean(
                (rewards * samples.response_mask).sum(1)
            )
            advantages, _ = pm.compute_gae(rewards, values, samples.response_mask, alg.gamma, alg.lam)
        else:
            per_sample = pm.grpo_advantages(
                samples.reward, samples.prompt_index, norm_by_std=alg.norm_adv_by_std_in_grpo
            )
            advantages = per_sample[:, None] * samples.response_mask
        metrics_extra["advantages_mean"] = self._masked_global_mean(advantages, samples.loss_mask)
        # GRPO's advantages are normalised per group already (AlgorithmConfig.whiten_advantages).
        if alg.whiten_advantages:
            advantages = pm.whiten(advantages, samples.loss_mask, self.dp.all_reduce)
        if ref_log_probs is not None:
            ref_kl = pm.kl_estimate(old_log_probs, ref_log_probs, alg.kl_estimator)
            metrics_extra["ref_kl"] = self._masked_global_mean(ref_kl, samples.loss_mask)
        metrics_extra["train_rollout_logp_abs_diff"] = self._masked_global_mean(
            (old_log_probs - samples.rollout_log_probs).abs(), samples.loss_mask
        )
        n = self.dp.all_reduce(torch.tensor([float(len(samples)), float(samples.reward.sum())]))
        metrics_extra["reward_mean"] = float(n[1] / n[0])
        # Truncated importance sampling: the tokens were drawn by the rollout's policy, which may be
        # a version behind the one PPO's ratio starts from (one-step-off training).
        tis_weight: torch.Tensor | None = None
        if alg.tis_cap is not None:
            raw = torch.exp(old_log_probs - samples.rollout_log_probs) * samples.response_mask
            tis_weight = raw.clamp(max=alg.tis_cap)
            metrics_extra["tis_weight_mean"] = self._masked_global_mean(tis_weight, samples.loss_mask)
            metrics_extra["tis_capped_fraction"] = self._masked_global_mean(
                (raw > alg.tis_cap).float(), samples.loss_mask
            )

        def micro_loss(rows: list[int], mb: MicroBatch, counts: Counts) -> dict[str, torch.Tensor]:
            mask = samples.loss_mask[rows].to(self.device)
            log_probs, entropy = self._policy(self.model, mb, with_entropy=True)
            assert entropy is not None
            terms = pm.policy_loss(
                log_probs,
                old_log_probs[rows].to(self.device),
                advantages[rows].to(self.device),
                alg.eps_clip,
                alg.eps_clip_high,
                alg.eps_clip_c,
            )
            token_loss = terms.loss if tis_weight is None else terms.loss * tis_weight[rows].to(self.device)
            pg_loss = self._aggregate(token_loss, mask, counts)
            # Aggregated like the loss it enters (verl's entropy metric is the same term).
            entropy_mean = self._aggregate(entropy, mask, counts)
            loss = pg_loss - alg.entropy_coef * entropy_mean if alg.entropy_coef > 0 else pg_loss
            out = {
                "pg_loss": pg_loss,
                "entropy": entropy_mean,
                "pg_clip_fraction": self._token_mean(terms.clip_fraction, mask, counts),
                "dual_clip_fraction": self._token_mean(terms.dual_clip_fraction, mask, counts),
                "ppo_kl": self._token_mean(terms.ppo_kl, mask, counts),
            }
            if alg.use_kl_loss:
                assert ref_log_probs is not None  # needs_reference holds when use_kl_loss
                kl_term = pm.kl_estimate(log_probs, ref_log_probs[rows].to(self.device), alg.kl_estimator)
                kl_loss = self._aggregate(kl_term, mask, counts)
                loss = loss + alg.kl_loss_coef * kl_loss
                out["kl_loss"] = kl_loss
            out["loss"] = loss
            return out

        return self._run_epochs(samples, micro_loss) | metrics_extra


def init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam/AdamW's state for every parameter now, as its first step would (zeros, step 0).

    The tensors are the ones ``torch.optim.Adam._init_group`` makes lazily (same dtype, device and
    memory format), so the training that follows is bit for bit the same; a parameter that already
    has state keeps it. The step after this finds the state present and skips its own creation.
    """
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise ValueError(f"init_adam_state: expected Adam or AdamW, got {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        fused = bool(group.get("fused"))
        on_device = bool(group.get("capturable")) or fused
        for p in group["params"]:
            state = optimizer.state[p]
            if len(state) != 0:
                continue
            if on_device:
                state["step"] = torch.zeros((), dtype=_scalar_dtype(fused), device=p.device)
            else:
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype(False), device="cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _scalar_dtype(fused: bool) -> torch.dtype:
    # torch.optim.optimizer._get_scalar_dtype: float32 for fused, else the default dtype's width.
    if fused:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
