"""Partial rollouts on server engines (``engine.server_chunks``): a call with an early stop generated in
chunks, checked between them; over vLLM's completions route (a stand-in on 127.0.0.1 that answers
with known tokens) and through a rollout manager whose SGLang engine is the stand-in server, its paused
samples continued after a weight update."""

from __future__ import annotations

import concurrent.futures
import json
import math
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoModelForCausalLM

from ppo_rollout.config import (
    MultiTurnSettings,
    PartialSettings,
    RolloutConfig,
    SamplingConfig,
    SamplingSettings,
    SGLangOptions,
)
from ppo_rollout.engine.early_stop import PAUSED, EarlyStop
from ppo_rollout.engine.server_chunks import chunk_seed
from ppo_rollout.engine.vllm_client import VLLMClient
from ppo_rollout.engine.vllm_handle import VLLMEngineHandle
from ppo_rollout.manager import RolloutManager
from ppo_rollout.rollout_fns import register_rollout_function
from ppo_rollout.stops import RequestStop
from ppo_rollout.tasks import make_tiny_model
from ppo_rollout.testing.long_tail import LongTailRollout
from ppo_value_transport import unpack_fields
from ppo_weight_sync import WeightSender
from ppo_weight_sync.vllm_endpoint import VLLMEngineEndpoint

pytestmark = pytest.mark.timeout(300)

LONG_TAIL = LongTailRollout(median=9, longest=24, sigma=0.8, seed=1)
register_rollout_function("server_partial_long_tail")(LONG_TAIL)


