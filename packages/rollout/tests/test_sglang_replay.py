"""Recorded SGLang v0.5.17 exchanges, replayed against the stand-in (a real process on 127.0.0.1).

Each file of ``fixtures/sglang-0.5.17/<server>/`` is one step of ``ppo_rollout.testing.sglang_exercise``,
recorded by ``benchmarks/sglang/record.py`` through the adapter. Steps replay in order on one stand-in per
server folder (the state one leaves is what the next expects): a step whose requests stand alone is sent
as recorded (requests that overlapped in the recording overlap here, after the recorded gaps); a step that
needs a live peer (a weight group's sender, LoRA tensors) is run again through the adapter and its
exchanges compared with the recorded ones, requests included. Every answer must have the recorded status,
keys and value types, and the recorded values where they are deterministic
(:func:`ppo_rollout.testing.sglang_record.differences`); ``/server_info``, every server argument of the
real server, by its rule (:func:`~ppo_rollout.testing.sglang_record.server_info_rule`): the keys the
adapter reads with their values, and those of ``server_info_keys.txt`` (the ones the stand-in holds). The
CUDA IPC step is skipped, by name, without a GPU; no file is passed over otherwise.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ppo_rollout.engine.sglang import SGLangClient, SGLangServer, SGLangServerSpec
from ppo_rollout.testing.sglang_exercise import LORA, LORA_STEPS, STEPS, Context, make_models, run_steps
from ppo_rollout.testing.sglang_record import (
    SERVER_INFO_READ,
    Exchange,
    RecordingProxy,
    StepRecord,
    differences,
    read_fixtures,
    server_info_rule,
)
from ppo_weight_sync import free_port

pytestmark = pytest.mark.timeout(900)

FIXTURES = Path(__file__).parent / "fixtures" / "sglang-0.5.17"
FOLDERS = ("main", "lora")
KNOWN = {s.name: s for s in STEPS} | {s.name: s for s in LORA_STEPS}
STANDIN = (sys.executable, "-m", "ppo_rollout.testing.sglang_standin")
RULES = server_info_rule(FIXTURES / "server_info_keys.txt")


def _cases() -> list[tuple[str, Path, StepRecord]]:
    cases = []
    for folder in FOLDERS:
        _, steps = read_fixtures(FIXTURES / folder)
        cases += [(folder, path, record) for path, record in steps]
    return cases


CASES = _cases()


def test_every_fixture_file_is_a_known_step() -> None:
    """Nothing in the fixture folders is passed over: each JSON file is a step the replay runs."""
    files = sorted(p for p in FIXTURES.rglob("*.json") if p.name not in ("meta.json", "summary.json"))
    assert files, f"no recordings in {FIXTURES}"
    assert sorted(path for _, path, _ in CASES) == files
    for folder in FOLDERS:
        meta = json.loads((FIXTURES / folder / "meta.json").read_text())
        assert meta["models"] == "tiny", f"{folder}: the replay makes the tiny models; re-record with them"
        assert not meta.get("failures"), f"{folder} was recorded with failing steps: {meta['failures']}"
    for _, path, record in CASES:
        assert record.name == "connect" or record.name in KNOWN, f"{path.name}: unknown step {record.name!r}"
        assert record.exchanges or record.note, f"{path.name}: no exchange recorded"


def test_the_server_info_key_list_holds_real_keys() -> None:
    """Every key of ``server_info_keys.txt`` is in every recorded ``/server_info`` answer; the adapter's
    four are compared with their values."""
    rule = RULES["/server_info"]
    assert set(SERVER_INFO_READ) <= set(rule.exact) <= set(rule.keys)
    answers = [e.response for _, _, r in CASES for e in r.exchanges if e.route == "/server_info"]
    assert answers, "no /server_info recorded"
    for answer in answers:
        assert not set(rule.keys) - set(answer), sorted(set(rule.keys) - set(answer))
        assert len(answer) > 4 * len(rule.keys)  # the rest: GPU configuration the stand-in lacks


def test_the_server_info_rule_catches_what_the_adapter_reads_and_the_listed_keys() -> None:
    step = StepRecord("lora_unknown_adapter")
    recorded = next(e.response for _, _, r in CASES for e in r.exchanges if e.route == "/server_info")
    held = {k: recorded[k] for k in RULES["/server_info"].keys}
    assert differences(recorded, held, step, "/server_info", rules=RULES) == []
    found = differences(recorded, {k: v for k, v in held.items() if k != "page_size"}, step, "/server_info")
    assert any("missing" in d for d in found)  # without the rule, the whole body counts
    checks = {
        "tp_size": ({**held, "tp_size": 2}, "tp_size: 2, recorded 1"),
        "a listed key": ({k: v for k, v in held.items() if k != "page_size"}, "keys ['page_size'] missing"),
        "a listed value": ({**held, "random_seed": 7}, "random_seed: 7, recorded 0"),
        "a listed type": ({**held, "port": "30000"}, "port: str"),
        "an invented key": ({**held, "standin": 1}, "keys ['standin'] not in the recording"),
    }
    for what, (answer, expected) in checks.items():
        found = differences(recorded, answer, step, "/server_info", rules=RULES)
        assert any(expected in d for d in found), (what, found)


def test_volatile_values_keep_their_type_and_loose_values_may_change_shape() -> None:
    step = StepRecord("generate_stop", loose=["*.meta_info.finish_reason"])
    recorded = [{"meta_info": {"max_model_len": "<None>", "finish_reason": {"type": "length", "length": 8}}}]
    stopped = [{"meta_info": {"max_model_len": None, "finish_reason": {"type": "stop", "matched": 14}}}]
    assert differences(recorded, stopped, step) == []
    typed = [{"meta_info": {"max_model_len": 2048, "finish_reason": {"type": 1, "length": 8}}}]
    found = differences(recorded, typed, step)
    assert "0.meta_info.max_model_len: '<int>', recorded '<None>'" in found
    assert any(d.startswith("0.meta_info.finish_reason.type: int") for d in found)


def _spec_as_recorded(argv: list[str], model: str, folder: str, extra: tuple[str, ...]) -> SGLangServerSpec:
    """The recorded server's launch, on the stand-in: its flags, with this model and a free port (what
    ``/server_info`` answers follows them)."""

    def value(flag: str) -> str | None:
        return argv[argv.index(flag) + 1] if flag in argv else None

    seed, fraction = value("--random-seed"), value("--mem-fraction-static")
    spec = SGLangServerSpec(
        model_path=model,
        port=free_port(),
        command=STANDIN,
        enable_memory_saver="--enable-memory-saver" in argv,
        weights_cpu_backup="--enable-weights-cpu-backup" in argv,
        mem_fraction_static=None if fraction is None else float(fraction),
        random_seed=None if seed is None else int(seed),
        extra_args=extra,
        lora=LORA if folder == "lora" else None,
    )

    def flags(args: list[str]) -> list[str]:
        out = list(args)
        for flag in ("--model-path", "--port"):
            del out[out.index(flag) : out.index(flag) + 2]
        return out

    launched = spec.argv()[len(STANDIN) : len(spec.argv()) - len(extra)]
    assert flags(launched) == flags(argv), f"{folder}: the replay's flags are not the recording's"
    return spec


class _Replay:
    """One stand-in per server folder, and the models the recording used."""

    def __init__(self, folder: str, models: tuple[Path, Path], logs: Path) -> None:
        meta, _ = read_fixtures(FIXTURES / folder)
        extra = ("--standin-version", meta["version"], "--standin-step-delay", "0.003")
        spec = _spec_as_recorded(meta["argv"], str(models[0]), folder, extra)
        self.server = SGLangServer(spec, startup_timeout_s=240, log_path=logs / f"{folder}.log", name=folder)
        self.server.start()
        self.models = models


@pytest.fixture(scope="module")
def replays(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, _Replay]]:
    models = make_models(tmp_path_factory.mktemp("models"))
    logs = tmp_path_factory.mktemp("logs")
    started: dict[str, _Replay] = {}

    class Lazy(dict[str, _Replay]):
        def __missing__(self, folder: str) -> _Replay:
            started[folder] = self[folder] = _Replay(folder, models, logs)
            return started[folder]

    yield Lazy()
    for replay in started.values():
        replay.server.stop()


def _send(url: str, e: Exchange) -> tuple[int, Any]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    try:
        raw = None if e.request is None else json.dumps(e.request).encode()
        conn.request(e.method, e.route, body=raw, headers={"Content-Type": "application/json"} if raw else {})
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(body) if body else None
    except ValueError:
        return resp.status, body.decode()


def _replay_as_recorded(url: str, record: StepRecord) -> list[tuple[Exchange, int, Any]]:
    """Each exchange after the ones that ended before it started (and after its recorded gap); one that
    was still running when a later one ended runs in the background, as it did."""
    answers: dict[int, tuple[int, Any]] = {}
    threads: dict[int, threading.Thread] = {}
    t0 = time.monotonic()
    exchanges = record.exchanges
    for i, e in enumerate(exchanges):
        assert "$len" not in json.dumps(e.request), f"{e.route}: a shortened request cannot be replayed"
        for j, before in enumerate(exchanges[:i]):
            if before.end <= e.start and j in threads:
                threads[j].join(600)
        time.sleep(max(0.0, e.start - (time.monotonic() - t0)))
        overtaken = any(f.start > e.start and f.end < e.end for f in exchanges[i + 1 :])

        def run(i: int = i, e: Exchange = e) -> None:
            answers[i] = _send(url, e)

        if overtaken:
            threads[i] = threading.Thread(target=run, daemon=True)
            threads[i].start()
        else:
            run()
    for thread in threads.values():
        thread.join(600)
    return [(e, *answers.get(i, (-1, "no answer within 600 s"))) for i, e in enumerate(exchanges)]


def _rerun(replay: _Replay, record: StepRecord) -> list[tuple[Exchange, int, Any]]:
    """The step run again through the adapter against the stand-in; its exchanges paired with the
    recorded ones (their requests compared too)."""
    with RecordingProxy(replay.server.url) as proxy:
        client = SGLangClient(proxy.url, timeout_s=300, name="replay")
        ctx = Context(client, proxy, replay.models[0], replay.models[1], held=replay.models[0])
        try:
            ((_, again, error),) = list(run_steps(ctx, [KNOWN[record.name]]))
        finally:
            client.close()
    assert error is None, f"step {record.name} failed against the stand-in: {error!r}"
    got = again.exchanges
    routes = [(e.method, e.route) for e in got]
    assert routes == [(e.method, e.route) for e in record.exchanges], f"other requests: {routes}"
    problems = []
    for e, g in zip(record.exchanges, got, strict=True):
        problems += [f"request {e.route}: {d}" for d in differences(e.request, g.request, record, e.route)]
    assert not problems, "\n".join(problems)
    return [(e, g.status, g.response) for e, g in zip(record.exchanges, got, strict=True)]


@pytest.mark.parametrize(("folder", "path", "record"), CASES, ids=[f"{f}/{p.stem}" for f, p, _ in CASES])
def test_the_standin_answers_as_recorded(
    replays: dict[str, _Replay], folder: str, path: Path, record: StepRecord
) -> None:
    if record.needs == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"{path.name}: CUDA IPC needs a GPU")
    replay = replays[folder]
    if record.name == "connect" or not record.needs:
        answered = _replay_as_recorded(replay.server.url, record)
    else:
        answered = _rerun(replay, record)
    problems = []
    for k, (e, status, body) in enumerate(answered):
        where = f"{path.name} exchange {k} ({e.method} {e.route})"
        if status != e.status:
            problems.append(f"{where}: status {status}, recorded {e.status}: {str(body)[:200]}")
            continue
        problems += [f"{where}: {d}" for d in differences(e.response, body, record, e.route, rules=RULES)]
    assert not problems, "\n".join(problems)
