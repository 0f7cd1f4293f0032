"""A checkpoint shard written in the background from the host copies of a sleep: the same bytes as
a foreground save, and (with ``copy_first``) independent of the buffers once they were copied."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_llama
from safetensors import safe_open

from ppo_lifecycle.memory.host import HostMemoryBackend
from ppo_trainer.backend import TorchTrainer
from ppo_trainer.batch import Samples
from ppo_trainer.checkpoint import torch_io
from ppo_trainer.checkpoint.background import BackgroundSave
from ppo_trainer.config import AlgorithmConfig, TrainerConfig


def _files(folder: Path) -> dict[str, object]:
    """Each file's bytes; an RNG file's tensors and metadata (safetensors writes metadata in hash order)."""
    return {str(p.relative_to(folder)): _content(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def _content(path: Path) -> object:
    if not path.name.startswith("rng_rank"):
        return path.read_bytes()
    with safe_open(str(path), framework="pt") as f:
        return f.metadata(), {k: f.get_tensor(k).tolist() for k in f.keys()}  # noqa: SIM118


def _trained_actor(
    tmp_path: Path, fields_factory: Callable, memory: HostMemoryBackend, *, tied: bool = False
) -> TorchTrainer:
    """A tiny actor after one training step (its AdamW state exists), tracked by ``memory`` as a
    worker tracks it."""
    model = save_tiny_llama(tmp_path / "model", tie_word_embeddings=tied)
    config = TrainerConfig(
        role="actor", model_path=str(model), algorithm=AlgorithmConfig(lam=1.0, num_mini_batches=1)
    )
    trainer = TorchTrainer(config)
    samples = Samples.from_fields(fields_factory(4, seed=3))
    trainer.train_actor(samples, torch.zeros(len(samples), samples.max_response))
    memory.track(trainer.WEIGHTS_TAG, trainer.weight_tensors)
    memory.track(trainer.OPTIMIZER_TAG, trainer.optimizer_tensors)
    return trainer


@pytest.mark.parametrize("tied", [False, True])
def test_background_shard_has_the_bytes_of_a_foreground_one(
    tmp_path: Path, fields_factory: Callable, tied: bool
) -> None:
    memory = HostMemoryBackend()
    trainer = _trained_actor(tmp_path, fields_factory, memory, tied=tied)

    torch_io.save_shard(trainer, tmp_path / "fg", step=7)
    memory.release()
    direct = BackgroundSave(torch_io.capture(trainer, 7, host=memory), tmp_path / "direct")
    assert direct.result(60) > 0
    state = torch_io.capture(trainer, 7, host=memory)
    copied = BackgroundSave(state, tmp_path / "copied", copy_first=True)
    copied.wait_reading(60)
    # A pinned backend's next sleep writes new bytes into the same buffers: the writer holds its copy.
    assert state.model is not None
    assert state.optimizer is not None
    for tensor in state.model.values():
        tensor.zero_()
    for values in state.optimizer["state"].values():
        for value in values.values():
            value.zero_()
    assert copied.result(60) > 0
    expected = _files(tmp_path / "fg")
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json", "hf/config.json"} <= set(expected)
    assert _files(tmp_path / "copied") == expected
    assert _files(tmp_path / "direct") == expected


class CountingHost(HostMemoryBackend):
    """The host backend, counting ``host_copies`` calls (each one indexes every host copy it holds)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def host_copies(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self.calls += 1
        return super().host_copies(tensors)


def test_capture_reads_every_host_copy_in_one_call(tmp_path: Path, fields_factory: Callable) -> None:
    memory = CountingHost()
    trainer = _trained_actor(tmp_path, fields_factory, memory)
    expected = torch_io.private_copy(torch_io.capture(trainer, 3))  # the release frees the originals
    memory.release()
    state = torch_io.capture(trainer, 3, host=memory)
    assert memory.calls == 1  # not one per parameter: the cost grew with the square of their count
    assert state.model is not None
    assert expected.model is not None
    assert state.optimizer is not None
    assert expected.optimizer is not None
    assert state.model.keys() == expected.model.keys()
    for name, tensor in expected.model.items():
        assert torch.equal(state.model[name], tensor), name
    assert state.optimizer["state"].keys() == expected.optimizer["state"].keys()
    for name, values in expected.optimizer["state"].items():
        for key, value in values.items():
            assert torch.equal(
                torch.as_tensor(state.optimizer["state"][name][key]), torch.as_tensor(value)
            ), (name, key)


def test_private_copy_keeps_tied_tensors_tied_and_owns_its_memory() -> None:
    buffer = torch.arange(32, dtype=torch.float32)
    weight = buffer[:16].view(4, 4)
    state = torch_io.ShardState(
        rank=0,
        rng=({}, {}),
        model={"embed": weight, "head": weight, "other": buffer[16:]},
        optimizer={"state": {"embed": {"exp_avg": buffer[16:]}}, "param_groups": []},
    )
    copied = torch_io.private_copy(state)
    assert copied.model is not None
    assert copied.optimizer is not None
    assert copied.model["embed"] is copied.model["head"]  # one copy for the tied pair
    assert copied.optimizer["state"]["embed"]["exp_avg"] is copied.model["other"]
    buffer.zero_()
    assert copied.model["embed"].sum().item() == sum(range(16))
    assert copied.model["other"].untyped_storage().nbytes() == 16 * 4
