"""The SGLang adapter against a stand-in server (SGLang's routes, served by the built-in engine)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ppo_rollout.batch import FIELDS
from ppo_rollout.config import RolloutConfig, SamplingConfig, SamplingSettings
from ppo_rollout.engine.core import GenerationCore
from ppo_rollout.engine.handles import SGLangEngineHandle
from ppo_rollout.engine.sglang import SGLangClient, SGLangError, SGLangServer, SGLangServerSpec
from ppo_rollout.manager import RolloutManager
from ppo_rollout.stops import RequestStop
from ppo_value_transport import unpack_fields
from ppo_weight_sync import EngineReply, EngineUnavailableError, WeightSender, free_port, reply_from_http

pytestmark = pytest.mark.timeout(300)

STANDIN = (sys.executable, "-m", "ppo_rollout.testing.sglang_standin")


def test_argv_holds_the_derived_arguments() -> None:
    spec = SGLangServerSpec(
        model_path="/m",
        port=31000,
        tp_size=2,
        base_gpu_id=4,
        enable_memory_saver=True,
        random_seed=9,
        extra_args=("--mem-fraction-static", "0.7"),
    )
    argv = spec.argv()
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    pairs = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert pairs["--model-path"] == "/m"
    assert pairs["--tp-size"] == "2"
    assert pairs["--base-gpu-id"] == "4"
    assert pairs["--host"] == "127.0.0.1"
    assert pairs["--port"] == "31000"
    assert "--enable-memory-saver" in argv
    assert "--skip-server-warmup" in argv
    assert argv[-4:] == ["--random-seed", "9", "--mem-fraction-static", "0.7"]
    assert "--enable-memory-saver" not in SGLangServerSpec(model_path="/m", port=1).argv()
    # seeded sampling is honoured only with deterministic inference and the pytorch sampling backend
    assert "--enable-deterministic-inference" in argv
    assert argv[argv.index("--sampling-backend") + 1] == "pytorch"
    # sharing GPUs: our memory share, unless extra_args names one (then only that one)
    shared = SGLangServerSpec(
        model_path="/m", port=1, enable_memory_saver=True, mem_fraction_static=0.6
    ).argv()
    assert shared[shared.index("--mem-fraction-static") + 1] == "0.6"
    assert argv.count("--mem-fraction-static") == 1
    with pytest.raises(ValueError, match="mem_fraction_static must be in"):
        SGLangServerSpec(model_path="/m", port=1, mem_fraction_static=1.5)
    with pytest.raises(ValueError, match="tp_size"):
        SGLangServerSpec(model_path="/m", port=1, tp_size=0)


def test_reply_shapes_are_normalised() -> None:
    assert reply_from_http(200, None) == EngineReply(True, "HTTP 200")
    assert reply_from_http(400, {"success": False, "message": "no"}) == EngineReply(False, "no")
    assert reply_from_http(200, {"message": "Generation paused successfully.", "status": "ok"}).success
    assert reply_from_http(400, {"error": {"message": "boom"}}) == EngineReply(False, "boom")
    assert reply_from_http(400, {"object": "error", "message": "bad", "code": 400}) == EngineReply(
        False, "bad"
    )
    assert reply_from_http(200, "Cache flushed.\n") == EngineReply(True, "Cache flushed.")
    # a 400 is never a success, whatever the body says; a lost group is a field, not a message prefix
    assert not reply_from_http(400, {"success": True, "message": "?"}).success
    assert reply_from_http(400, {"success": False, "message": "x", "group_lost": True}).group_lost


@pytest.fixture(scope="module")
def sglang_manager(
    ray_session: None, standin_config: Callable[..., RolloutConfig], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RolloutManager, Path]]:
    """A rollout manager whose one SGLang engine is the stand-in, launched through the adapter's code path."""
    record = tmp_path_factory.mktemp("standin") / "requests.jsonl"
    config = standin_config(
        record, sampling=SamplingSettings(max_new_tokens=5, n_samples_per_prompt=2), seed=1
    )
    manager = RolloutManager(config, None, dp_size=1)
    yield manager, record
    manager.shutdown()


