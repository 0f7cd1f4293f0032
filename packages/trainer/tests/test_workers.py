"""Actor and critic TrainGroups on a local Ray instance, with real gloo process groups, the host memory
backend, a Ray engine receiving weights, and checkpoints on disk."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from conftest import critic_pieces, same_split
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from ppo_testsupport import listening_addresses
from ppo_trainer.config import AlgorithmConfig, TrainerConfig
from ppo_trainer.group import LocalSlots, TrainGroup
from ppo_value_transport import (
    Box,
    MissingValuesError,
    pack,
    pack_fields,
    pair_values,
    unpack,
    unpack_fields,
)
from ppo_weight_sync import DestroyRequest, EngineReply, InitRequest, RayEngineEndpoint, checksum
from ppo_weight_sync.testing.engine import TensorEngine

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("ray_session")]

ALGORITHM = AlgorithmConfig(lam=1.0, gamma=1.0, entropy_coef=0.0, num_mini_batches=1)


def configs(model: Path, **overrides: Any) -> tuple[TrainerConfig, TrainerConfig]:
    actor = TrainerConfig(
        role="actor",
        model_path=str(model),
        algorithm=ALGORITHM,
        actor_lr=1e-3,
        micro_batch_size=3,
        **overrides,
    )
    critic = TrainerConfig(
        role="critic",
        model_path=str(model),
        algorithm=ALGORITHM,
        critic_lr=1e-3,
        micro_batch_size=3,
        **overrides,
    )
    return actor, critic


@pytest.fixture(scope="module")
def initial(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the module's groups save their state before any training."""
    return tmp_path_factory.mktemp("initial")


@pytest.fixture(scope="module")
def all_groups(tiny_model: Path, ray_session: None, initial: Path) -> Iterator[dict[str, TrainGroup]]:
    """A 1-rank actor, a 1-rank critic, a 2-rank actor, a 2-rank FSDP2 actor and a 2-rank critic,
    started together (worker start-up dominates)."""
    actor_cfg, critic_cfg = configs(tiny_model)
    fsdp_cfg, _ = configs(tiny_model, data_parallel="fsdp2")
    specs = {
        "actor": ("actor", 1, actor_cfg),
        "critic": ("critic", 1, critic_cfg),
        "actor2": ("actor", 2, actor_cfg),
        "actor_fsdp": ("actor", 2, fsdp_cfg),
        "critic2": ("critic", 2, critic_cfg),
    }
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {
            key: pool.submit(TrainGroup, role, LocalSlots(n), cfg, timeout_s=240)
            for key, (role, n, cfg) in specs.items()
        }
        made = {key: f.result() for key, f in futures.items()}
    made["actor"].save(initial / "actor")
    made["critic"].save(initial / "critic")
    yield made
    for group in made.values():
        group.shutdown()


@pytest.fixture
def groups(all_groups: dict[str, TrainGroup]) -> tuple[TrainGroup, TrainGroup]:
    return all_groups["actor"], all_groups["critic"]


def batch_box(seed: int, n: int = 8) -> Box:
    from conftest import make_fields

    return pack_fields(make_fields(n, seed))


def step(actor: TrainGroup, critic: TrainGroup, n: int, box: Box, offload: bool = False) -> tuple[dict, dict]:
    """One PPO step; with ``offload`` each model is woken for its phase and put back to sleep after."""
    if offload:
        critic.wake_up()
    c = critic.train(n, [box])
    if offload:
        critic.sleep()
        actor.wake_up()
    assert c.values is not None
    a = actor.train(n, [box], same_split(c.values, [8]))
    if offload:
        actor.sleep()
    return c.metrics, a.metrics


