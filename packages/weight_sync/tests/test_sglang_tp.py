"""Engines with tensor parallelism against SGLang's receiving side (testing.sglang_like, sglang_tp): every
TP rank a process of its own joining the gloo group at rank_offset + tp_rank, as SGLang's TP workers do."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from harness import GROUP_TIMEOUT_S, SPEC, HttpEngine, weights

from ppo_weight_sync import EngineUnavailableError, HttpEngineEndpoint, TensorRequest, WeightSender, checksum
from ppo_weight_sync.ipc import tensor_request
from ppo_weight_sync.testing.http_engine import start_process
from ppo_weight_sync.testing.sglang_tp import shard_checksum, tp_shard

pytestmark = pytest.mark.timeout(300)

TP_SIZES = (2, 1)  # world size 1 + 2 + 1 = 4: engine 0 at ranks 1-2, engine 1 at rank 3


@pytest.fixture(scope="module", params=["0.5.15.post1", "0.5.23"])
def tp_engines(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[HttpEngine]]]:
    version = request.param
    with ThreadPoolExecutor(len(TP_SIZES)) as pool:
        started = list(
            pool.map(
                lambda i: start_process(
                    SPEC,
                    seed=i + 1,
                    timeout_s=240,
                    group_timeout_s=GROUP_TIMEOUT_S,
                    sglang_version=version,
                    tp_size=TP_SIZES[i],
                ),
                range(len(TP_SIZES)),
            )
        )
    engines = [
        HttpEngine(HttpEngineEndpoint.for_sglang(url, name=f"tp{TP_SIZES[i]}-{i}", timeout_s=60), proc)
        for i, (proc, url) in enumerate(started)
    ]
    yield version, engines
    for engine in engines:
        engine.kill()


def _assert_every_rank_holds(engines: list[HttpEngine], sent: dict, version: str) -> None:  # type: ignore[type-arg]
    for engine, tp in zip(engines, TP_SIZES, strict=True):
        state = engine.state()
        assert state["checksum"] == checksum(sent.items()), f"{engine.endpoint.name}: TP rank 0"
        expected = [shard_checksum(sent.items(), rank, tp) for rank in range(1, tp)]
        assert state["tp_checksums"] == expected, f"{engine.endpoint.name}: TP ranks 1..{tp - 1}"
        assert state["weight_version"] == version


def test_the_tp_size_is_read_from_the_server(tp_engines: tuple[str, list[HttpEngine]]) -> None:
    _, engines = tp_engines
    assert [e.endpoint.num_gpus for e in engines] == list(TP_SIZES)
    with pytest.raises(ValueError, match=r"tp_size=2, but num_gpus=1 was given"):
        HttpEngineEndpoint.for_sglang(engines[0].endpoint.base_url, num_gpus=1)


def test_a_shard_is_a_slice_of_dim_0_or_the_whole_tensor() -> None:
    sent = weights(0)
    q = sent["model.layers.0.self_attn.q_proj.weight"]
    assert tp_shard(q, 1, 2).shape[0] == q.shape[0] // 2
    assert tp_shard(q, 1, 2).equal(q[q.shape[0] // 2 :])
    norm = sent["model.norm.weight"]
    assert tp_shard(norm, 1, 2) is norm
    assert shard_checksum(sent.items(), 1, 2) != checksum(sent.items())


@pytest.mark.parametrize("load_format", ["per_tensor", "flattened_bucket"])
def test_tp_ranks_join_at_their_offsets_and_every_rank_loads(
    tp_engines: tuple[str, list[HttpEngine]], load_format: str
) -> None:
    _, engines = tp_engines
    endpoints = [e.endpoint for e in engines]
    sender = WeightSender(timeout_s=GROUP_TIMEOUT_S, bucket_bytes=4096, load_format=load_format)
    sender.connect(endpoints)  # every rank's join completes the gloo mesh of world size 4, or it fails
    first = sender.active_group_name
    sent = weights(11)
    sender.update(sent.items(), f"tp-{load_format}-1")
    _assert_every_rank_holds(engines, sent, f"tp-{load_format}-1")
    sender.disconnect()
    assert sender.last_disconnect_errors == []
    sender.connect(endpoints)
    assert sender.active_group_name != first
    sent = weights(12)
    sender.update(sent.items(), f"tp-{load_format}-2")
    _assert_every_rank_holds(engines, sent, f"tp-{load_format}-2")
    sender.disconnect()


def _bucket(entries: list[str]) -> TensorRequest:
    return tensor_request(entries, load_format="flattened_bucket", flush_cache=True, weight_version=None)


def test_a_tp_rank_reads_only_its_own_tensor_entry_and_a_short_list_is_fatal() -> None:
    import torch

    from ppo_weight_sync.testing.sglang_like import SchedulerCrash, SGLangReceiver

    receiver = SGLangReceiver(lambda named: None, torch.device("cpu"), version="0.5.23", tp_rank=1)
    with pytest.raises(SchedulerCrash, match=r"TP rank 1 reads serialized_named_tensors\[1\] of 1 entries"):
        receiver.update_weights_from_tensor(_bucket(["AAAA"]))
    # entry 0 is rank 0's: rank 1 reads entry 1, here not a payload at all
    with pytest.raises(SchedulerCrash, match=r"deserializing TP rank 1's entry failed"):
        receiver.update_weights_from_tensor(_bucket(["rank 0's", "not base64!"]))


def test_a_tensor_update_with_one_entry_for_two_tp_ranks_takes_the_server_down() -> None:
    proc, url = start_process(SPEC, seed=1, timeout_s=240, sglang_version="0.5.23", tp_size=2)
    endpoint = HttpEngineEndpoint.for_sglang(url, name="tp2", timeout_s=30)
    body = {"serialized_named_tensors": ["AAAA"], "load_format": "flattened_bucket", "flush_cache": False}
    try:
        refused = endpoint.call("POST", "/update_weights_from_tensor", body)  # no session open: a refusal
        assert not refused.success
        assert "between begin_weight_update() and end_weight_update()" in refused.message
        assert endpoint.call("POST", "/begin_weight_update", {}).success
        with pytest.raises(EngineUnavailableError, match=r"tp2.*unreachable"):
            endpoint.call("POST", "/update_weights_from_tensor", body)  # TP rank 1 has no entry
        assert proc.wait(30) == 1  # the scheduler's IndexError took the server down
    finally:
        endpoint.close()
        proc.kill()
        proc.wait(30)
