"""The torch backend: one data-parallel rank's transformers model and AdamW, under the PPO objective.

``TorchTrainer`` knows nothing about Ray or the lifecycle: it takes a ``DataParallel`` (rank, world size
and a sum all-reduce) and a ``region`` context factory under which it allocates weights and optimizer
state (torch_memory_saver tags them; other memory backends ignore it). The Ray worker wires both. The
PPO steps are ``ppo_trainer.objective``'s; this class is the ``ModelBackend`` they run on.

Data parallelism comes in two kinds (``DataParallel.shard_group``):

- replication: every rank holds the whole model; after the micro-batches of one mini-batch, the
  gradients are summed over ranks in one flat buffer;
- FSDP2 (``ppo_trainer.sharding``): each rank holds a shard of every parameter, gradient and AdamW
  state; FSDP reduce-scatters the gradients after each backward.

The objective divides losses by the global mini-batch's count, so the sum over ranks is the gradient of
the global mean (on CUDA, up to bf16 rounding: FSDP computes with bf16 copies of the parameters where
the replicated path autocasts). FSDP averages what it reduces, so the sharded backward scales the loss
by the group size to get that sum. Sharded, every forward and backward is a collective, so all ranks
must hold the same number of samples (checked, ``ValueError`` otherwise).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from ppo_trainer import converters, critic_init, objective, packing, sharding
from ppo_trainer.backend_protocol import (
    Batch,
    DataParallel,
    Forward,
    Region,
    evaluating,
    no_region,
    policy_forward,
    scored_model,
)
from ppo_trainer.batch import Samples
from ppo_trainer.checkpoint import torch_optimizer
from ppo_trainer.config import TrainerConfig
from ppo_trainer.converters import lora
from ppo_trainer.lr_schedule import set_scheduled_lr
from ppo_trainer.models import (
    CriticModel,
    load_causal_lm,
    load_critic,
    load_reference,
    map_policy_state_to_critic,
)
from ppo_trainer.shared_base import (
    SharedBase,
    SharedBaseHandle,
    frozen_parameters,
    return_freed_host_memory,
)


class TorchTrainer:
    """One rank of the actor or the critic: model, optimizer, reference model (actor with a KL term)."""

    WEIGHTS_TAG = "weights"
    OPTIMIZER_TAG = "optimizer"

    def __init__(
        self,
        config: TrainerConfig,
        dp: DataParallel | None = None,
        region: Region | None = None,
        *,
        publish_base: bool = False,
        base: SharedBaseHandle | None = None,
    ):
        """``publish_base`` (a LoRA actor): hold the frozen base in a buffer another process can map
        (``shared_base``); ``base`` (a LoRA critic): map that buffer instead of holding a copy."""
        self.config = config
        self.dp = dp or DataParallel()
        self.region: Region = region or no_region
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if config.device == "cuda"
            else torch.device("cpu")
        )
        self.autocast_dtype = torch.bfloat16 if config.compute_dtype == "bfloat16" else None
        self.sharded = self.dp.shard_group is not None
        started = time.perf_counter()
        # With adapters on the actor, the reference is the same model with them off: no copy.
        self.shares_reference = config.role == "actor" and config.lora_applies
        self.model, self.reference = self._load_models()
        # The class transformers writes into config.json; FSDP renames the class it wraps.
        self.architecture = type(self.model).__name__
        # FSDP averages gradients over its group; the losses are already divided by the global count.
        self._loss_scale = 1.0
        with self.region(self.WEIGHTS_TAG):
            group = self.dp.shard_group() if self.dp.shard_group is not None else None
            self.converters = self._converters(group, trained=True)
            self.model = converters.apply(self.converters, self.model)
            if self.reference is not None:
                self.reference = converters.apply(self._converters(group, trained=False), self.reference)
        if group is not None:
            self._loss_scale = float(group.size())
        # Outside the memory backend's regions: the shared base is never released by a sleep.
        self.shared_base = self._share_base(publish_base, base)
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
            torch_optimizer.init_adam_state(self.optimizer)
        # What the worker reports of its start-up: loading (and sharding) the models, the optimizer.
        self.setup_seconds = {"model": built - started, "optimizer": time.perf_counter() - built}

    def _share_base(self, publish: bool, handle: SharedBaseHandle | None) -> SharedBase | None:
        """The actor publishes its frozen parameters; the critic binds its frozen backbone (and its
        reference model, with reward-level KL) to them (``ppo_trainer.shared_base``)."""
        role = self.config.role
        if not (publish or handle is not None):
            return None
        wanted = "actor" if publish else "critic"
        if (publish and handle is not None) or role != wanted or not self.config.lora_applies:
            raise ValueError(
                f"train.lora.share_base: the {wanted} {'publishes' if publish else 'maps'} the base and both "
                f"roles must train with LoRA; this is the {role} with train.lora.roles="
                f"{self.config.lora.roles if self.config.lora else None}; set share_base=false"
            )
        if handle is None:
            shared = SharedBase.publish(self.model)
            if self.device.type == "cpu":
                return_freed_host_memory()
            return shared
        shared = SharedBase.attach(handle)
        # The critic's backbone is the causal LM's base model: backbone.<x> is <prefix>.<x> there.
        prefix = getattr(self.model.get_submodule("backbone"), "base_model_prefix", "")
        owner = {t.name for t in handle.tensors}
        names = {n: f"{prefix}.{n.removeprefix('backbone.')}" for n, _ in frozen_parameters(self.model)}
        # The reference (reward-level KL) is the actor's causal LM: the same names, the whole base.
        names_ref = {n: n for n, _ in frozen_parameters(self.reference)} if self.reference is not None else {}
        unknown = [theirs for theirs in (*names.values(), *names_ref.values()) if theirs not in owner]
        if unknown:
            raise ValueError(
                f"train.lora.share_base: the actor holds no frozen {unknown[:3]}; both roles must load "
                "the same model_path and train.lora.target_modules, or set train.lora.share_base=false"
            )
        shared.bind(self.model, names)
        if self.reference is not None:
            shared.bind(self.reference, names_ref)
        if self.device.type == "cpu":
            return_freed_host_memory()  # the critic's own copy of the base, just dropped
        return shared

    def _converters(
        self, group: dist.ProcessGroup | None, *, trained: bool
    ) -> list[converters.ModelConverter]:
        # Sharded, the trained model computes in the autocast dtype's copies; the reference keeps its own.
        return converters.for_model(
            self.config,
            trained=trained,
            shard_group=group,
            device_type=self.device.type,
            param_dtype=self.autocast_dtype if trained else None,
        )

    def _load_models(self) -> tuple[nn.Module, nn.Module | None]:
        """The trained model and, when this role needs it, the frozen reference, on their device."""
        config = self.config
        # Sharded, the models stay in host memory until fully_shard moves them one block at a time:
        # the device never holds a whole model, only the shards and the block being split.
        load_to = torch.device("cpu") if self.sharded else self.device
        reference: nn.Module | None = None
        with self.region(self.WEIGHTS_TAG):
            model: nn.Module
            if config.role == "actor":
                model = nn.Module.to(load_causal_lm(config.model_path, config.seed), load_to)
            else:
                model = self._load_critic().to(load_to)
            # Reward-level KL: the critic holds the reference (it shapes the rewards before anyone
            # trains); the KL loss term: the actor does.
            if config.algorithm.reference_for(config.role) and not self.shares_reference:
                ref_dtype = torch.bfloat16 if self.autocast_dtype is not None else torch.float32
                reference = nn.Module.to(load_reference(config.model_path, config.seed, ref_dtype), load_to)
        if self.device.type == "cpu":
            # from_pretrained maps safetensors files into memory; give every tensor its own resizable
            # storage so the memory backend can release and restore it.
            with torch.no_grad():
                for module in (model, reference):
                    for t in [] if module is None else [*module.parameters(), *module.buffers()]:
                        t.data = t.data.clone()
        return model, reference

    def _load_critic(self) -> CriticModel:
        """The critic from ``model_path``, or from ``critic_init_from``'s value model (its backbone and
        head over the architecture of ``model_path``; ``ppo_trainer.critic_init``)."""
        config = self.config
        if config.critic_init_from is None:
            return load_critic(config.model_path, config.seed)
        critic = load_critic(config.model_path, config.seed, weights=False)
        critic_init.load_into(critic, config.critic_init_from)
        return critic

    def _models(self) -> list[nn.Module]:
        """The trained model and, with a KL term, the frozen reference."""
        return [m for m in (self.model, self.reference) if m is not None]

    # ------------------------------------------------------------------ tensors the lifecycle moves
    def weight_tensors(self) -> list[torch.Tensor]:
        """What the memory backend moves for the weights (the local shards when sharded)."""
        tensors = [t for m in self._models() for t in [*(p.data for p in m.parameters()), *m.buffers()]]
        if self.shared_base is not None:  # resident while either role sleeps: nothing to move
            tensors = [t for t in tensors if not self.shared_base.holds(t)]
        return [t for t in sharding.local_tensors(tensors) if t.device.type == self.device.type]

    def maps_shared(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in the base another process owns (this role must not write it)."""
        return self.shared_base is not None and not self.shared_base.owner and self.shared_base.holds(tensor)

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
        # keep_vars: tied weights come back as the same Parameter under each name (gathered once).
        state = iter(self.model.state_dict(keep_vars=True).items())
        for name, tensor in converters.export(self.converters, state, dtype):
            tensor = tensor.detach()
            yield name, tensor if dtype is None else tensor.to(dtype)

    def trainable_weights(self, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
        """The parameters that train (under ``train.lora``: the adapters, whose names are the model's,
        ``<module path>.lora_A.weight`` and ``.lora_B.weight``), copies in ``dtype``: what an
        adapter-only update sends, since every other tensor stays as the engine first loaded it."""
        if self.sharded:
            raise ValueError(
                "an adapter-only weight update needs replicated training (train.lora refuses fsdp2)"
            )
        return [
            (name, p.detach().to(dtype, copy=True))
            for name, p in self.model.named_parameters()
            if p.requires_grad
        ]

    @property
    def lora(self) -> lora.LoRAConverter | None:
        """The LoRA converter of the trained model (None: every weight trains)."""
        found = [c for c in self.converters if isinstance(c, lora.LoRAConverter)]
        return found[0] if found else None

    def export_state(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole tensors in the trained model's names (a captured ``state_dict``) as ``named_weights``
        exports them: Hugging Face names, adapters merged into their base weights."""
        return dict(converters.export(self.converters, iter(state.items()), None))

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
                    if not self.maps_shared(own[name]):  # the owner writes the shared base
                        own[name].data.copy_(tensor)

    def hf_optimizer_state(self) -> dict[str, Any]:
        """AdamW's state keyed by name, whole tensors (``optimizer.pt``'s format; sharded: gathered to
        rank 0 by a collective, the other ranks get an empty dict)."""
        return torch_optimizer.named_state(self.model, self.optimizer, self.sharded)

    def load_hf_optimizer_state(self, state: Mapping[str, Any]) -> None:
        """An ``optimizer.pt`` dict of either backend into AdamW (every rank passes the whole dict), in
        the tensors it holds (the memory backend tracks them)."""
        with self.region(self.OPTIMIZER_TAG):
            torch_optimizer.load_state(self.model, self.optimizer, state, self.sharded)

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

    # ------------------------------------------------------------------ the PPO steps (objective)
    def compute_log_probs(self, samples: Samples) -> torch.Tensor:
        """Log-probs of the response tokens under the current policy, ``[N, R_max]`` (0 on padding)."""
        self._require_even_split(samples)
        return objective.score(self, samples)

    def compute_values(self, samples: Samples) -> torch.Tensor:
        """Critic values before each response token, ``[N, R_max]`` (0 on padding)."""
        self._require_even_split(samples)
        return objective.score(self, samples)

    def token_rewards(self, samples: Samples) -> tuple[torch.Tensor, dict[str, float]]:
        """``objective.token_rewards``: outcome rewards minus ``kl_coef`` times the reference KL."""
        return objective.token_rewards(self, samples)

    def train_critic(
        self, samples: Samples, policy_log_probs: torch.Tensor | None = None
    ) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        """``objective.train_critic``: ``(metrics, old_values, token_rewards)``; ``policy_log_probs``: the
        actor's, for ``off_policy_returns: vtrace``."""
        self._require_even_split(samples)
        return objective.train_critic(self, samples, policy_log_probs)

    def train_actor(
        self, samples: Samples, values: torch.Tensor | None, rewards: torch.Tensor | None = None
    ) -> dict[str, float]:
        """``objective.train_actor`` on the critic's ``values`` and ``rewards`` (or GRPO's advantages)."""
        self._require_even_split(samples)
        return objective.train_actor(self, samples, values, rewards)

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

    # ------------------------------------------------------------------ the objective's ModelBackend
    @property
    def has_reference(self) -> bool:
        return self.reference is not None or self.shares_reference

    def _autocast(self) -> ContextManager[object]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def forward(self, mb: Batch, *, reference: bool = False, entropy: bool = False) -> Forward:
        """The actor's (or the reference's) log-probs and entropy, or the critic's values, over ``mb``."""
        if isinstance(mb, packing.PackedMicroBatch):
            return self._packed_forward(mb, reference, entropy)
        if self.config.role == "critic" and not reference:
            with self._autocast():
                values = self.model(mb.input_ids, mb.attention_mask)  # [b, L]
            return Forward(values=values.float().gather(1, mb.logit_positions))
        model = self._scored(reference)
        with self._autocast(), self._as_reference(reference):
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
        return policy_forward(logits, mb, entropy, self.config.logprob_chunk_tokens)

    def _packed_forward(self, mb: packing.PackedMicroBatch, reference: bool, entropy: bool) -> Forward:
        """``forward`` over samples packed back to back: no compute on padding, the LM head in chunks."""
        with self._autocast(), self._as_reference(reference):
            if self.config.role == "critic" and not reference:
                return Forward(values=packing.value_forward(self.model, mb))
            log_probs, entropies = packing.policy_forward(
                self._scored(reference), mb, entropy, self.config.logprob_chunk_tokens
            )
        return Forward(log_probs=log_probs, entropy=entropies)

    @contextlib.contextmanager
    def inference(self, reference: bool = False) -> Iterator[None]:
        with evaluating(self._scored(reference)):
            yield
        self.release_gathered()  # FSDP keeps what a forward without backward gathered

    def _scored(self, reference: bool) -> nn.Module:
        if reference and self.shares_reference:
            return self.model
        return scored_model(self.model, self.reference, reference, self.config.role)

    def _as_reference(self, reference: bool) -> ContextManager[object]:
        """Inside: the shared model computes as the reference (adapters off) when ``reference``."""
        if reference and self.shares_reference:
            return lora.adapters_disabled(self.model)
        return contextlib.nullcontext()

    def train_mode(self) -> None:
        self.model.train()

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self._loss_scale).backward()

    def set_step(self, step: int) -> float:
        """The learning rate of training step ``step`` (``lr_schedule``) into every param group."""
        return set_scheduled_lr(self.config, step, self.optimizer.param_groups)

    def optimizer_step(self) -> float:
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