def test_actor_and_critic_learn_and_values_reach_the_actor(groups: tuple[TrainGroup, TrainGroup]) -> None:
    actor, critic = groups
    box = batch_box(seed=11)
    samples = unpack_fields(box)
    before = [t.clone() for t in unpack(actor.compute_log_probs([box])[0])]
    value_losses = []
    for n in range(1, 5):
        result = critic.train(n, [box])
        assert result.values is not None
        assert len(result.values) == 1
        values = unpack_fields(result.values[0])["values"]
        assert [v.numel() for v in values] == [int(r) for r in samples["response_length"]]
        value_losses.append(result.metrics["value_loss"])
        assert result.metrics["handoff_put_s"] > 0  # the handoff's halves, for the driver's step budget
        metrics = actor.train(n, [box], same_split(result.values, [8])).metrics
        assert metrics["optimizer_steps"] == 1.0
        assert metrics["handoff_get_s"] > 0
        assert metrics["lr"] == result.metrics["lr"] == 1e-3  # no run length given: constant
        for role_metrics in (metrics, result.metrics):  # the phase's throughput (throughput.py)
            assert role_metrics["tflops"] > 0
            assert role_metrics["tokens_per_s"] > 0
    assert value_losses[-1] < value_losses[0], value_losses
    after = unpack(actor.compute_log_probs([box])[0])
    gains = torch.stack(
        [
            ((a - b) * m).sum() / m.sum().clamp(min=1)
            for a, b, m in zip(after, before, samples["loss_mask"], strict=True)
        ]
    )
    rewarded = torch.stack(samples["reward"]).reshape(-1) > 0
    assert gains[rewarded].mean() > gains[~rewarded].mean()


def test_the_roles_store_listens_on_loopback_in_a_one_node_cluster(all_groups: dict[str, TrainGroup]) -> None:
    """The role's rendezvous store has no authentication: on a one-node cluster it listens on 127.0.0.1
    only (torch's own tcp:// store would listen on every interface)."""
    rank0 = all_groups["actor2"].workers[0]
    assert ray.get(rank0.rendezvous_address.remote(), timeout=60).startswith("tcp://127.0.0.1:")
    port, listening = ray.get(
        rank0.__ray_call__.remote(lambda worker: (worker._groups._store.port, listening_addresses())),
        timeout=60,
    )
    assert [host for host, p in listening if p == port] == ["127.0.0.1"], listening


def test_actor_without_values_raises_naming_the_rank(groups: tuple[TrainGroup, TrainGroup]) -> None:
    actor, _ = groups
    with pytest.raises(MissingValuesError, match="actor rank 0"):
        actor.train(1, [batch_box(seed=1)])
    box = batch_box(seed=1)
    one = {k: v[:1] for k, v in unpack_fields(box).items()}
    wrong = critic_pieces([one], [[torch.zeros(int(one["response_length"][0]))]])  # 1 sample of 8
    with pytest.raises(ValueError, match="1 tensors for a batch of 8"):
        actor.train(1, [box], wrong)
    with pytest.raises(ValueError, match="critic rank 0 got values"):
        groups[1].train(1, [box], wrong)
    with pytest.raises(ValueError, match="must come as Pieces"):
        actor.train(1, [box], [pack([torch.zeros(1)])])  # type: ignore[list-item]


def test_sleep_and_wake_between_phases_train_identically(
    groups: tuple[TrainGroup, TrainGroup], tmp_path: Path
) -> None:
    actor, critic = groups
    actor.save(tmp_path / "start" / "actor")
    critic.save(tmp_path / "start" / "critic")
    boxes = [batch_box(seed=s) for s in (21, 22, 23)]

    for n, box in enumerate(boxes, start=1):
        step(actor, critic, n, box, offload=True)
    assert actor.is_asleep()
    assert critic.is_asleep()
    offloaded = (actor.weights_checksum(), critic.weights_checksum())  # wakes, sums, sleeps again
    assert actor.is_asleep()
    metrics = actor.pop_metrics()
    assert metrics["sleep/count"] >= 3, metrics
    assert metrics["sleep/bytes"] > 0, metrics

    actor.wake_up()
    critic.wake_up()
    actor.load(tmp_path / "start" / "actor")
    critic.load(tmp_path / "start" / "critic")
    for n, box in enumerate(boxes, start=1):
        step(actor, critic, n, box, offload=False)
    assert (actor.weights_checksum(), critic.weights_checksum()) == offloaded


