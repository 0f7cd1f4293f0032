"""A trainer (this process) and engine processes (Ray actors, or HTTP servers serving SGLang's routes)
over a real gloo group."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch
from harness import (
    GROUP_TIMEOUT_S,
    Engine,
    assert_engines_hold,
    full_cycle,
    spawn_http,
    spawn_ray,
    weights,
)

from ppo_testsupport import listening_addresses
from ppo_weight_sync import (
    EngineRejectedError,
    EngineUnavailableError,
    NonFiniteTensorsError,
    WeightSender,
    WeightSyncError,
)
from ppo_weight_sync.net import node_address

pytestmark = pytest.mark.timeout(240)


@dataclass
class Cluster:
    kind: str
    spawn: Callable[[list[str]], list[Engine]]
    live: list[Engine] = field(default_factory=list)
    dead: list[Engine] = field(default_factory=list)
    spare: list[Engine] = field(default_factory=list)  # started with the others, for the kill test

    def start(self, kind: str) -> None:
        # All three start side by side: engine start-up (importing torch) dominates the suite's time.
        a, b, spare = self.spawn([f"{kind}-a", f"{kind}-b", f"{kind}-fresh"])
        self.live, self.spare = [a, b], [spare]

    def fresh(self) -> Engine:
        return self.spare.pop() if self.spare else self.spawn([f"{self.kind}-fresh"])[0]


@pytest.fixture(scope="module", params=["ray", "http"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    if request.param == "ray":
        ray = pytest.importorskip("ray")
        ray.init(num_cpus=4, num_gpus=0, object_store_memory=256 * 1024**2, include_dashboard=False)
        c = Cluster("ray", spawn_ray)
        c.start("ray")
        yield c
        ray.shutdown()
    else:
        c = Cluster("http", spawn_http)
        c.start("http")
        yield c
        for engine in c.live + c.dead + c.spare:
            engine.kill()


@pytest.mark.parametrize("load_format", ["auto", "flattened_bucket", "per_tensor"])
def test_connect_three_updates_disconnect_reconnect_update(cluster: Cluster, load_format: str) -> None:
    sender = full_cycle(cluster.live, load_format=load_format)
    assert not sender.is_connected


def test_auto_picks_the_stream_format_our_engines_accept(cluster: Cluster) -> None:
    sender = WeightSender(timeout_s=GROUP_TIMEOUT_S, bucket_bytes=4096)
    sender.connect([e.endpoint for e in cluster.live])
    try:
        assert sender.load_format == "ppo_flat_stream:4096"
    finally:
        sender.disconnect()


def test_non_finite_weights_are_refused_before_any_engine_receives_them(cluster: Cluster) -> None:
    sender = WeightSender(timeout_s=GROUP_TIMEOUT_S, bucket_bytes=4096)
    sender.connect([e.endpoint for e in cluster.live])
    try:
        good = weights(20)
        sender.update(good.items(), "v20")
        flushes = [e.state()["flushes"] for e in cluster.live]
        bad = weights(21)
        name = "model.layers.1.mlp.up_proj.weight"
        bad[name][3, 5] = float("nan")
        with pytest.raises(NonFiniteTensorsError, match=r"up_proj\.weight") as caught:
            sender.update(bad.items(), "v21")
        assert caught.value.names == [name]
        # The scan ran while the pause and the flush were in flight: the engines were paused and flushed
        # (one flush each, none after a load), then continued holding the last finite update.
        assert [e.state()["flushes"] for e in cluster.live] == [f + 1 for f in flushes]
        assert_engines_hold(cluster.live, good, "v20")  # weights, version, and not paused
        assert sender.is_connected  # nothing was sent, so the group is still usable
        assert sender.pop_metrics()["weight_sync/updates"] == 1  # the refused update is not counted
        sender.update(weights(22).items(), "v22")
        assert_engines_hold(cluster.live, weights(22), "v22")
    finally:
        sender.disconnect()


@pytest.mark.parametrize("check_finite", [True, False])
def test_the_metrics_split_each_update_into_parts_that_do_not_overlap(
    cluster: Cluster, check_finite: bool
) -> None:
    sender = WeightSender(timeout_s=GROUP_TIMEOUT_S, bucket_bytes=4096, check_finite=check_finite)
    sender.connect([e.endpoint for e in cluster.live])
    try:
        sender.pop_metrics()
        for step in (40, 41):
            sender.update(weights(step).items(), f"v{step}")
        m = sender.pop_metrics()
    finally:
        sender.disconnect()
    parts = ["check_seconds", "control_before_seconds", "seconds", "control_after_seconds"]
    seconds = {p: m[f"weight_sync/{p}"] for p in parts}
    assert (seconds["check_seconds"] > 0) is check_finite
    assert all(seconds[p] > 0 for p in parts[1:]), seconds
    control = seconds["control_before_seconds"] + seconds["control_after_seconds"]
    assert m["weight_sync/control_seconds"] == pytest.approx(control)
    # parts of the host's time, each counted once: together within the whole update() calls
    assert sum(seconds.values()) <= m["weight_sync/update_seconds"]
    assert m["weight_sync/update_seconds"] < 2 * GROUP_TIMEOUT_S


@pytest.mark.parametrize("master_address", ["127.0.0.1", None])
def test_the_groups_listeners_are_bound_to_the_peers_address(
    cluster: Cluster, master_address: str | None
) -> None:
    """The store and gloo have no authentication: a connected group listens only on the address the
    peers use (127.0.0.1 when given; else this node's address), never on every interface."""
    pids = [int(e.state()["pid"]) for e in cluster.live]
    before = {pid: set(listening_addresses(pid)) for pid in [*pids, None]}
    sender = WeightSender(timeout_s=GROUP_TIMEOUT_S, bucket_bytes=4096, master_address=master_address)
    sender.connect([e.endpoint for e in cluster.live])
    try:
        sent = weights(7)
        sender.update(sent.items(), "v7")
        assert_engines_hold(cluster.live, sent, "v7")
        opened = {pid: set(listening_addresses(pid)) - before[pid] for pid in before}
    finally:
        sender.disconnect()
    # This process: the store and gloo's listener; each engine: its gloo listener.
    assert len(opened[None]) == 2, opened
    assert all(len(opened[pid]) == 1 for pid in pids), opened
    hosts = {host for found in opened.values() for host, _ in found}
    assert hosts == {master_address or node_address()}, opened
    assert set(listening_addresses()) - before[None] == set(), "the group's listeners outlived it"


@pytest.mark.parametrize(
    ("name", "tensor", "complaint"),
    [
        ("model.layers.0.mlp.up_proj.weight", torch.zeros(63, 32, dtype=torch.bfloat16), "shape [63, 32]"),
        ("model.layers.1.self_attn.q_proj.weight", torch.zeros(32, 32), "dtype torch.float32"),
        ("model.layers.7.mlp.up_proj.weight", torch.zeros(4, dtype=torch.bfloat16), "not a weight"),
    ],
)
def test_mismatched_tensor_is_rejected_naming_it_and_nothing_loads(
    cluster: Cluster, name: str, tensor: torch.Tensor, complaint: str
) -> None:
    sender = WeightSender(timeout_s=GROUP_TIMEOUT_S, bucket_bytes=4096)
    endpoints = [e.endpoint for e in cluster.live]
    sender.connect(endpoints)
    try:
        good = weights(10)
        sender.update(good.items(), "good")
        bad = dict(weights(11))
        bad[name] = tensor
        with pytest.raises(EngineRejectedError) as info:
            sender.update(bad.items(), "bad")
        assert name in str(info.value)
        assert complaint in str(info.value)
        assert info.value.engine in {e.name for e in endpoints}
        assert_engines_hold(cluster.live, good, "good")  # nothing of the bad update was loaded
        # The group stayed in step: the next good update works without reconnecting.
        assert sender.is_connected
        again = weights(12)
        sender.update(again.items(), "again")
        assert_engines_hold(cluster.live, again, "again")
    finally:
        sender.disconnect()


def test_disconnect_twice_and_before_connect(cluster: Cluster) -> None:
    sender = WeightSender(timeout_s=GROUP_TIMEOUT_S)
    sender.disconnect()  # never connected: a no-op
    sender.connect([e.endpoint for e in cluster.live])
    sender.disconnect()
    sender.disconnect()
    assert not sender.is_connected
    assert sender.last_disconnect_errors == []
    with pytest.raises(WeightSyncError, match="not connected"):
        sender.update(weights(0).items(), "v")


def test_connect_while_connected_reconnects(cluster: Cluster) -> None:
    sender = WeightSender(timeout_s=GROUP_TIMEOUT_S, bucket_bytes=1 << 20)
    endpoints = [e.endpoint for e in cluster.live]
    sender.connect(endpoints)
    sender.connect(endpoints)
    try:
        sent = weights(20)
        sender.update(sent.items(), "re")
        assert_engines_hold(cluster.live, sent, "re")
    finally:
        sender.disconnect()


def test_engine_killed_mid_update_then_fresh_engine(cluster: Cluster) -> None:
    survivor, victim = cluster.live
    sender = WeightSender(timeout_s=GROUP_TIMEOUT_S, bucket_bytes=4096)
    sender.connect([survivor.endpoint, victim.endpoint])
    for engine in cluster.live:
        engine.set_load_delay(0.2)  # ~15 buckets: the update takes seconds, the kill lands inside it
    killer = threading.Timer(1.0, victim.kill)
    killer.start()
    start = time.monotonic()
    try:
        with pytest.raises(EngineUnavailableError) as info:
            sender.update(weights(30).items(), "interrupted")
    finally:
        killer.join()
    elapsed = time.monotonic() - start
    assert elapsed < GROUP_TIMEOUT_S, f"the dead engine surfaced after {elapsed:.1f} s"
    assert victim.endpoint.name in str(info.value)
    assert not sender.is_connected
    survivor.set_load_delay(0.0)
    cluster.dead.append(victim)
    fresh = cluster.fresh()
    cluster.live = [survivor, fresh]
    sender.connect([survivor.endpoint, fresh.endpoint])
    sent = weights(31)
    sender.update(sent.items(), "after-kill")
    assert_engines_hold(cluster.live, sent, "after-kill")
    sender.disconnect()


def test_connect_after_failed_connect(cluster: Cluster) -> None:
    if not cluster.dead:
        (victim,) = cluster.spawn([f"{cluster.kind}-victim"])
        victim.kill()
        cluster.dead.append(victim)
    dead = cluster.dead[0]
    sender = WeightSender(timeout_s=GROUP_TIMEOUT_S)
    start = time.monotonic()
    with pytest.raises(EngineUnavailableError) as info:
        sender.connect([cluster.live[0].endpoint, dead.endpoint])
    assert dead.endpoint.name in str(info.value)
    assert time.monotonic() - start < GROUP_TIMEOUT_S
    assert not sender.is_connected
    sender.disconnect()  # safe after a failed connect
    sender.connect([e.endpoint for e in cluster.live])
    sent = weights(40)
    sender.update(sent.items(), "after-failed-connect")
    assert_engines_hold(cluster.live, sent, "after-failed-connect")
    sender.disconnect()


@pytest.mark.parametrize("cluster", ["ray"], indirect=True)
def test_ray_update_lock_excludes_other_holders_and_expires(cluster: Cluster) -> None:
    from ppo_weight_sync import RayUpdateLock

    first = RayUpdateLock(name="test-lock", lease_s=3.0)
    second = RayUpdateLock(name="test-lock", lease_s=3.0)
    first.acquire(30)
    with pytest.raises(TimeoutError, match="test-lock"):
        second.acquire(0.5)
    first.release()
    second.acquire(30)  # freed by release
    start = time.monotonic()
    first.acquire(30)  # second never releases: its lease runs out
    assert time.monotonic() - start >= 1.0
    first.release()


def test_two_senders_share_engines_one_update_at_a_time(cluster: Cluster) -> None:
    endpoints = [e.endpoint for e in cluster.live]
    senders = [WeightSender(timeout_s=GROUP_TIMEOUT_S, bucket_bytes=4096) for _ in range(2)]
    for s in senders:
        s.connect(endpoints)  # two groups on the same engines
    sent = [weights(50), weights(51)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for _ in range(3):
                senders[i].update(sent[i].items(), f"s{i}")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    # Whole updates never interleave: every engine holds one sender's weights and that sender's version.
    states = [e.state() for e in cluster.live]
    version = states[0]["weight_version"]
    assert version in ("s0", "s1")
    assert_engines_hold(cluster.live, sent[int(version[1])], version)
    for s in senders:
        s.disconnect()
