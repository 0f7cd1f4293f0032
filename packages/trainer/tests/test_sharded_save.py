"""Background saves of sharded (FSDP2) roles: real 2-rank gloo groups on a local Ray instance.

The checkpoint of an asleep FSDP2 role is written from each rank's host copies of its shards, gathered
to rank 0 over the role's save group: the same bytes as the foreground save (which wakes the role and
gathers with torch.distributed.checkpoint), a bit-identical resume into sharded and replicated ranks,
and nothing committed when a rank dies mid-save (nor a wait for the living ranks' clean shutdown).
Shapes are uneven on purpose: a vocabulary of 17 rows (9 + 8 over two ranks) with tied embeddings in
the actor, and the critic's value head of one row (rank 1 holds an empty shard).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from conftest import critic_pieces, make_fields, save_tiny_llama
from safetensors import safe_open
from safetensors.torch import load_file

from ppo_trainer.config import AlgorithmConfig, TrainerConfig
from ppo_trainer.group import LocalSlots, TrainGroup
from ppo_value_transport import pack_fields, unpack_fields

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("ray_session")]

ALGORITHM = AlgorithmConfig(lam=1.0, gamma=1.0, entropy_coef=0.0, num_mini_batches=1)
ODD_VOCAB = 17


def config(model: Path, role: str, data_parallel: str = "fsdp2") -> TrainerConfig:
    return TrainerConfig(
        role=role,  # type: ignore[arg-type]
        model_path=str(model),
        algorithm=ALGORITHM,
        actor_lr=1e-3,
        critic_lr=1e-3,
        micro_batch_size=3,
        data_parallel=data_parallel,  # type: ignore[arg-type]
        memory_backend="host",
    )


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Embedding rows that do not split evenly over two ranks, tied to the output layer.
    folder = tmp_path_factory.mktemp("odd_llama")
    return save_tiny_llama(folder, tie_word_embeddings=True, vocab_size=ODD_VOCAB)


@pytest.fixture(scope="module")
def roles(odd_model: Path, ray_session: None) -> Iterator[dict[str, TrainGroup]]:
    """A 2-rank FSDP2 actor and critic, and a 1-rank replicated actor (resume across kinds)."""
    specs = {
        "actor": ("actor", 2, config(odd_model, "actor")),
        "critic": ("critic", 2, config(odd_model, "critic")),
        "actor_one": ("actor", 1, config(odd_model, "actor", "replicate")),
    }
    # Five workers start at once: test_workers.py's wait, for a loaded machine (120 s was too short
    # at load average 10 on 2 cores).
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {
            key: pool.submit(TrainGroup, role, LocalSlots(n), cfg, timeout_s=240)
            for key, (role, n, cfg) in specs.items()
        }
        made = {key: f.result() for key, f in futures.items()}
    yield made
    for group in made.values():
        group.shutdown()


def halves(seed: int) -> list[dict[str, list[torch.Tensor]]]:
    fields = make_fields(8, seed)
    return [{k: v[:4] for k, v in fields.items()}, {k: v[4:] for k, v in fields.items()}]


def step(actor: TrainGroup, critic: TrainGroup, n: int, seed: int, offload: bool) -> None:
    """One PPO step on 2 ranks; with ``offload`` each role is woken for its phase and sleeps after."""
    parts = halves(seed)
    boxes = [pack_fields(h) for h in parts]
    if offload:
        critic.wake_up()
    values = critic.train(n, boxes).values
    assert values is not None
    if offload:
        critic.sleep()
        actor.wake_up()
    per_rank = [unpack_fields(v)["values"] for v in values]
    actor.train(n, boxes, critic_pieces(parts, per_rank))
    if offload:
        actor.sleep()


def same_files(first: Path, second: Path, ranks: int = 2, skip: tuple[str, ...] = ()) -> None:
    names = sorted(str(p.relative_to(first)) for p in first.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(second)) for p in second.rglob("*") if p.is_file())
    names = [name for name in names if name not in skip]
    assert {
        "model.safetensors",
        "optimizer.pt",
        "trainer_state.json",
        f"rng_rank{ranks - 1}.safetensors",
    } <= set(names)
    for name in names:
        if Path(name).name.startswith("rng_rank"):  # safetensors writes metadata in hash order
            assert _rng(first / name) == _rng(second / name), name
        else:
            assert (first / name).read_bytes() == (second / name).read_bytes(), name


def _rng(path: Path) -> tuple[dict[str, str], dict[str, list[int]]]:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata(), {k: f.get_tensor(k).tolist() for k in f.keys()}  # noqa: SIM118


def save_from_a_private_copy(worker: Any, folder: str) -> bool:
    """On one rank of an asleep role: a background save that copies the host copies first
    (``copy_first``, as with the pinned backends), which are zeroed once it no longer reads them."""
    from ppo_trainer.checkpoint import sharded
    from ppo_trainer.checkpoint.background import BackgroundSave

    memory = worker._memory
    calls: list[int] = []
    host_copies = memory.host_copies
    memory.host_copies = lambda tensors: calls.append(len(tensors)) or host_copies(tensors)
    state = sharded.capture_shards(worker.trainer, worker._last_step, memory, worker._checkpoints.save_group)
    del memory.host_copies  # the backend's own method again
    # One call for every shard: each call indexes every host copy the backend holds.
    if len(calls) != 1:
        raise AssertionError(f"capture_shards asked the backend {len(calls)} times: {calls}")
    save = BackgroundSave(state, Path(folder), copy_first=True)
    save.wait_reading(60)
    tensors = [t for t in worker.trainer.weight_tensors() + worker.trainer.optimizer_tensors() if t.numel()]
    for copy in memory.host_copies(tensors):
        copy.zero_()
    return save.result(60) > 0


def test_an_asleep_sharded_role_is_saved_with_the_bytes_of_a_foreground_save(
    roles: dict[str, TrainGroup], tmp_path: Path
) -> None:
    actor, critic = roles["actor"], roles["critic"]
    assert (actor.data_parallel, critic.data_parallel) == ("fsdp2", "fsdp2")
    assert actor.saves_asleep
    assert critic.saves_asleep
    step(actor, critic, 1, seed=11, offload=False)
    for name, group in (("actor", actor), ("critic", critic)):
        group.save(tmp_path / "fg" / name)
        group.sleep()
        started = group.save_async(tmp_path / "bg" / name)
        assert started["bytes"] > 0
        assert group.save_wait() > 0
        assert group.is_asleep()  # written without waking the role
        # The pinned backends' writers copy the host copies first: from then on the buffers may be
        # overwritten (here: zeroed) by the next sleep without changing the checkpoint.
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        copied = str(tmp_path / "copied" / name)
        refs = [w.__ray_call__.remote(save_from_a_private_copy, copied) for w in group.workers]
        assert all(ray.get(refs, timeout=120))
        group.wake_up()
        same_files(tmp_path / "fg" / name, tmp_path / "bg" / name)
        same_files(tmp_path / "fg" / name, tmp_path / "copied" / name)
        group.load(tmp_path / "fg" / name)  # the state the zeroed host copies held
    # Whole tensors of the uneven shapes, the tied embedding written once.
    model = load_file(str(tmp_path / "bg" / "actor" / "model.safetensors"))
    assert model["model.embed_tokens.weight"].shape == (ODD_VOCAB, 32)
    assert "lm_head.weight" not in model
    critic_model = load_file(str(tmp_path / "bg" / "critic" / "model.safetensors"))
    assert critic_model["value_head.weight"].shape == (1, 32)
    optimizer = torch.load(tmp_path / "bg" / "actor" / "optimizer.pt", weights_only=True)
    assert optimizer["state"]["model.embed_tokens.weight"]["exp_avg"].shape == (ODD_VOCAB, 32)


def test_resume_from_a_sharded_background_save_is_bit_identical_in_either_kind(
    roles: dict[str, TrainGroup], tmp_path: Path
) -> None:
    actor, critic, one = roles["actor"], roles["critic"], roles["actor_one"]
    step(actor, critic, 1, seed=21, offload=True)
    saved = actor.weights_checksum()  # wakes, sums, sleeps again
    actor.save_async(tmp_path / "actor")
    critic.save_async(tmp_path / "critic")
    # The loop goes on while the writers run: the next step wakes, trains and sleeps both roles.
    step(actor, critic, 2, seed=22, offload=True)
    actor.save_wait()
    critic.save_wait()
    first = (actor.weights_checksum(), critic.weights_checksum())

    actor.wake_up()
    critic.wake_up()
    step(actor, critic, 3, seed=23, offload=False)  # move away, then come back
    actor.load(tmp_path / "actor")
    critic.load(tmp_path / "critic")
    assert actor.weights_checksum() == saved
    step(actor, critic, 2, seed=22, offload=False)
    assert (actor.weights_checksum(), critic.weights_checksum()) == first

    one.wake_up()
    one.load(tmp_path / "actor")  # a sharded background checkpoint into a replicated rank
    assert one.weights_checksum() == saved


def test_a_rank_that_dies_mid_save_leaves_nothing_to_commit_nor_stalls_the_shutdown(
    odd_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    group = TrainGroup("actor", LocalSlots(2), config(odd_model, "actor"), timeout_s=60)
    try:
        group.sleep()
        staging = tmp_path / "actor.partial"
        # Rank 0's writer starts and waits for rank 1's shards, which never come: rank 1 dies.
        ref = group.workers[0].save_async.remote(str(staging))
        assert ray.get(ref, timeout=60)["bytes"] > 0
        ray.kill(group.workers[1])
        with pytest.raises(ray.exceptions.RayTaskError, match=r"save group rank 0: .* did not complete"):
            ray.get(group.workers[0].save_wait.remote(), timeout=120)
        assert not (staging / "model.safetensors").exists()
        assert not (tmp_path / "actor").exists()  # never renamed into place, so never marked COMPLETE
        # Later saves on that group are refused rather than mixed with the failed one's messages.
        ray.get(group.workers[0].save_async.remote(str(staging)), timeout=60)
        with pytest.raises(ray.exceptions.RayTaskError, match="unusable since an earlier save"):
            ray.get(group.workers[0].save_wait.remote(), timeout=60)

        # Rank 0's wake waits for rank 1 in the new process group's rendezvous (up to the group's 60 s),
        # and its shutdown call queues behind it. The group's shutdown sees rank 1's call fail and kills
        # both at once rather than wait 30 s for rank 0.
        workers = list(group.workers)
        blocked = workers[0].wake_up.remote()
        assert ray.wait([blocked], timeout=1.0)[1] == [blocked]
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="ppo_trainer.group"):
            group.shutdown()
        assert time.monotonic() - started < 10
        assert "actor group: rank 1's shutdown failed" in caplog.text
        assert "the other ranks were killed without a clean shutdown" in caplog.text
        for ref in (blocked, *(w.is_asleep.remote() for w in workers)):
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(ref, timeout=30)
        group.shutdown()  # a second call does nothing
    finally:
        group.shutdown()


def test_a_one_rank_sharded_role_is_saved_asleep_without_a_gather(odd_model: Path, tmp_path: Path) -> None:
    # FSDP2 over one rank (what one GPU allows): the writer's pieces are whole tensors already and are
    # written as they are; the files equal the foreground save's (hf/ holds the same weights).
    group = TrainGroup("actor", LocalSlots(1), config(odd_model, "actor"), timeout_s=120)
    try:
        assert group.data_parallel == "fsdp2"
        group.save(tmp_path / "fg")
        group.sleep()
        assert group.save_async(tmp_path / "bg")["bytes"] > 0
        assert group.save_wait() > 0
        assert group.is_asleep()
        same_files(tmp_path / "fg", tmp_path / "bg", ranks=1, skip=("hf/model.safetensors",))
        # hf/: the background save writes the tied output layer as a tensor of its own, as it does for
        # several ranks; torch.distributed.checkpoint hands one rank's tied names one tensor, which
        # save_pretrained then writes once. The same weights either way.
        fg, bg = (
            load_file(str(tmp_path / "fg" / "hf" / "model.safetensors")),
            load_file(str(tmp_path / "bg" / "hf" / "model.safetensors")),
        )
        assert set(bg) - set(fg) == {"lm_head.weight"}
        assert torch.equal(bg["lm_head.weight"], fg["model.embed_tokens.weight"])
        assert all(torch.equal(bg[name], tensor) for name, tensor in fg.items())
    finally:
        group.shutdown()