def test_save_then_load_resumes_bit_identical(groups: tuple[TrainGroup, TrainGroup], tmp_path: Path) -> None:
    actor, critic = groups
    step(actor, critic, 1, batch_box(seed=31))
    actor.save(tmp_path / "actor")
    critic.save(tmp_path / "critic")
    saved_checksum = actor.weights_checksum()
    step(actor, critic, 2, batch_box(seed=32))
    first = (actor.weights_checksum(), critic.weights_checksum())

    step(actor, critic, 3, batch_box(seed=33))  # move away, then come back
    actor.load(tmp_path / "actor")
    critic.load(tmp_path / "critic")
    assert actor.weights_checksum() == saved_checksum
    step(actor, critic, 2, batch_box(seed=32))
    assert (actor.weights_checksum(), critic.weights_checksum()) == first

    # The actor is also written in Hugging Face format; transformers loads it as it was saved.
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "actor" / "hf")
    assert checksum((n, t.float()) for n, t in hf.state_dict().items()) == saved_checksum
    assert set(load_file(str(tmp_path / "critic" / "model.safetensors"))) >= {"value_head.weight"}
    assert not (tmp_path / "actor.partial").exists()


class CountingEngine(TensorEngine):
    """The weight_sync test engine, counting group creations and destructions."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.inits = 0
        self.destroys = 0

    def init_weights_update_group(self, request: InitRequest) -> EngineReply:
        self.inits += 1
        return super().init_weights_update_group(request)

    def destroy_weights_update_group(self, request: DestroyRequest) -> EngineReply:
        self.destroys += 1
        return super().destroy_weights_update_group(request)

    def counts(self) -> tuple[int, int]:
        return self.inits, self.destroys


def test_weight_update_follows_the_sleep_rule(
    groups: tuple[TrainGroup, TrainGroup], tiny_model: Path
) -> None:
    actor, _ = groups
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    spec = {name: ("float32", list(p.shape)) for name, p in model.named_parameters()}
    handle = ray.remote(CountingEngine).options(max_concurrency=4, num_cpus=0).remote(spec, seed=5)
    try:
        engine = RayEngineEndpoint(handle, num_gpus=1, name="engine-0")
        actor.wake_up()
        actor.connect_engines([engine])  # resident: connects now
        assert ray.get(handle.counts.remote()) == (1, 0)
        metrics = actor.update_weights("1")
        assert metrics["weight_sync/bytes"] > 0
        assert ray.get(handle.state.remote())["checksum"] == actor.weights_checksum()
        actor.update_weights("2")  # resident: the connection is kept
        assert ray.get(handle.counts.remote()) == (1, 0)

        actor.sleep()  # the pre-sleep hook disconnects from the engines
        assert ray.get(handle.counts.remote()) == (1, 1)
        step_box = batch_box(seed=41)
        actor.wake_up()
        fields = unpack_fields(step_box)
        actor.train(
            5, [step_box], critic_pieces([fields], [[torch.zeros(int(r)) for r in fields["response_length"]]])
        )
        actor.sleep()
        metrics = actor.update_weights("3")  # asleep: wake, reconnect, send, sleep
        assert metrics["reconnected"] == 1.0
        assert actor.is_asleep()
        assert ray.get(handle.counts.remote()) == (2, 2)
        state = ray.get(handle.state.remote())
        assert state["weight_version"] == "3"
        assert state["checksum"] == actor.weights_checksum()
    finally:
        actor.wake_up()
        ray.kill(handle)


def test_two_ranks_match_one_rank_on_the_same_global_batch(
    all_groups: dict[str, TrainGroup], initial: Path, tmp_path: Path
) -> None:
    from conftest import make_fields

    one, two = all_groups["actor"], all_groups["actor2"]
    assert two.world_size == 2
    one.wake_up()
    one.load(initial / "actor")  # the state the untouched 2-rank group also starts from
    fields = make_fields(8, seed=51)
    values = [torch.randn(int(r)) for r in fields["response_length"]]
    halves = [{k: v[:4] for k, v in fields.items()}, {k: v[4:] for k, v in fields.items()}]
    m1 = one.train(1, [pack_fields(fields)], critic_pieces([fields], [values])).metrics
    m2 = two.train(
        1, [pack_fields(h) for h in halves], critic_pieces(halves, [values[:4], values[4:]])
    ).metrics
    for key in ("pg_loss", "grad_norm", "entropy", "advantages_mean", "train_rollout_logp_abs_diff"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    one.save(tmp_path / "one")
    two.save(tmp_path / "two")
    assert_same_saved_weights(tmp_path / "one", tmp_path / "two")
    assert (tmp_path / "two" / "rng_rank1.safetensors").is_file()


def assert_same_saved_weights(first: Path, second: Path) -> None:
    """Both checkpoints hold the same tensor names and values, up to summation-order noise."""
    w1 = load_file(str(first / "model.safetensors"))
    w2 = load_file(str(second / "model.safetensors"))
    assert w1.keys() == w2.keys()
    # Adam's first step is lr * g / (|g| + eps): float noise in the summation order only shows on
    # near-zero gradients, and stays far below one step (lr = 1e-3).
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], atol=1e-4, rtol=1e-4)


def two_rank_step(group: TrainGroup, n: int, fields: dict, values: list[torch.Tensor]) -> dict[str, float]:
    halves = [{k: v[:4] for k, v in fields.items()}, {k: v[4:] for k, v in fields.items()}]
    return group.train(
        n, [pack_fields(h) for h in halves], critic_pieces(halves, [values[:4], values[4:]])
    ).metrics


def test_fsdp2_matches_one_rank_and_checkpoints_load_across_kinds(
    all_groups: dict[str, TrainGroup], initial: Path, tmp_path: Path
) -> None:
    from conftest import make_fields

    one, fsdp = all_groups["actor"], all_groups["actor_fsdp"]
    assert (fsdp.data_parallel, one.data_parallel) == ("fsdp2", "replicate")
    one.wake_up()
    fsdp.wake_up()
    one.load(initial / "actor")
    fsdp.load(initial / "actor")  # a replicated checkpoint into sharded ranks
    assert fsdp.weights_checksum() == one.weights_checksum()
    fields = make_fields(8, seed=61)
    values = [torch.randn(int(r)) for r in fields["response_length"]]
    m1 = one.train(1, [pack_fields(fields)], critic_pieces([fields], [values])).metrics
    m2 = two_rank_step(fsdp, 1, fields, values)
    for key in ("pg_loss", "grad_norm", "entropy", "advantages_mean", "train_rollout_logp_abs_diff"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    one.save(tmp_path / "one")
    fsdp.save(tmp_path / "fsdp")
    assert_same_saved_weights(tmp_path / "one", tmp_path / "fsdp")  # whole tensors, as replicated
    state = json.loads((tmp_path / "fsdp" / "trainer_state.json").read_text())
    assert (state["data_parallel"], state["world_size"]) == ("fsdp2", 2)
    hf_config = json.loads((tmp_path / "fsdp" / "hf" / "config.json").read_text())
    assert hf_config["architectures"] == ["LlamaForCausalLM"]  # not FSDP's wrapper class
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp" / "hf")
    fsdp_checksum = fsdp.weights_checksum()
    assert checksum((n, t.float()) for n, t in hf.state_dict().items()) == fsdp_checksum

    # The sharded optimizer state round-trips: load, step again, and both kinds agree again.
    one.load(tmp_path / "fsdp")  # a sharded checkpoint into a replicated rank
    assert one.weights_checksum() == fsdp_checksum
    fsdp.load(tmp_path / "fsdp")
    fields = make_fields(8, seed=62)
    values = [torch.randn(int(r)) for r in fields["response_length"]]
    m1 = one.train(2, [pack_fields(fields)], critic_pieces([fields], [values])).metrics
    m2 = two_rank_step(fsdp, 2, fields, values)
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-4)
    one.save(tmp_path / "one2")
    fsdp.save(tmp_path / "fsdp2")
    assert_same_saved_weights(tmp_path / "one2", tmp_path / "fsdp2")


def test_fsdp2_refuses_uneven_batches_naming_the_fix(all_groups: dict[str, TrainGroup]) -> None:
    from conftest import make_fields

    fsdp = all_groups["actor_fsdp"]
    fsdp.wake_up()
    fields = make_fields(8, seed=81)
    uneven = [{k: v[:3] for k, v in fields.items()}, {k: v[3:] for k, v in fields.items()}]
    with pytest.raises(ValueError, match="split the batch evenly over the ranks"):
        fsdp.compute_log_probs([pack_fields(h) for h in uneven])
    # Nothing was left half-done: an even batch runs on the same ranks right after.
    even = [{k: v[:4] for k, v in fields.items()}, {k: v[4:] for k, v in fields.items()}]
    assert [len(unpack(box)) for box in fsdp.compute_log_probs([pack_fields(h) for h in even])] == [4, 4]


def test_fsdp2_sleeps_wakes_and_updates_engines(
    all_groups: dict[str, TrainGroup], initial: Path, tiny_model: Path
) -> None:
    from conftest import make_fields

    fsdp = all_groups["actor_fsdp"]
    batches = [make_fields(8, seed=s) for s in (71, 72)]
    values = [[torch.randn(int(r)) for r in f["response_length"]] for f in batches]

    fsdp.wake_up()
    fsdp.load(initial / "actor")
    for n, (fields, vals) in enumerate(zip(batches, values, strict=True), start=1):
        two_rank_step(fsdp, n, fields, vals)
    resident = fsdp.weights_checksum()

    fsdp.load(initial / "actor")
    for n, (fields, vals) in enumerate(zip(batches, values, strict=True), start=1):
        two_rank_step(fsdp, n, fields, vals)
        fsdp.sleep()
        assert fsdp.is_asleep()
        fsdp.wake_up()
    assert fsdp.weights_checksum() == resident
    metrics = fsdp.pop_metrics()
    assert metrics["sleep/bytes"] > 0, metrics

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    spec = {name: ("float32", list(p.shape)) for name, p in model.named_parameters()}
    handle = ray.remote(CountingEngine).options(max_concurrency=4, num_cpus=0).remote(spec, seed=5)
    try:
        fsdp.connect_engines([RayEngineEndpoint(handle, num_gpus=1, name="engine-0")])
        fsdp.sleep()  # asleep: every rank wakes, gathers, and rank 0 sends
        metrics = fsdp.update_weights("7")
        assert metrics["reconnected"] == 1.0
        assert fsdp.is_asleep()
        state = ray.get(handle.state.remote())
        assert state["weight_version"] == "7"
        assert state["checksum"] == resident
    finally:
        fsdp.wake_up()
        ray.kill(handle)


def _select(fields: dict[str, list[torch.Tensor]], ids: list[int]) -> dict[str, list[torch.Tensor]]:
    return {k: [v[i] for i in ids] for k, v in fields.items()}


# Sample ids per rank, as the rollout splits them: whole prompts (2 samples each) per rank, each
# role its own balance and order, so most rows change rank and position on the way.
SPLITS = {1: [[6, 7, 2, 3, 0, 1, 4, 5]], 2: [[4, 5, 0, 1], [2, 3, 6, 7]]}
ACTOR_SPLITS = {1: [[0, 1, 2, 3, 4, 5, 6, 7]], 2: [[6, 7, 4, 5], [0, 1, 2, 3]]}


@pytest.mark.parametrize(
    ("critic_key", "actor_key"), [("critic", "actor2"), ("critic2", "actor"), ("critic2", "actor2")]
)
def test_critic_values_reach_actor_ranks_of_any_size(
    all_groups: dict[str, TrainGroup], critic_key: str, actor_key: str
) -> None:
    """The trainer's real path (critic.train -> pair_values -> the actor worker's unpacking), with
    1 -> 2, 2 -> 1 and 2 -> 2 ranks: every actor row holds its own sample's values, element by element."""
    from conftest import make_fields

    critic, actor = all_groups[critic_key], all_groups[actor_key]
    critic.wake_up()
    actor.wake_up()
    fields = make_fields(8, seed=71)
    critic_ids = SPLITS[critic.world_size]
    actor_ids = ACTOR_SPLITS[actor.world_size]
    result = critic.train(1, [pack_fields(_select(fields, ids)) for ids in critic_ids])
    assert result.values is not None
    assert len(result.values) == critic.world_size
    produced: dict[int, dict[str, torch.Tensor]] = {}
    for ids, box in zip(critic_ids, result.values, strict=True):
        payload = unpack_fields(box)
        for row, sample in enumerate(ids):
            produced[sample] = {name: payload[name][row] for name in ("values", "token_rewards")}
    actor_boxes = [pack_fields(_select(fields, ids)) for ids in actor_ids]
    pieces = pair_values(result.values, critic_ids, actor_ids)
    received = actor.critic_outputs(actor_boxes, pieces)
    for ids, box in zip(actor_ids, received, strict=True):
        got = unpack_fields(box)
        for row, sample in enumerate(ids):
            length = int(fields["response_length"][sample])
            for name in ("values", "token_rewards"):
                assert got[name][row].numel() == length
                assert torch.equal(got[name][row], produced[sample][name]), (name, sample)
        # the outcome reward sits on each sample's last token (kl_coef=0 here)
        for row, sample in enumerate(ids):
            assert float(got["token_rewards"][row][-1]) == float(fields["reward"][sample].reshape(-1)[0])
    metrics = actor.train(1, actor_boxes, pieces).metrics  # and the actor trains on them
    assert metrics["optimizer_steps"] == 1.0