@pytest.fixture(scope="module")
def standin(sglang_manager: tuple[RolloutManager, Path]) -> tuple[SGLangClient, Path]:
    manager, record = sglang_manager
    handle = manager.engines[0]
    assert isinstance(handle, SGLangEngineHandle)
    return handle.client, record


def _requests(record: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in record.read_text().splitlines()]


def test_generate_sends_sglang_payload_and_parses_logprobs(
    standin: tuple[SGLangClient, Path], tiny_model: Path
) -> None:
    client, record = standin
    prompts = [[1, 5, 6, 14], [1, 7, 14]]
    sampling = SamplingConfig(temperature=0.8, top_k=5, max_new_tokens=5, n_samples_per_prompt=2, seed=3)
    outs = client.generate(prompts, sampling)
    assert [o.prompt_position for o in outs] == [0, 0, 1, 1]
    body = [r for r in _requests(record) if r["path"] == "/generate"][-1]["body"]
    assert body["input_ids"] == [prompts[0], prompts[0], prompts[1], prompts[1]]
    assert body["return_logprob"] is True
    sp = body["sampling_params"]
    assert len(sp) == 4
    assert len({p["sampling_seed"] for p in sp}) == 4
    assert sp[0]["temperature"] == 0.8
    assert sp[0]["top_k"] == 5
    assert sp[0]["max_new_tokens"] == 5
    assert sp[0]["top_p"] == 1.0
    assert "stop_token_ids" not in sp[0]
    # What the server's engine produced for each request, token for token and log-prob for log-prob.
    core = GenerationCore(tiny_model)
    for k, out in enumerate(outs):
        cfg = SamplingConfig(temperature=0.8, top_k=5, max_new_tokens=5)
        (ref,) = core.generate([body["input_ids"][k]], cfg, seed=sp[k]["sampling_seed"])
        assert out.token_ids == ref.token_ids
        assert out.finish_reason == ref.finish_reason
        assert out.log_probs == pytest.approx(ref.log_probs, abs=1e-6)
    assert client.generate(prompts, sampling) == outs  # seeded: deterministic


def test_stop_strings_go_to_sglang_as_its_stop_parameter(sglang_manager: tuple[RolloutManager, Path]) -> None:
    manager, record = sglang_manager
    handle = manager.engines[0]
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=3, n_samples_per_prompt=2)
    stops = [RequestStop(("</a>", "+"), ((7, 8),)), RequestStop()]
    outs = handle.submit_generate([[1, 5, 6], [1, 7]], sampling, 4, stop=stops)(60.0)
    assert len(outs) == 4
    sp = [r for r in _requests(record) if r["path"] == "/generate"][-1]["body"]["sampling_params"]
    # SGLang matches the strings on decoded text itself; the token sequences are the built-in engine's.
    assert [p.get("stop") for p in sp] == [["</a>", "+"], ["</a>", "+"], None, None]
    with pytest.raises(ValueError, match="stop needs one entry per prompt"):
        handle.client.generate([[1, 5]], sampling, stop=[["+"], ["-"]])