# ------------------------------------------------------------------------------ chunks over vLLM's route
class _Lengths(BaseHTTPRequestHandler):
    """``POST /v1/completions`` as vLLM answers it, with known tokens: a prompt ``[L, 1, made...]`` is a
    sample whose natural length is ``L`` (it ends with finish "stop" there), its response tokens are
    ``100, 101, ...`` and the log-prob of token ``j`` is ``-(j + 1) / 64``; ``max_tokens`` cuts it
    ("length"). Every body is recorded."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server: Any = self.server
        with server.lock:
            server.bodies.append(body)
        prompt = body["prompt"]
        made = len(prompt) - 2
        count = min(body["max_tokens"], prompt[0] - made)
        choice = {
            "index": 0,
            "token_ids": [100 + made + i for i in range(count)],
            "logprobs": {"token_logprobs": [-(made + i + 1) / 64 for i in range(count)]},
            "finish_reason": "stop" if made + count == prompt[0] else "length",
        }
        data = json.dumps({"object": "text_completion", "choices": [choice]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def vllm_handle() -> Iterator[tuple[VLLMEngineHandle, list[dict[str, Any]]]]:
    server: Any = ThreadingHTTPServer(("127.0.0.1", 0), _Lengths)
    server.bodies, server.lock = [], threading.Lock()
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    handle = VLLMEngineHandle.__new__(VLLMEngineHandle)  # the handle's generate, on a client made here
    handle.name = "rollout-0"
    handle._client = VLLMClient(VLLMEngineEndpoint(url, [("w", "float32", (2,))], timeout_s=10.0, name="v"))
    handle._pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        yield handle, server.bodies
    finally:
        handle._pool.shutdown()
        handle.client.close()
        server.shutdown()
        server.server_close()


PROMPTS = [[3, 1], [5, 1], [9, 1], [14, 1]]  # natural lengths 3, 5, 9, 14
LIMITS = [20, 20, 20, 12]  # the last one is cut at 12


def _generate(handle: VLLMEngineHandle, until: EarlyStop, stop: list[RequestStop] | None = None) -> Any:
    sampling = SamplingConfig(n_samples_per_prompt=1)
    wait = handle.submit_generate(PROMPTS, sampling, 5, max_new_tokens=LIMITS, stop=stop, until=until)
    return wait(10.0)


def _chunks(bodies: list[dict[str, Any]]) -> list[list[tuple[int, int]]]:
    """The requests grouped by chunk (their seeds, one per chunk and sample), as (natural length,
    max_tokens) pairs in prompt order."""
    by_chunk: dict[int, list[tuple[int, int]]] = {}
    for body in bodies:
        chunk = (len(body["prompt"]) - 2 + 3) // 4  # chunk k sends 4k tokens so far (chunk_tokens 4)
        by_chunk.setdefault(chunk, []).append((body["prompt"][0], body["max_tokens"]))
    return [sorted(by_chunk[k]) for k in sorted(by_chunk)]


def test_the_rule_stops_the_chunks_at_the_right_count(
    vllm_handle: tuple[VLLMEngineHandle, list[dict[str, Any]]],
) -> None:
    handle, bodies = vllm_handle
    out = _generate(handle, EarlyStop(finished=2, chunk_tokens=4))
    # chunk 1: the 3-token sample ends (1 finished); chunk 2: the 5-token one ends (2): no third chunk
    assert _chunks(bodies) == [[(3, 4), (5, 4), (9, 4), (14, 4)], [(5, 4), (9, 4), (14, 4)]]
    assert [(o.prompt_position, len(o.token_ids), o.finish_reason) for o in out] == [
        (0, 3, "stop"),
        (1, 5, "stop"),
        (2, 8, PAUSED),
        (3, 8, PAUSED),
    ]
    # each sample's tokens and log-probs are its chunks' in order; a chunk continues from the prompt and
    # the tokens so far, with the tokens left (at most the chunk) as its limit
    for o in out:
        assert o.token_ids == tuple(range(100, 100 + len(o.token_ids)))
        assert o.log_probs == tuple(-(j + 1) / 64 for j in range(len(o.token_ids)))
    second = [b for b in bodies if len(b["prompt"]) > 2]
    assert sorted(b["prompt"] for b in second) == [[L, 1, 100, 101, 102, 103] for L in (5, 9, 14)]
    # every chunk's samples draw with fresh seeds: the client's seeds of chunk_seed(5, chunk)
    seeds = {(len(b["prompt"]) > 2, b["prompt"][0]): b["seed"] for b in bodies}
    assert all(seeds[(False, L)] != seeds[(True, L)] for L in (5, 9, 14))
    assert seeds[(False, 3)] == (5 * 1_000_003 + 0) % (2**31 - 1)  # chunk 0: the plain call's seeds
    assert seeds[(True, 5)] == (chunk_seed(5, 1) * 1_000_003 + 0) % (2**31 - 1)


def test_a_call_whose_rule_is_never_reached_runs_every_sample_to_its_end(
    vllm_handle: tuple[VLLMEngineHandle, list[dict[str, Any]]],
) -> None:
    handle, bodies = vllm_handle
    out = _generate(handle, EarlyStop(finished=4, chunk_tokens=4))
    assert [(len(o.token_ids), o.finish_reason) for o in out] == [
        (3, "stop"),
        (5, "stop"),
        (9, "stop"),
        (12, "length"),  # its limit, before its natural end
    ]
    assert _chunks(bodies) == [
        [(3, 4), (5, 4), (9, 4), (14, 4)],
        [(5, 4), (9, 4), (14, 4)],
        [(9, 4), (14, 4)],  # the last one asks for the 4 tokens it has left
    ]


def test_the_token_budget_is_counted_after_each_chunk(
    vllm_handle: tuple[VLLMEngineHandle, list[dict[str, Any]]],
) -> None:
    handle, bodies = vllm_handle
    out = _generate(handle, EarlyStop(tokens=16, chunk_tokens=4))  # 3 + 4 + 4 + 4 = 15 < 16, then 24
    assert len(_chunks(bodies)) == 2
    assert [len(o.token_ids) for o in out] == [3, 5, 8, 8]
    bodies.clear()
    out = _generate(handle, EarlyStop(tokens=15, chunk_tokens=4))
    assert len(_chunks(bodies)) == 1
    assert [(len(o.token_ids), o.finish_reason) for o in out] == [
        (3, "stop"),
        (4, PAUSED),
        (4, PAUSED),
        (4, PAUSED),
    ]


def test_a_stop_that_spans_two_chunks_ends_the_sample(
    vllm_handle: tuple[VLLMEngineHandle, list[dict[str, Any]]],
) -> None:
    """The server matches stop strings within a chunk's output only: one spelled by tokens on both sides
    of a chunk's end is found by its token sequence, the sample cut after it."""
    handle, bodies = vllm_handle
    stops = [RequestStop(("</a>",), ((103, 104),))] * len(PROMPTS)
    out = _generate(handle, EarlyStop(finished=4, chunk_tokens=4), stops)
    assert [(len(o.token_ids), o.finish_reason) for o in out] == [
        (3, "stop"),
        (5, "stop"),  # its natural end: 100..104
        (5, "stop"),  # 103 | 104 across the chunks: cut after 104
        (5, "stop"),
    ]
    assert out[2].log_probs == tuple(-(j + 1) / 64 for j in range(5))
    assert all(b["stop"] == ["</a>"] for b in bodies)  # the strings still go to the server
    assert len(_chunks(bodies)) == 2


# ---------------------------------------------------------------- partial steps on the SGLang stand-in
CHUNK = 4