def test_optimizer_state_is_tracked_from_setup(all_groups: dict[str, TrainGroup], tiny_model: Path) -> None:
    # AdamW's state exists (zeros, step 0) before any step, so the memory backend tracks it from the
    # start and a pinned backend allocates its buffers at setup, not in the first sleep.
    fresh = TrainGroup("actor", LocalSlots(1), configs(tiny_model)[0], timeout_s=240)
    try:
        (state,) = fresh.memory_state()
        model = load_file(str(tiny_model / "model.safetensors"))
        trainable = sum(t.numel() * t.element_size() for t in model.values())
        assert state["optimizer_state_entries"] > 0
        # exp_avg and exp_avg_sq of every parameter and one 4-byte step counter each
        assert state["optimizer_bytes"] >= 2 * trainable + 4 * state["optimizer_state_entries"]
        assert state["pinned_bytes"] is None  # the host backend on CPU pins nothing
        before = dict(state)
        fresh.sleep()
        fresh.wake_up()
        assert fresh.memory_state() == [before]  # the first cycle created nothing new
    finally:
        fresh.shutdown()


def _same_files(first: Path, second: Path) -> None:
    names = sorted(str(p.relative_to(first)) for p in first.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(second)) for p in second.rglob("*") if p.is_file())
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= set(names)
    for name in names:
        if name.startswith("rng_rank"):  # safetensors writes metadata in hash order: compare contents
            assert _rng(first / name) == _rng(second / name), name
        else:
            assert (first / name).read_bytes() == (second / name).read_bytes(), name