def test_the_standin_stops_at_stop_strings_and_tokens_as_sglang(standin: tuple[SGLangClient, Path]) -> None:
    """SGLang 0.5.23 ``Req.update_finish_state`` (``managers/schedule_batch.py``): after each token, a stop
    string in the decoded output ends the request with the token that completed it; then a stop token;
    then the length. ``text`` loses the stop string and what follows (``trim_matched_stop``)."""
    client, _ = standin
    prompt = [1, 5, 6, 7, 14]

    def generate(**sampling: object) -> dict:  # type: ignore[type-arg]
        sp = {"temperature": 0.0, "max_new_tokens": 8, **sampling}
        body = {"input_ids": [prompt], "sampling_params": [sp], "return_logprob": True}
        (reply,) = client.endpoint.request("POST", "/generate", body)
        return reply  # type: ignore[no-any-return]

    free = generate()
    ids = free["output_ids"]
    assert free["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert len(ids) == 8
    assert free["text"] == "".join(_CHARS[i] for i in ids)
    # a stop string spanning the 3rd and 4th tokens: the output ends with the 4th, the text before it
    stop = _CHARS[ids[2]] + _CHARS[ids[3]]
    first = free["text"].find(stop)
    hit = generate(stop=["@", stop])
    assert hit["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert hit["output_ids"] == ids[: first + 2]
    assert [t[1] for t in hit["meta_info"]["output_token_logprobs"]] == ids[: first + 2]
    assert hit["text"] == free["text"][:first]
    # a stop token: the output ends with it; the string wins where both end the same token
    token = generate(stop_token_ids=[ids[1]])
    assert token["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[1]}
    assert token["output_ids"] == ids[: ids.index(ids[1]) + 1]
    both = generate(stop=_CHARS[ids[0]], stop_token_ids=[ids[0]])
    assert both["meta_info"]["finish_reason"] == {"type": "stop", "matched": _CHARS[ids[0]]}
    # through the client: the stop string's request ends as SGLang's does
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=8)
    (out,) = client.generate([prompt], sampling, stop=[[stop]])
    assert (list(out.token_ids), out.finish_reason) == (ids[: first + 2], "stop")


# The built-in tasks' character tokenizer: ids 0-3 special, then one per character (ppo_rollout.tokenizer).
_CHARS = {i + 4: c for i, c in enumerate("0123456789>=+-: ")}


def test_multi_turn_continues_from_ids_through_sglang(sglang_manager: tuple[RolloutManager, Path]) -> None:
    """Each turn is an SGLang ``/generate`` of ``input_ids`` with ``return_logprob`` (SGLang 0.5.23,
    ``sglang/srt/managers/tokenizer_manager.py`` ``_tokenize_one_request``: given ``input_ids`` are used
    as they are, only ``text`` is tokenized): the ids of turn k + 1 are the prompt, every earlier turn
    and every observation."""
    import concurrent.futures
    import functools

    from ppo_rollout.config import MultiTurnSettings
    from ppo_rollout.environments.guess import GuessNumberEnvironment
    from ppo_rollout.observation import ObservationRenderer
    from ppo_rollout.rollout_fns import (
        ContextCall,
        ContextEnvironment,
        ContextTools,
        PromptGroup,
        RolloutContext,
        multi_turn,
    )
    from ppo_rollout.runner import ClientSeeds, run_rollout
    from ppo_rollout.tasks import get_task

    manager, record = sglang_manager
    tokenizer = manager.tokenizer
    rows = [get_task("guess_digit").row(i, 3) for i in range(3)]
    groups = [
        PromptGroup(i, row, row["prompt"], tuple(tokenizer(row["prompt"])["input_ids"]), 2)
        for i, row in enumerate(rows)
    ]
    sampling = SamplingSettings(max_new_tokens=2, n_samples_per_prompt=2, stop_token_ids=tuple(range(4, 14)))
    limits = MultiTurnSettings(max_turns=3, max_response_tokens=20)
    pool = concurrent.futures.ThreadPoolExecutor(4)
    environment = functools.partial(GuessNumberEnvironment, higher_text="+", lower_text="-")

    def context(client):  # type: ignore[no-untyped-def]
        observations = ObservationRenderer(tokenizer, chat_template=False, max_tokens=16)
        seat = ContextEnvironment(environment, "guess_number", pool=pool)
        tools = ContextTools(tokenizer, limits, observations, seat)
        return RolloutContext(client, tools, ContextCall(sampling, (0,)))

    run = run_rollout(multi_turn, "multi_turn", groups, manager.engines, context, ClientSeeds(1, 0, 0), 120)
    pool.shutdown()
    bodies = [r["body"] for r in _requests(record) if r["path"] == "/generate"]
    sent = [tuple(ids) for b in bodies for ids in b["input_ids"]]
    assert all(b["return_logprob"] is True for b in bodies)
    for t in run.trajectories:
        position = 0
        for segment in t.segments:
            if segment.generated:
                assert (*t.prompt_tokens, *t.response_tokens[:position]) in sent
                assert len(segment.log_probs) == len(segment.token_ids)
            position += len(segment.token_ids)
    assert max(t.num_turns for t in run.trajectories) > 1


def test_manager_batch_from_sglang_engine(sglang_manager: tuple[RolloutManager, Path]) -> None:
    manager, _ = sglang_manager
    (box,) = manager.generate(step=0).boxes
    fields = unpack_fields(box)
    assert set(fields) == set(FIELDS)
    assert len(fields["tokens"]) == 4
    assert [int(i) for i in fields["prompt_index"]] == [0, 0, 1, 1]
    for k in range(4):
        n = int(fields["response_length"][k])
        assert fields["rollout_log_probs"][k].shape == (n,)
        assert fields["loss_mask"][k].tolist() == [1.0] * n


def test_weights_checksum_reads_the_weights_back_from_the_server(
    sglang_manager: tuple[RolloutManager, Path], standin: tuple[SGLangClient, Path], tiny_model: Path
) -> None:
    """train.check_weights with SGLang: every tensor read back (/get_weights_by_name), in the rollout's
    dtype, hashes as the actor's weights do; with rows, both sides hash the same first rows."""
    from ppo_rollout.engine.handles import model_manifest
    from ppo_weight_sync.sglang_weights import rows_checksum

    manager, _ = sglang_manager
    client, record = standin
    state = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    named = [(n, t.to(torch.float32)) for n, t in state.items()]
    assert manager.weights_checksums() == [rows_checksum(named)]
    manifest = model_manifest(str(tiny_model), "float32")
    assert [n for n, _, _ in manifest] == list(state)
    assert client.weights_checksum(manifest, rows=2) == rows_checksum(named, 2) != rows_checksum(named)
    asked = [r["body"] for r in _requests(record) if r["path"] == "/get_weights_by_name"][-len(named) :]
    assert {b["truncate_size"] for b in asked} == {2}
    # a tensor the server does not hold is named
    with pytest.raises(SGLangError, match=r"could not give the weights of model\.nothing\.weight"):
        client.read_weights([("model.nothing.weight", "float32", (2, 2))])


def test_weight_update_over_http_changes_generations(
    sglang_manager: tuple[RolloutManager, Path], standin: tuple[SGLangClient, Path], tmp_path: Path
) -> None:
    from ppo_rollout.tasks import make_tiny_model

    manager, _ = sglang_manager
    client, record = standin
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=6)
    prompts = [[1, 5, 6, 14]]
    before = client.generate(prompts, greedy)
    other = make_tiny_model("copy", tmp_path / "other", seed=2)
    named = [(n, t.clone()) for n, t in AutoModelForCausalLM.from_pretrained(other).state_dict().items()]
    sender = WeightSender(backend="gloo", master_address="127.0.0.1", timeout_s=60.0)
    sender.connect(manager.endpoints())  # HttpEngineEndpoint: SGLang's routes
    try:
        sender.update(named, version="v7")
    finally:
        sender.disconnect()
    assert client.endpoint.get_weight_version().result(60) == "v7"
    after = client.generate(prompts, greedy)
    assert after == GenerationCore(other).generate(prompts, greedy)
    assert after != before
    paths = [r["path"] for r in _requests(record)]
    for route in (
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
    ):
        assert route in paths
    update = next(r for r in _requests(record) if r["path"] == "/update_weights_from_distributed")["body"]
    assert update["weight_version"] == "v7"
    assert update["names"]
    assert len(update["names"]) == len(update["shapes"])


def test_control_and_memory_routes(
    sglang_manager: tuple[RolloutManager, Path], standin: tuple[SGLangClient, Path]
) -> None:
    manager, _ = sglang_manager
    client, record = standin
    assert client.endpoint.pause_generation().result(60).success
    assert _requests(record)[-1]["body"] == {"mode": client.protocol.pause_mode}  # chosen, never {}
    assert client.endpoint.continue_generation().result(60).success
    assert client.endpoint.flush_cache().result(60).success
    # Ours -> SGLang's tags, cuda_graph included; SGLang's release is not idempotent, so the client never
    # sends a tag twice (a second release, or a resume of a tag not released, would take the server down).
    assert client.release_memory_occupation(tags=["weights", "kv_cache"]).success
    assert _requests(record)[-1]["body"] == {"tags": ["kv_cache", "weights", "cuda_graph"]}
    count = len(_requests(record))
    assert client.release_memory_occupation(tags=None).success
    assert len(_requests(record)) == count  # nothing sent
    assert client.resume_memory_occupation(tags=None).success
    # the release paused the server to make it idle; the resume of the last tag continues it
    assert [(r["path"], r["body"]) for r in _requests(record)[-2:]] == [
        ("/resume_memory_occupation", {"tags": ["kv_cache", "weights", "cuda_graph"]}),
        ("/continue_generation", {}),
    ]
    assert client.resume_memory_occupation(tags=None).success
    assert len(_requests(record)) == count + 2
    manager.offload()  # the manager's path: every tag on every engine
    assert {k: _requests(record)[-1][k] for k in ("path", "body", "status")} == {
        "path": "/release_memory_occupation",
        "body": {"tags": ["kv_cache", "weights", "cuda_graph"]},
        "status": 200,
    }
    manager.onload()
    refused = client.release_memory_occupation(tags=["bogus"])
    assert not refused.success
    assert "unknown memory tags ['bogus']" in refused.message
    assert client.health()


def test_client_errors(standin: tuple[SGLangClient, Path]) -> None:
    client, _ = standin
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        client.generate([[1], []], SamplingConfig())
    # refused before it is sent (a real 0.5.17 server dies on one), naming the prompt and the ids
    assert client.vocab_size is not None
    with pytest.raises(ValueError, match=r"prompt 0 holds token id\(s\) \[999\] outside the model's vocab"):
        client.generate([[1, 999]], SamplingConfig(max_new_tokens=2))
    # a client told no vocabulary sends it, and the stand-in refuses it with a 400
    raw = SGLangClient(client.base_url, timeout_s=30, name="raw")
    with pytest.raises(SGLangError, match="refused /generate: prompt 0 has token ids outside"):
        raw.generate([[1, 999]], SamplingConfig(max_new_tokens=2))
    raw.close()
    # The client reads the server's version first: an unreachable server fails there, named.
    with pytest.raises(EngineUnavailableError, match="engine 'nobody': server_info failed: unreachable"):
        SGLangClient(f"http://127.0.0.1:{free_port()}", timeout_s=5, name="nobody")


def test_failed_start_names_the_server_and_its_exit_code(tmp_path: Path) -> None:
    spec = SGLangServerSpec(
        model_path="/m",
        port=free_port(),
        command=(sys.executable, "-c", "import sys; print('bad flag'); sys.exit(3)"),
    )
    server = SGLangServer(spec, startup_timeout_s=60, name="engine-7", log_path=tmp_path / "log")
    with pytest.raises(
        SGLangError, match=r"(?s)engine-7 exited with code 3 before /health answered.*bad flag"
    ):
        server.start()


def test_health_timeout_then_sigkill_when_sigterm_is_ignored(tmp_path: Path) -> None:
    script = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
        "time.sleep(120)"
    )
    spec = SGLangServerSpec(model_path="/m", port=free_port(), command=(sys.executable, "-c", script))
    server = SGLangServer(spec, startup_timeout_s=3, stop_grace_s=1, name="stuck", log_path=tmp_path / "log")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="SGLang server stuck did not answer /health with 200 within 3 s"):
        server.start()
    assert not server.is_running()
    assert server.stop() == -9  # SIGTERM was ignored: killed
    assert time.monotonic() - t0 < 30


def test_shutdown_stops_the_server(
    sglang_manager: tuple[RolloutManager, Path], standin: tuple[SGLangClient, Path]
) -> None:
    # Last in this module: it ends the module's server.
    manager, _ = sglang_manager
    client, _ = standin
    assert client.health()
    manager.shutdown()
    manager.shutdown()  # idempotent
    assert not client.health()
    with pytest.raises(EngineUnavailableError, match="server_info failed: unreachable"):
        SGLangClient(client.base_url, timeout_s=5)


def test_stop_sends_sigterm_to_the_process_group(tmp_path: Path) -> None:
    # The server's child must go too: stop() signals the whole group.
    script = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        "open(sys.argv[-1], 'w').write(str(child.pid)); time.sleep(120)"
    )
    pid_file = tmp_path / "child.pid"
    spec = SGLangServerSpec(
        model_path="/m", port=free_port(), command=(sys.executable, "-c", script), extra_args=(str(pid_file),)
    )
    server = SGLangServer(spec, startup_timeout_s=2, stop_grace_s=5, log_path=tmp_path / "log")
    with pytest.raises(TimeoutError):
        server.start()  # it never serves /health; start() stops it
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except OSError:
        return False
