"""The two seams of a training backend: what the PPO objective drives, and what the worker drives.

``ModelBackend`` is what ``ppo_trainer.objective`` needs of a model to run the critic's and the
actor's steps: one ``forward`` over a micro-batch (log-probs and entropy, or values), training and
inference modes, ``backward``, ``optimizer_step``, and a data-parallel sum for its counts and metrics.
``TrainerBackend`` is what the worker, the checkpoint code and the weight update see: the PPO steps
(each backend runs them through the objective), weights and optimizer state in Hugging Face names and
whole tensors, the tensors the memory backend moves, and the lifecycle hooks.

``TorchTrainer`` (``backend.py``: transformers models, replicated or FSDP2) and ``MegatronTrainer``
(``megatron_backend.py``: megatron-core GPTModel with tensor and data parallelism) implement both;
``ppo_trainer.backends.make_trainer`` builds the one the config names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ppo_trainer import ppo_math as pm
from ppo_trainer import token_logprobs
from ppo_trainer.batch import MicroBatch, Samples
from ppo_trainer.config import TrainerConfig
from ppo_trainer.packing import PackedMicroBatch

# A micro-batch's model inputs: right-padded rows, or its samples back to back (train.pack_sequences).
Batch = MicroBatch | PackedMicroBatch

# The memory backend's region factory: allocations made under ``region(tag)`` carry that tag.
Region = Callable[[str], AbstractContextManager[None]]


def no_region(tag: str) -> AbstractContextManager[None]:
    """A ``Region`` that tags nothing (no memory backend)."""
    return contextlib.nullcontext()


@dataclass(frozen=True)
class DataParallel:
    """Where this rank sits and how to sum a tensor over all ranks (returns the sum, same device).

    ``shard_group`` (torch backend): shard the models with FSDP2 over the group it returns (called at
    construction and after every rebuild of the groups, so it must return the live one); None:
    replicate them.
    """

    rank: int = 0
    world_size: int = 1
    sum_fn: pm.AllReduce | None = None
    shard_group: Callable[[], dist.ProcessGroup] | None = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.sum_fn is None else self.sum_fn(tensor)


@dataclass(frozen=True)
class Forward:
    """A forward pass over a micro-batch, in response space ``[b, R_max]`` (padding columns hold
    whatever the model computed there; callers mask them): the policy's (or the reference's)
    ``log_probs`` of the response tokens and, when asked, its ``entropy``; or the critic's ``values``."""

    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode and no gradients inside; its previous mode after (a backend's
    ``inference``)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def scored_model(model: nn.Module, reference: nn.Module | None, want_reference: bool, role: str) -> nn.Module:
    """The model a forward runs: the trained ``model``, or the ``reference`` (``RuntimeError`` naming
    ``role`` when it holds none)."""
    if not want_reference:
        return model
    if reference is None:
        raise RuntimeError(f"{role}: no reference model is loaded")
    return reference


def policy_forward(logits: torch.Tensor, mb: MicroBatch, entropy: bool, chunk: int) -> Forward:
    """``Forward`` from a causal LM's logits ``[b, L, V]``: the logits that predict each response token,
    their log-prob of it and (``entropy``) their entropy, the float32 softmax ``chunk`` positions at a
    time (``token_logprobs``: never a float32 copy of all the logits)."""
    index = mb.logit_positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    picked = logits.gather(1, index)  # [b, R, V]
    log_probs, entropies = token_logprobs.chunked_logit_stats(picked, mb.targets, entropy, chunk)
    return Forward(log_probs=log_probs, entropy=entropies)


