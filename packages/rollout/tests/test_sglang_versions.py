"""The SGLang adapter against the stand-in in each supported version's mode (SGLang's receiving side and
server rules, rebuilt from its source): real server processes, a real gloo group, HTTP on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from ppo_rollout.config import SamplingConfig
from ppo_rollout.engine.core import GenerationCore, GenerationOutput
from ppo_rollout.engine.sglang import SGLangClient, SGLangServer, SGLangServerSpec
from ppo_rollout.tasks import make_tiny_model
from ppo_weight_sync import EngineUnavailableError, WeightSender, free_port

pytestmark = pytest.mark.timeout(300)

STANDIN = (sys.executable, "-m", "ppo_rollout.testing.sglang_standin")
VERSIONS = ["0.5.15.post1", "0.5.23"]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=24)


def _start(model: Path, version: str, record: Path, step_delay: float = 0.0) -> SGLangServer:
    extra = (
        "--standin-version",
        version,
        "--standin-record",
        str(record),
        "--standin-step-delay",
        str(step_delay),
    )
    # the weights survive a release only with a host copy (released weights come back as zeros)
    spec = SGLangServerSpec(
        model_path=str(model), port=free_port(), command=STANDIN, extra_args=extra, weights_cpu_backup=True
    )
    server = SGLangServer(spec, startup_timeout_s=240, name=f"standin-{version}")
    server.start()
    return server


def _requests(record: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in record.read_text().splitlines()]


def _named(model: Path) -> list[tuple[str, object]]:
    return [(n, t.clone()) for n, t in AutoModelForCausalLM.from_pretrained(model).state_dict().items()]


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("copy", tmp_path_factory.mktemp("other") / "model", seed=2)


@pytest.fixture(scope="module", params=VERSIONS)
def server(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, SGLangServer, SGLangClient, Path]]:
    version = request.param
    record = tmp_path_factory.mktemp(f"standin-{version}") / "requests.jsonl"
    srv = _start(tiny_model, version, record, step_delay=0.05)
    client = SGLangClient(srv.url, timeout_s=60, name=f"sglang-{version}")
    yield version, srv, client, record
    client.close()
    srv.stop()


def _long_prompt(model: Path) -> list[int]:
    """A prompt the model does not end early on, so a pause lands while it generates."""
    core = GenerationCore(model)
    for tail in range(5, 40):
        prompt = [1, tail, tail + 1, 14]
        if len(core.generate([prompt], GREEDY)[0].token_ids) == GREEDY.max_new_tokens:
            return prompt
    raise AssertionError("no prompt runs to max_new_tokens on the tiny model")


@pytest.mark.parametrize("load_format", ["per_tensor", "flattened_bucket"])
def test_update_in_both_formats_disconnect_and_reconnect(
    server: tuple[str, SGLangServer, SGLangClient, Path],
    tiny_model: Path,
    other_model: Path,
    load_format: str,
) -> None:
    _, _, client, record = server
    prompts = [[1, 5, 6, 14]]
    sender = WeightSender(backend="gloo", master_address="127.0.0.1", timeout_s=60, load_format=load_format)
    sender.connect([client.endpoint])
    first = sender.active_group_name
    sender.update(_named(other_model), version=f"{load_format}-1")  # type: ignore[arg-type]
    assert client.endpoint.get_weight_version().result(60) == f"{load_format}-1"  # read from /model_info
    assert client.generate(prompts, GREEDY) == GenerationCore(other_model).generate(prompts, GREEDY)
    sender.disconnect()
    sender.connect([client.endpoint])
    assert sender.active_group_name != first
    sender.update(_named(tiny_model), version=f"{load_format}-2")  # type: ignore[arg-type]
    sender.disconnect()
    assert client.generate(prompts, GREEDY) == GenerationCore(tiny_model).generate(prompts, GREEDY)
    paths = [r["path"] for r in _requests(record)]
    assert "/get_weight_version" not in paths
    session = client.protocol.weight_update_session
    assert ("/begin_weight_update" in paths) is session
    assert ("/end_weight_update" in paths) is session


def test_an_update_during_generation_pauses_retries_and_lands(
    server: tuple[str, SGLangServer, SGLangClient, Path], tiny_model: Path, other_model: Path
) -> None:
    version, _, client, record = server
    prompt = _long_prompt(tiny_model)
    out: list[list[GenerationOutput]] = []
    before = len([r for r in _requests(record) if r["path"] == "/generate"])
    worker = threading.Thread(target=lambda: out.append(client.generate([prompt], GREEDY)))
    worker.start()
    time.sleep(0.4)  # the generation is a few steps in (50 ms per step)
    sender = WeightSender(backend="gloo", master_address="127.0.0.1", timeout_s=60)
    sender.connect([client.endpoint])
    sender.update(_named(other_model), version="mid")  # type: ignore[arg-type]
    worker.join(60)
    sender.update(_named(tiny_model), version="back")  # type: ignore[arg-type]
    sender.disconnect()
    # Generated wholly with the new weights: aborted and sent again (abort mode, 0.5.15.post1), or
    # retracted and run again after continue (retract mode, 0.5.23).
    assert out[0] == GenerationCore(other_model).generate([prompt], GREEDY)
    generates = [r for r in _requests(record) if r["path"] == "/generate"][before:]
    pauses = [r["body"] for r in _requests(record) if r["path"] == "/pause_generation"]
    if version == "0.5.15.post1":
        assert pauses[-1] == {"mode": "abort"}
        assert len(generates) == 2  # the aborted request, sent again
    else:
        assert pauses[-1] == {"mode": "retract"}
        assert len(generates) == 1


def test_flush_is_retried_while_requests_are_pending(
    server: tuple[str, SGLangServer, SGLangClient, Path], tiny_model: Path
) -> None:
    _, _, client, record = server
    prompt = _long_prompt(tiny_model)
    worker = threading.Thread(target=lambda: client.generate([prompt], GREEDY))
    worker.start()
    time.sleep(0.3)
    assert client.endpoint.flush_cache().result(60).success  # 400 while the request runs, then 200
    worker.join(60)
    flushes = [r["status"] for r in _requests(record) if r["path"] == "/flush_cache"]
    assert flushes[-1] == 200
    assert 400 in flushes[-3:]


def test_release_and_resume_memory(
    server: tuple[str, SGLangServer, SGLangClient, Path], tiny_model: Path
) -> None:
    _, _, client, record = server
    prompts = [[1, 5, 6, 14]]
    before = client.generate(prompts, GREEDY)
    assert client.release_memory_occupation(tags=None).success
    assert client.release_memory_occupation(tags=None).success  # not sent twice: SGLang's is not idempotent
    assert client.resume_memory_occupation(tags=None).success
    assert client.resume_memory_occupation(tags=None).success
    memory = [r for r in _requests(record) if "memory_occupation" in r["path"]]
    assert [(r["path"], r["body"], r["status"]) for r in memory[-2:]] == [
        ("/release_memory_occupation", {"tags": ["kv_cache", "weights", "cuda_graph"]}, 200),
        ("/resume_memory_occupation", {"tags": ["kv_cache", "weights", "cuda_graph"]}, 200),
    ]
    assert client.generate(prompts, GREEDY) == before


def test_a_rejected_update_disconnects_and_a_reconnect_recovers(
    server: tuple[str, SGLangServer, SGLangClient, Path], tiny_model: Path
) -> None:
    _, _, client, _ = server
    named = _named(tiny_model)
    bad = [("model.not_a_weight" if i == 0 else n, t) for i, (n, t) in enumerate(named)]
    sender = WeightSender(backend="gloo", master_address="127.0.0.1", timeout_s=60)
    sender.connect([client.endpoint])
    with pytest.raises(EngineUnavailableError, match=r"model\.not_a_weight"):
        sender.update(bad, version="bad")  # type: ignore[arg-type]
    assert not sender.is_connected
    sender.connect([client.endpoint])
    sender.update(named, version="good")  # type: ignore[arg-type]
    sender.disconnect()
    assert client.endpoint.get_weight_version().result(60) == "good"


def _update_until_it_fails(sender: WeightSender, model: Path) -> None:
    for step in range(200):  # many small buckets: the kill lands inside one of these updates
        sender.update(_named(model), version=f"v{step}")  # type: ignore[arg-type]


@pytest.mark.parametrize("version", VERSIONS)
def test_an_engine_killed_mid_update_is_named(tiny_model: Path, tmp_path: Path, version: str) -> None:
    srv = _start(tiny_model, version, tmp_path / "requests.jsonl")
    client = SGLangClient(srv.url, timeout_s=30, name="doomed")
    sender = WeightSender(backend="gloo", master_address="127.0.0.1", timeout_s=30, bucket_bytes=4096)
    sender.connect([client.endpoint])
    killer = threading.Timer(0.3, srv.stop)
    killer.start()
    try:
        with pytest.raises(EngineUnavailableError, match="doomed"):
            _update_until_it_fails(sender, tiny_model)
        assert not sender.is_connected
    finally:
        killer.join()
        sender.disconnect()
        client.close()
        srv.stop()


@pytest.mark.parametrize("version", VERSIONS)
def test_a_resume_of_a_tag_not_released_takes_the_server_down(
    tiny_model: Path, tmp_path: Path, version: str
) -> None:
    # What the client's tag bookkeeping prevents: SGLang's scheduler raises KeyError and the server dies.
    srv = _start(tiny_model, version, tmp_path / "requests.jsonl")
    client = SGLangClient(srv.url, timeout_s=30, name="fragile")
    try:
        with pytest.raises(EngineUnavailableError, match="fragile"):
            client.endpoint.call("POST", "/resume_memory_occupation", {"tags": ["weights"]})
        deadline = time.monotonic() + 30
        while srv.is_running() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not srv.is_running()
    finally:
        client.close()
        srv.stop()


@pytest.mark.parametrize("version", VERSIONS)
def test_release_while_generating_waits_until_idle_then_resume_continues(
    tiny_model: Path, tmp_path: Path, version: str
) -> None:
    # SGLang's release asserts the scheduler is idle and goes down otherwise: the client pauses (the
    # version's mode) and flushes until the scheduler is idle before it releases.
    record = tmp_path / "requests.jsonl"
    srv = _start(tiny_model, version, record, step_delay=0.05)
    client = SGLangClient(srv.url, timeout_s=60, name=f"sleepy-{version}")
    try:
        prompt = _long_prompt(tiny_model)
        out: list[list[GenerationOutput]] = []
        worker = threading.Thread(target=lambda: out.append(client.generate([prompt], GREEDY)))
        worker.start()
        time.sleep(0.4)  # a few steps in
        assert client.release_memory_occupation(tags=None).success
        assert srv.is_running()
        time.sleep(0.3)
        assert worker.is_alive()  # held while the memory is released
        assert client.resume_memory_occupation(tags=None).success
        worker.join(60)
        assert out[0] == GenerationCore(tiny_model).generate([prompt], GREEDY)
        calls = [(r["path"], r["status"]) for r in _requests(record) if r["path"] != "/generate"]
        release = calls.index(("/release_memory_occupation", 200))
        before = [p for p, _ in calls[:release]]
        assert "/pause_generation" in before
        assert calls[release - 1] == ("/flush_cache", 200)  # idle: the same check as release's assert
        after = [p for p, _ in calls[release:]]
        assert after == ["/release_memory_occupation", "/resume_memory_occupation", "/continue_generation"]
        pause = next(r["body"] for r in _requests(record) if r["path"] == "/pause_generation")
        assert pause == {"mode": client.protocol.pause_mode}
    finally:
        client.close()
        srv.stop()


@pytest.mark.parametrize("version", VERSIONS)
def test_a_release_while_busy_takes_the_server_down_without_an_answer(
    tiny_model: Path, tmp_path: Path, version: str
) -> None:
    # What the client's pause and idle wait prevent: the scheduler's assert fails, it sends SIGQUIT to the
    # server, which kills its process tree; the request gets no HTTP answer at all.
    srv = _start(tiny_model, version, tmp_path / "requests.jsonl", step_delay=0.05)
    client = SGLangClient(srv.url, timeout_s=30, name="busy")
    try:
        prompt = _long_prompt(tiny_model)
        worker = threading.Thread(target=lambda: _swallow(lambda: client.generate([prompt], GREEDY)))
        worker.start()
        time.sleep(0.4)
        with pytest.raises(EngineUnavailableError, match=r"busy.*unreachable"):
            client.endpoint.call("POST", "/release_memory_occupation", {"tags": ["kv_cache"]})
        deadline = time.monotonic() + 30
        while srv.is_running() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not srv.is_running()
        worker.join(60)
    finally:
        client.close()
        srv.stop()


def _swallow(call: Callable[[], object]) -> None:
    # the server dies under the call; the test checks the server, not this call
    with contextlib.suppress(Exception):
        call()


@pytest.mark.parametrize("version", VERSIONS)
def test_engines_with_tensor_parallelism_update_every_tp_rank(
    tiny_model: Path, other_model: Path, tmp_path: Path, version: str
) -> None:
    from ppo_weight_sync import checksum
    from ppo_weight_sync.testing.sglang_tp import shard_checksum

    sizes = (2, 1)  # world size 4: engine 0's TP ranks at 1 and 2, engine 1 at 3
    servers = []
    for i, tp in enumerate(sizes):
        extra = ("--standin-version", version, "--standin-record", str(tmp_path / f"r{i}.jsonl"))
        spec = SGLangServerSpec(
            model_path=str(tiny_model), port=free_port(), tp_size=tp, command=STANDIN, extra_args=extra
        )
        servers.append(SGLangServer(spec, startup_timeout_s=240, name=f"tp{tp}-{version}"))
    for srv in servers:
        srv.start()
    clients = [
        SGLangClient(s.url, timeout_s=60, name=f"tp{tp}", num_gpus=tp)
        for s, tp in zip(servers, sizes, strict=True)
    ]
    try:
        assert [c.endpoint.num_gpus for c in clients] == list(sizes)
        prompts = [[1, 5, 6, 14]]
        for load_format, model in (("per_tensor", other_model), ("flattened_bucket", tiny_model)):
            sender = WeightSender(
                backend="gloo", master_address="127.0.0.1", timeout_s=60, load_format=load_format
            )
            sender.connect([c.endpoint for c in clients])
            named = _named(model)
            sender.update(named, version=load_format)  # type: ignore[arg-type]
            sender.disconnect()
            for client, tp in zip(clients, sizes, strict=True):
                got = client.endpoint.request("GET", "/standin_tp_checksums")["checksums"]
                expected = [checksum(named)] + [shard_checksum(named, r, tp) for r in range(1, tp)]  # type: ignore[arg-type]
                assert got == expected, f"{client.name} ({load_format})"
                assert client.endpoint.get_weight_version().result(60) == load_format
                assert client.generate(prompts, GREEDY) == GenerationCore(model).generate(prompts, GREEDY)
    finally:
        for client in clients:
            client.close()
        for srv in servers:
            srv.stop()
