"""The sender against SGLang's own receiving side (testing.sglang_like), in each supported version's mode:
real processes, a real gloo group, real HTTP on 127.0.0.1."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from harness import GROUP_TIMEOUT_S, SPEC, HttpEngine, assert_engines_hold, weights

from ppo_weight_sync import (
    EngineUnavailableError,
    HttpEngineEndpoint,
    NonFiniteTensorsError,
    WeightSender,
    plan_buckets,
)
from ppo_weight_sync.buckets import plan_aligned_buckets
from ppo_weight_sync.sglang import SGLangProtocol, group_ranks_of
from ppo_weight_sync.testing.http_engine import start_process

pytestmark = pytest.mark.timeout(240)

VERSIONS = ["0.5.15.post1", "0.5.23"]
# the last version of each side of the one protocol boundary (0.5.21), read from its released source
BOUNDARY = {
    "0.5.15.post1": False,
    "0.5.16": False,
    "0.5.19": False,
    "0.5.20": False,
    "0.5.21": True,
    "0.5.22": True,
    "0.5.23": True,
    "0.5.23.post1": True,
}


@pytest.fixture(scope="module", params=VERSIONS)
def sglang_engines(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[HttpEngine]]]:
    version = request.param
    with ThreadPoolExecutor(2) as pool:
        started = list(
            pool.map(
                lambda i: start_process(
                    SPEC, seed=i + 1, timeout_s=180, group_timeout_s=GROUP_TIMEOUT_S, sglang_version=version
                ),
                range(2),
            )
        )
    engines = [
        HttpEngine(HttpEngineEndpoint.for_sglang(url, name=f"sglang-{i}", timeout_s=60), proc)
        for i, (proc, url) in enumerate(started)
    ]
    yield version, engines
    for engine in engines:
        engine.kill()


def test_the_protocol_is_read_from_the_server(sglang_engines: tuple[str, list[HttpEngine]]) -> None:
    version, engines = sglang_engines
    protocol = engines[0].endpoint.sglang
    assert protocol == SGLangProtocol.for_version(version)
    assert protocol.weight_update_session is (version == "0.5.23")
    assert protocol.pause_mode == ("retract" if version == "0.5.23" else "abort")
    assert engines[0].endpoint.num_gpus == 1  # tp_size from /server_info
    # the version route SGLang does not serve is not used: /get_weight_version answers 404 there
    with pytest.raises(EngineUnavailableError, match="HTTP 404"):
        engines[0].endpoint.request("GET", "/get_weight_version")


@pytest.mark.parametrize("load_format", ["per_tensor", "flattened_bucket"])
def test_connect_update_disconnect_reconnect(
    sglang_engines: tuple[str, list[HttpEngine]], load_format: str
) -> None:
    _, engines = sglang_engines
    endpoints = [e.endpoint for e in engines]
    sender = WeightSender(timeout_s=GROUP_TIMEOUT_S, bucket_bytes=4096, load_format=load_format)
    sender.connect(endpoints)
    first_group = sender.active_group_name
    for step in range(2):
        sent = weights(step)
        sender.update(sent.items(), f"{load_format}-v{step}")
        assert_engines_hold(engines, sent, f"{load_format}-v{step}")
    sender.disconnect()
    assert sender.last_disconnect_errors == []
    sender.connect(endpoints)
    assert sender.active_group_name != first_group  # a fresh group name per connection
    sent = weights(7)
    sender.update(sent.items(), f"{load_format}-v7")
    assert_engines_hold(engines, sent, f"{load_format}-v7")
    sender.disconnect()


def test_a_rejected_update_drops_the_group_and_a_reconnect_recovers(
    sglang_engines: tuple[str, list[HttpEngine]],
) -> None:
    _, engines = sglang_engines
    endpoints = [e.endpoint for e in engines]
    sender = WeightSender(timeout_s=GROUP_TIMEOUT_S, bucket_bytes=4096, load_format="flattened_bucket")
    sender.connect(endpoints)
    bad = dict(weights(1))
    bad["model.not_a_weight"] = bad.pop("model.norm.weight")
    # SGLang receives first and loads after: its failure cannot say whether the group is in step, so the
    # sender treats it as lost (never a message prefix) and disconnects.
    with pytest.raises(EngineUnavailableError, match=r"model\.not_a_weight"):
        sender.update(bad.items(), "bad")
    assert not sender.is_connected
    sender.connect(endpoints)
    sent = weights(2)
    sender.update(sent.items(), "after-bad")
    assert_engines_hold(engines, sent, "after-bad")
    sender.disconnect()


def test_an_engine_killed_mid_update_is_named_and_a_fresh_one_connects(
    sglang_engines: tuple[str, list[HttpEngine]],
) -> None:
    version, engines = sglang_engines
    proc, url = start_process(
        SPEC, seed=9, timeout_s=180, group_timeout_s=GROUP_TIMEOUT_S, load_delay_s=30, sglang_version=version
    )
    victim = HttpEngine(HttpEngineEndpoint.for_sglang(url, name="victim", timeout_s=60), proc)
    sender = WeightSender(timeout_s=GROUP_TIMEOUT_S, bucket_bytes=4096)
    sender.connect([engines[0].endpoint, victim.endpoint])

    killer = threading.Timer(2.0, victim.kill)
    killer.start()
    with pytest.raises(EngineUnavailableError, match="victim"):
        sender.update(weights(3).items(), "never")
    killer.join()
    assert not sender.is_connected
    sender.connect([engines[0].endpoint, engines[1].endpoint])
    sent = weights(4)
    sender.update(sent.items(), "after-kill")
    assert_engines_hold(engines, sent, "after-kill")
    sender.disconnect()


def test_non_finite_weights_are_refused_and_the_engines_continue_with_their_weights(
    sglang_engines: tuple[str, list[HttpEngine]],
) -> None:
    """The scan runs while the pause and the flush are in flight: a NaN ends the update before any
    session opens or byte moves; every engine is continued, keeps its weights and version, and the next
    update (a session of its own on 0.5.23, which refuses a second begin) goes through."""
    _, engines = sglang_engines
    sender = WeightSender(timeout_s=GROUP_TIMEOUT_S, bucket_bytes=4096, load_format="flattened_bucket")
    sender.connect([e.endpoint for e in engines])
    try:
        good = weights(30)
        sender.update(good.items(), "nan-v30")
        flushes = [e.state()["flushes"] for e in engines]
        bad = weights(31)
        bad["model.norm.weight"][0] = float("inf")
        with pytest.raises(NonFiniteTensorsError, match=r"model\.norm\.weight") as caught:
            sender.update(bad.items(), "nan-v31")
        assert caught.value.names == ["model.norm.weight"]
        assert sender.is_connected  # nothing was sent: the group is in step
        assert_engines_hold(engines, good, "nan-v30")  # continued (not paused), previous weights, version
        assert [e.state()["flushes"] for e in engines] == [f + 1 for f in flushes]  # paused and flushed
        sent = weights(32)
        sender.update(sent.items(), "nan-v32")
        assert_engines_hold(engines, sent, "nan-v32")
    finally:
        sender.disconnect()


@pytest.mark.parametrize("version", sorted(BOUNDARY))
def test_each_version_gets_the_protocol_its_source_has(version: str) -> None:
    since_21 = BOUNDARY[version]
    protocol = SGLangProtocol.for_version(version)
    assert protocol.weight_update_session is since_21  # /begin_weight_update exists and is required
    assert protocol.pause_mode == ("retract" if since_21 else "abort")  # flush ignores waiting if paused
    assert protocol.idle_ignores_waiting_when_paused is since_21
    assert protocol.missing_group_is_fatal is not since_21  # the assert moved inside the scheduler's try
    assert protocol.weight_version_route == "/model_info"  # /get_weight_version: 404, then no route
    assert protocol.server_info_route == "/server_info"


@pytest.mark.parametrize("version", ["0.5.20", "0.5.21"])
def test_the_boundary_versions_behave_as_their_source_over_http(version: str) -> None:
    """The stand-in in 0.5.20's and 0.5.21's modes: session routes, the version route, a flush."""
    proc, url = start_process(SPEC, seed=1, timeout_s=180, sglang_version=version)
    endpoint = HttpEngineEndpoint.for_sglang(url, name=f"sglang-{version}", timeout_s=30)
    try:
        assert endpoint.sglang == SGLangProtocol.for_version(version)
        since_21 = version == "0.5.21"
        if since_21:
            assert endpoint.call("POST", "/begin_weight_update", {}).success
            assert endpoint.call("POST", "/end_weight_update", {}).success
            with pytest.raises(EngineUnavailableError, match=r"HTTP 404: \{'detail': 'Not Found'\}"):
                endpoint.request("GET", "/get_weight_version")
        else:
            with pytest.raises(EngineUnavailableError, match="HTTP 404"):
                endpoint.call("POST", "/begin_weight_update", {})
            with pytest.raises(EngineUnavailableError, match="deprecated"):
                endpoint.request("GET", "/get_weight_version")
        assert endpoint.pause_generation().result(30).success
        assert endpoint.flush_cache().result(30).success
        assert endpoint.continue_generation().result(30).success
    finally:
        endpoint.close()
        proc.kill()
        proc.wait(30)


def test_group_ranks_come_from_tp_size_and_replicas_are_refused() -> None:
    assert group_ranks_of({"tp_size": 4, "dp_size": 1, "pp_size": 1}, "e") == 4
    assert group_ranks_of({"version": "0.5.23"}, "e") == 1
    with pytest.raises(ValueError, match=r"dp_size=2.*one server per replica"):
        group_ranks_of({"tp_size": 2, "dp_size": 2}, "e")
    with pytest.raises(ValueError, match=r"pp_size=2"):
        group_ranks_of({"tp_size": 1, "pp_size": 2}, "e")
    with pytest.raises(ValueError, match=r"tp_size 0"):
        group_ranks_of({"tp_size": 0}, "e")


def test_unsupported_versions_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"SGLang 0\.5\.14 is not supported.*0\.5\.15\.post1 to 0\.5\.23"):
        SGLangProtocol.for_version("0.5.14")
    with pytest.raises(ValueError, match=r"SGLang 0\.6\.0 is not supported"):
        SGLangProtocol.for_version("0.6.0")
    assert SGLangProtocol.for_version("0.5.21").weight_update_session
    assert not SGLangProtocol.for_version("0.5.20").weight_update_session


def test_flattened_buckets_start_every_tensor_aligned() -> None:
    # bf16 (2 bytes) x3, then float32: SGLang views each tensor in place, so it starts a new bucket
    sizes, itemsizes = [6, 8, 4], [2, 4, 4]
    assert plan_buckets(sizes, 1 << 20) == [(0, 3)]
    assert plan_aligned_buckets(sizes, itemsizes, 1 << 20) == [(0, 1), (1, 3)]