@pytest.fixture(scope="module")
def sglang_partial(
    ray_session: None, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RolloutManager, Path]]:
    record = tmp_path_factory.mktemp("standin") / "requests.jsonl"
    standin = SGLangOptions(
        command=(sys.executable, "-m", "ppo_rollout.testing.sglang_standin"),
        extra_args=("--standin-record", str(record), "--weight-version", "0"),
        startup_timeout_s=240,
    )
    config = RolloutConfig(
        model_path=str(tiny_model),
        engine="sglang",
        gpus_per_engine=1,
        sglang=standin,
        task="copy",
        prompts_per_step=2,
        rollout_function="server_partial_long_tail",
        sampling=SamplingSettings(
            temperature=1.0, max_new_tokens=24, n_samples_per_prompt=3, ignore_eos=True
        ),
        multi_turn=MultiTurnSettings(max_response_tokens=24),
        partial=PartialSettings(enabled=True, finish_fraction=0.5, chunk_tokens=CHUNK),
        eval_prompts=0,
        seed=5,
        timeout_s=120.0,
    )
    manager = RolloutManager(config, None, dp_size=1)
    yield manager, record
    manager.shutdown()


def _generates(record: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    return [r["body"] for r in lines if r["path"] == "/generate"]


def test_paused_samples_continue_after_a_weight_update_through_sglang(
    sglang_partial: tuple[RolloutManager, Path], tmp_path: Path
) -> None:
    manager, record = sglang_partial
    partial = manager.generation.partial
    assert partial is not None
    first = manager.generate(step=1)
    # The first round's call stopped at the chunk where half of its 6 samples had finished.
    lengths = sorted(n for g in range(2) for n in LONG_TAIL.lengths(1, g, 3))
    chunks = math.ceil(lengths[2] / CHUNK)
    calls = _generates(record)
    assert [len(b["input_ids"]) for b in calls[:chunks]] == [
        sum(n > CHUNK * k for n in lengths) for k in range(chunks)
    ]
    assert all(sp["max_new_tokens"] <= CHUNK for b in calls for sp in b["sampling_params"])
    assert first.metrics["rollout/partial/paused_samples"] > 0
    paused = [
        (g.prompt_ids, s) for g in partial.open.groups for s in g.samples if not s.finished and s.pieces
    ]
    assert paused
    assert {p.version for _, s in paused for p in s.pieces} == {0}

    # The trainer's update: other weights, version 1.
    other = make_tiny_model("copy", tmp_path / "other", seed=2)
    named = [(n, t.clone()) for n, t in AutoModelForCausalLM.from_pretrained(other).state_dict().items()]
    sender = WeightSender(backend="gloo", master_address="127.0.0.1", timeout_s=60.0)
    sender.connect(manager.endpoints())
    try:
        sender.update(named, version="1")
    finally:
        sender.disconnect()

    before = len(calls)
    second = manager.generate(step=2)
    sent = [tuple(ids) for b in _generates(record)[before:] for ids in b["input_ids"]]
    for prompt_ids, sample in paused:  # each continues from its prompt and kept tokens
        assert (*prompt_ids, *sample.token_ids) in sent
    m = second.metrics
    assert m["rollout/samples"] == 3 * m["rollout/partial/trained_groups"] >= 3
    assert m["rollout/partial/token_share_1"] > 0  # kept tokens of version 0 trained with version 1
    assert m["rollout/partial/token_share_0"] > 0
    rows = _rows(second)
    counts = [sum(r[2] == i for r in rows) for i in {r[2] for r in rows}]
    assert counts
    assert set(counts) == {3}  # the trained groups are whole
    for _, sample in paused:  # (this run's first step pauses samples of the group that trains next)
        (response, lps, _, version), *more = [
            r for r in rows if r[0][: sample.made] == list(sample.token_ids) and len(r[0]) > sample.made
        ]
        assert not more
        assert lps[: sample.made] == pytest.approx(list(sample.log_probs), abs=0.0)  # kept as drawn
        assert version == 0  # the sample's oldest token's
        assert len(response) == sample.limit  # its drawn length (eos ignored)


def _rows(batch: Any) -> list[tuple[list[int], list[float], int, int]]:
    """Each trained sample's response tokens, log-probs, prompt index and weight version."""
    rows = []
    for box in batch.boxes:
        f = unpack_fields(box)
        fields = zip(
            f["tokens"],
            f["response_length"],
            f["rollout_log_probs"],
            f["prompt_index"],
            f["weight_version"],
            strict=True,
        )
        for tokens, n, lps, index, version in fields:
            rows.append((tokens[len(tokens) - int(n) :].tolist(), lps.tolist(), int(index), int(version)))
    return rows
