"""The PPO objective runs on any ModelBackend: it reaches the model through the protocol alone."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from ppo_trainer import objective
from ppo_trainer.backend import TorchTrainer
from ppo_trainer.backend_protocol import DataParallel, Forward, ModelBackend
from ppo_trainer.batch import MicroBatch, Samples
from ppo_trainer.config import AlgorithmConfig, TrainerConfig
from ppo_trainer.megatron_backend import MegatronTrainer


class ProtocolOnly:
    """A ``ModelBackend`` that forwards the protocol's members to a trainer and has nothing else."""

    def __init__(self, inner: TorchTrainer) -> None:
        self._inner = inner
        self.config: TrainerConfig = inner.config
        self.dp: DataParallel = inner.dp
        self.device: torch.device = inner.device

    @property
    def has_reference(self) -> bool:
        return self._inner.has_reference

    def forward(self, mb: MicroBatch, *, reference: bool = False, entropy: bool = False) -> Forward:
        return self._inner.forward(mb, reference=reference, entropy=entropy)

    def inference(self, reference: bool = False) -> AbstractContextManager[None]:
        return self._inner.inference(reference)

    def train_mode(self) -> None:
        self._inner.train_mode()

    def backward(self, loss: torch.Tensor) -> None:
        self._inner.backward(loss)

    def optimizer_step(self) -> float:
        return self._inner.optimizer_step()


def _actor(model: Path) -> TorchTrainer:
    alg = AlgorithmConfig(
        estimator="grpo", num_mini_batches=2, use_kl_loss=True, kl_loss_coef=0.1, tis_cap=2.0
    )
    return TorchTrainer(TrainerConfig(role="actor", model_path=str(model), algorithm=alg, micro_batch_size=2))


def test_the_actor_step_through_the_protocol_alone_is_the_trainers(
    tiny_model: Path, fields_factory: Callable
) -> None:
    samples = Samples.from_fields(fields_factory(6, seed=11))
    torch.manual_seed(0)
    direct = _actor(tiny_model)
    expected = direct.train_actor(samples, None)
    torch.manual_seed(0)
    inner = _actor(tiny_model)
    backend: ModelBackend = ProtocolOnly(inner)
    got = objective.train_actor(backend, samples, None)
    assert got == expected
    assert {"kl_loss", "tis_weight_mean", "grad_norm", "optimizer_steps"} <= got.keys()
    for (name, a), (_, b) in zip(direct.named_weights(), inner.named_weights(), strict=True):
        assert torch.equal(a, b), name


def test_the_backends_are_siblings() -> None:
    assert not issubclass(MegatronTrainer, TorchTrainer)
    assert not issubclass(TorchTrainer, MegatronTrainer)