def _rng(path: Path) -> tuple[dict[str, str], dict[str, list[int]]]:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata(), {k: f.get_tensor(k).tolist() for k in f.keys()}  # noqa: SIM118


def test_background_save_writes_the_bytes_of_a_foreground_save(
    groups: tuple[TrainGroup, TrainGroup], tmp_path: Path
) -> None:
    actor, critic = groups
    step(actor, critic, 1, batch_box(seed=41))
    for name, group in (("actor", actor), ("critic", critic)):
        group.save(tmp_path / "fg" / name)
        with pytest.raises(RuntimeError, match="needs the worker asleep"):
            group.save_async(tmp_path / "bg" / name)
        group.save_wait()  # nothing was started: nothing to wait for
        group.sleep()
        started = group.save_async(tmp_path / "bg" / name)
        assert started["bytes"] > 0
        assert not (tmp_path / "bg" / name).exists()  # renamed into place by save_wait only
        assert group.save_wait() > 0
        assert group.save_done()
        group.wake_up()
        _same_files(tmp_path / "fg" / name, tmp_path / "bg" / name)
    assert (tmp_path / "bg" / "actor" / "hf" / "config.json").is_file()


def test_resume_from_a_background_save_is_bit_identical(
    groups: tuple[TrainGroup, TrainGroup], tmp_path: Path
) -> None:
    actor, critic = groups
    step(actor, critic, 1, batch_box(seed=51), offload=True)
    actor.save_async(tmp_path / "actor")
    critic.save_async(tmp_path / "critic")
    # The loop goes on while the writers run: the next step wakes, trains and sleeps both roles.
    step(actor, critic, 2, batch_box(seed=52), offload=True)
    actor.save_wait()
    critic.save_wait()
    first = (actor.weights_checksum(), critic.weights_checksum())

    actor.wake_up()
    critic.wake_up()
    step(actor, critic, 3, batch_box(seed=53))  # move away, then come back
    actor.load(tmp_path / "actor")
    critic.load(tmp_path / "critic")
    step(actor, critic, 2, batch_box(seed=52))
    assert (actor.weights_checksum(), critic.weights_checksum()) == first