class ModelBackend(Protocol):
    """One rank's model and optimizer, as the PPO objective drives them."""

    config: TrainerConfig
    dp: DataParallel  # the ranks the objective's counts, metrics and whitening are summed over
    device: torch.device  # where micro-batches go

    @property
    def has_reference(self) -> bool:
        """Whether the frozen reference policy is loaded (``forward(..., reference=True)`` works)."""
        ...

    def forward(self, mb: Batch, *, reference: bool = False, entropy: bool = False) -> Forward:
        """The trained model's outputs over ``mb`` (the actor's log-probs, with ``entropy`` its entropy
        too; the critic's values), or the reference policy's log-probs. Differentiable in training."""
        ...

    def inference(self, reference: bool = False) -> AbstractContextManager[None]:
        """Forward passes without gradients: the model scored (the trained one or the reference) in
        eval mode inside; its previous mode, and nothing left gathered, after."""
        ...

    def train_mode(self) -> None:
        """The trained model in training mode, before a step's first micro-batch."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of a micro-batch's loss (already divided by the global count)."""
        ...

    def optimizer_step(self) -> float:
        """Reduce the gradients over data parallelism, clip, step, clear; the global gradient norm
        before clipping."""
        ...


class TrainerBackend(Protocol):
    """One rank of the actor or the critic, as the worker drives it."""

    WEIGHTS_TAG: str  # the memory backend's tags of the weights and of the optimizer state
    OPTIMIZER_TAG: str
    config: TrainerConfig
    dp: DataParallel
    # True when every rank must take part in ``named_weights`` and ``hf_state_dict`` (each tensor is
    # gathered by a collective: FSDP2 shards, tensor-parallel slices).
    sharded: bool
    # The construction's parts in seconds (``model``, ``optimizer``), for the run's start-up table.
    setup_seconds: dict[str, float]

    @property
    def layout(self) -> str:
        """How the role is parallelised, for logs: ``replicate``, ``fsdp2`` or ``megatron tp=T dp=D``."""
        ...

    def set_step(self, step: int) -> float:
        """Set the optimizer's learning rate for training step ``step`` (``lr_schedule``); returns it."""
        ...

    # The PPO steps (``ppo_trainer.objective``).
    def compute_log_probs(self, samples: Samples) -> torch.Tensor: ...

    def compute_values(self, samples: Samples) -> torch.Tensor: ...

    def token_rewards(self, samples: Samples) -> tuple[torch.Tensor, dict[str, float]]: ...

    def train_critic(
        self, samples: Samples, policy_log_probs: torch.Tensor | None = None
    ) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]: ...

    def train_actor(
        self, samples: Samples, values: torch.Tensor | None, rewards: torch.Tensor | None = None
    ) -> dict[str, float]: ...

    # Weights in Hugging Face names (whole tensors; collective when ``sharded``).
    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]: ...

    # What trains (under train.lora: the adapters), in the model's names: an adapter-only update.
    def trainable_weights(self, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]: ...

    # What the memory backend moves, and the lifecycle hooks.
    def weight_tensors(self) -> list[torch.Tensor]: ...

    def optimizer_tensors(self) -> list[torch.Tensor]: ...

    def optimizer_state_entries(self) -> int:
        """Parameters with optimizer state now (all of them from setup: it is created eagerly)."""
        ...

    def release_gathered(self) -> None:
        """Before sleeping: drop whatever is held outside the tracked tensors."""
        ...

    def after_groups_rebuilt(self) -> None:
        """After waking: point the backend at the rebuilt process groups."""
        ...

    # Checkpoints: the model's state in Hugging Face names, whole tensors (collective when sharded;
    # megatron: on every rank, the float32 main weights gathered over its data-parallel shards).
    def hf_state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor]) -> None: ...

    # The optimizer in ``optimizer.pt``'s format (``checkpoint.optimizer_format``): AdamW's state dict
    # keyed by Hugging Face name, whole tensors. Every rank calls both (collectives on sharded layouts);
    # rank 0 gets the whole dict from ``hf_optimizer_state``, every rank passes it to the load.
    def hf_optimizer_state(self) -> dict[str, Any]: ...

    def load_hf_optimizer_state(self, state: Mapping[str, Any]) -> None: ...
