"""A train phase run once on a dummy batch at start-up, then undone bit for bit.

A phase's first call pays for what later calls reuse: CUDA's lazily loaded kernels, cuBLAS handles
and workspaces, the caching allocator's segments, the optimizer's first step. :func:`warm_up` runs
the role's whole phase (``train_actor`` or ``train_critic``: scoring, forward, backward, clipping, the
optimizer step) on a batch of the run's shape, then puts back everything the phase changed:

- the trained parameters (copied back from a snapshot taken on the same device);
- the optimizer: its state tensors (made at setup, zeros and step 0: ``init_adam_state``) copied
  back in place, so the memory backend's tracked tensors stay the same objects, and each param
  group's learning rate restored. Warm-up runs before the first step and before a resume loads a
  saved state; a trainer that has taken a step is not warmed;
- gradients (None, as before any step), the model's train/eval mode, and the random state of
  Python, NumPy, torch's CPU generator and every CUDA device's generator.

So the first real step computes exactly what it computes without warm-up (``tests/test_phase_warm_up.py``
checks the step's metrics and the weights after it bit for bit). The torch backend only: a megatron
trainer is left unwarmed.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from ppo_trainer.backend import TorchTrainer
from ppo_trainer.backend_protocol import TrainerBackend
from ppo_trainer.batch import Samples

__all__ = ["dummy_samples", "warm_up"]


def dummy_samples(samples: int, prompt_tokens: int, response_tokens: int) -> Samples:
    """``samples`` samples of ``prompt_tokens`` + ``response_tokens`` tokens (token id 0, which every
    vocabulary has; the kernels do not depend on the ids), every response token in the loss."""
    if samples < 1 or prompt_tokens < 1 or response_tokens < 1:
        raise ValueError(
            f"a warm-up batch needs samples, prompt_tokens and response_tokens >= 1, got {samples}, "
            f"{prompt_tokens}, {response_tokens}"
        )
    n, r = samples, response_tokens
    return Samples.from_fields(
        {
            "tokens": [torch.zeros(prompt_tokens + r, dtype=torch.int64)] * n,
            "response_length": [torch.tensor([r])] * n,
            "loss_mask": [torch.ones(r)] * n,
            "reward": [torch.tensor([float(i % 2)]) for i in range(n)],
            "rollout_log_probs": [torch.full((r,), -1.0)] * n,
            "prompt_index": [torch.tensor([i // 2]) for i in range(n)],
        }
    )


def warm_up(trainer: TrainerBackend, samples: Samples, *, uses_critic: bool) -> float | None:
    """Run the role's train phase on ``samples`` and undo it (module docstring); the seconds it took,
    or None when the trainer is not warmed (not the torch backend, or optimizer state already held).
    ``uses_critic``: the actor's estimator takes the critic's values (zeros stand in for them)."""
    if not isinstance(trainer, TorchTrainer) or _has_stepped(trainer.optimizer):
        return None
    t0 = time.perf_counter()
    with _undone(trainer):
        trainer.set_step(1)
        if trainer.config.role == "critic":
            # off_policy_returns=vtrace: the rollout's log-probs stand in for the actor's (ratios of 1).
            trainer.train_critic(samples, samples.rollout_log_probs)
        else:
            zeros = torch.zeros(len(samples), samples.max_response)
            trainer.train_actor(samples, zeros if uses_critic else None, zeros if uses_critic else None)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
    return time.perf_counter() - t0


@contextmanager
def _undone(trainer: TorchTrainer) -> Iterator[None]:
    params = trainer.params
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
        state = {
            (p, k): v.detach().clone()
            for p, entries in trainer.optimizer.state.items()
            for k, v in entries.items()
            if isinstance(v, torch.Tensor)
        }
    lrs = [group["lr"] for group in trainer.optimizer.param_groups]
    modes = [(m, m.training) for m in trainer.model.modules()]
    rng = _random_state()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
            for (owner, k), v in state.items():
                trainer.optimizer.state[owner][k].copy_(v)
        del saved, state
        for group, lr in zip(trainer.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        for p in params:
            p.grad = None
        for module, training in modes:
            module.training = training
        _set_random_state(rng)
        if trainer.device.type == "cuda":
            # Back to what the allocator held before: the memory measured after start-up (the offload
            # order, ``offload.overlap``) is the same with and without warm-up.
            torch.cuda.empty_cache()


def _has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any parameter's optimizer state records a step (a resumed or trained trainer)."""
    return any(float(entries.get("step", 0)) > 0 for entries in optimizer.state.values())


def _random_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_random_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
