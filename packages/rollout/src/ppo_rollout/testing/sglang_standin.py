"""A stand-in for ``python -m sglang.launch_server``: SGLang's routes and rules, the built-in engine's model.

Its receiving side is SGLang's, rebuilt from SGLang's source (:mod:`ppo_weight_sync.testing.sglang_like`):
the same group creation (no warm-up broadcast), reply shapes, status codes and messages, the weight-update
session from 0.5.21, ``/server_info`` with the version, ``/model_info`` with the weight version, 404 on
``/get_weight_version``, a flush refused (400) while requests are pending, memory tags that are not
idempotent (a resume of a tag not released, or a release while busy, takes the server down), 400
``{"object": "error"}`` validation replies. Generation follows SGLang's pause modes
(``sglang/srt/managers/tokenizer_manager.py``, 0.5.15.post1 and 0.5.23): while paused, new requests wait
for ``continue_generation``; ``abort`` (the default) ends requests in flight with
``finish_reason.type == "abort"``; ``retract`` puts them back in the queue and runs them again from the
start after ``continue_generation``; ``in_place`` holds them between two decode steps.

Replies carry 0.5.17's keys (checked against a real server's recording, ``tests/test_sglang_replay.py``):
``/server_info`` the server arguments the stand-in holds (:mod:`.sglang_server_args`), ``/model_info``
the ``embedding`` plan, ``meta_info`` the log-prob lengths, ``dp_rank`` and the prompt tokens a radix
cache would have reused (:mod:`.sglang_radix`); the weight version starts as ``--weight-version``
(``"default"``).

``--standin-version`` picks the SGLang version to behave as (default 0.5.23). Every request is appended
to ``--standin-record`` (JSON lines, with the answer's status) so tests can check routes and payloads.
Test knobs: ``--standin-startup-delay S`` (no answer for S seconds), ``--standin-exit-code C`` (exit at
once), ``--standin-ignore-sigterm`` (so that stopping needs SIGKILL), ``--standin-step-delay S`` (sleep
per decode step, so tests can pause a generation midway).

LoRA (``--enable-lora``, ``--max-lora-rank``, ``--lora-target-modules``): ``/load_lora_adapter_from_tensors``,
``/unload_lora_adapter``, ``GET /v1/models`` and ``lora_path`` in ``/generate``, as SGLang 0.5.23 answers them
(:mod:`ppo_weight_sync.testing.sglang_lora`): the engine generates with the base merged with the adapter a
request names, and its checksum is of those weights (the last loaded adapter's, between requests).

Stop conditions as SGLang 0.5.23's ``Req.update_finish_state`` (``managers/schedule_batch.py``), checked
after each token: a ``stop`` string found in the decoded output so far ends it (``finish_reason``
``{"type": "stop", "matched": <the string>}``, the token that completed it kept), before a token of
``stop_token_ids`` (``{"type": "stop", "matched": <id>}``), before the length (``{"type": "length",
"length": max_new_tokens}``). ``text`` is the decoded output with a matched stop string and what follows
cut off (``detokenizer_manager.py`` ``trim_matched_stop``, ``no_stop_trim`` false).

``--tp-size N`` runs TP ranks 1..N-1 as processes of their own (:mod:`ppo_weight_sync.testing.sglang_tp`):
each joins the weight group at ``rank_offset + tp_rank`` and keeps its shard of every tensor it receives;
rank 0 is the built-in engine (whole weights, it generates). ``GET /standin_tp_checksums`` gives every
rank's checksum, for tests.

Run: ``python -m ppo_rollout.testing.sglang_standin --model-path DIR --port 30000``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported lazily: the failure knobs act before torch is loaded
    import torch

    from ppo_weight_sync.routes import RouteResult
    from ppo_weight_sync.testing.sglang_like import SGLangServerState
    from ppo_weight_sync.testing.sglang_lora import SGLangLora

    from ..config import SamplingConfig
    from ..engine.builtin import BuiltinEngine
    from .sglang_server_args import StandinArgs

DEFAULT_VERSION = "0.5.23"


def _stop_strings(sp: dict[str, Any]) -> list[str]:
    """``stop``: a string or a list of strings (``SamplingParams.normalize``); empty ones never match."""
    stop = sp.get("stop") or []
    strings = [stop] if isinstance(stop, str) else list(stop)
    if not all(isinstance(s, str) for s in strings):
        raise ValueError(f"sampling_params.stop must be a string or a list of strings, got {stop!r}")
    return [s for s in strings if s]


def _finish(out: Any, stops: Sequence[str], decode: Any, limit: int) -> tuple[Any, dict[str, Any], str]:
    """The output cut where SGLang's ``update_finish_state`` ends it, its ``finish_reason`` and ``text``.

    The engine ran to a stop token or the length; the tokens it drew before a stop string matched are the
    ones SGLang draws (one request per call, seeded: the first k tokens do not depend on what follows)."""
    import dataclasses

    ids = list(out.token_ids)
    for n in range(1, len(ids) + 1) if stops else ():
        text = decode(ids[:n])
        matched = next((s for s in stops if s in text), None)
        if matched is not None:
            cut = dataclasses.replace(
                out, token_ids=out.token_ids[:n], log_probs=out.log_probs[:n], finish_reason="stop"
            )
            return cut, {"type": "stop", "matched": matched}, text[: text.find(matched)]
    if out.finish_reason == "stop":
        return out, {"type": "stop", "matched": ids[-1]}, decode(ids[:-1]) or ""
    return out, {"type": "length", "length": limit}, decode(ids) or ""


def _sampling(sp: dict[str, Any]) -> tuple[SamplingConfig, int]:
    from ..config import SamplingConfig

    top_k = int(sp.get("top_k", -1))
    cfg = SamplingConfig(
        temperature=float(sp.get("temperature", 1.0)),
        top_p=float(sp.get("top_p", 1.0)),
        top_k=0 if top_k < 0 else top_k,
        max_new_tokens=int(sp.get("max_new_tokens", 128)),
        stop_token_ids=tuple(int(t) for t in sp.get("stop_token_ids") or ()),
        ignore_eos=bool(sp.get("ignore_eos", False)),
    )
    return cfg, int(sp.get("sampling_seed") or 0)


def _meta_info(
    reason: Any, prompt: int, completion: int, version: Any, started: float, cached: int, logprobs: Any
) -> dict[str, Any]:
    """A finished request's ``meta_info``, SGLang v0.5.17's keys in its order
    (``managers/tokenizer_manager.py`` ``_handle_batch_output``, metrics off; ``add_logprob_to_meta_info``
    where ``logprobs`` is given, the prompt's own log-probs empty as ``logprob_start_len`` -1 leaves
    them; ``cached_tokens_details`` from :mod:`.sglang_radix`; ``dp_rank`` None without data
    parallelism)."""
    import uuid

    from .sglang_radix import cached_tokens_details

    meta: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "finish_reason": reason,
        "prompt_tokens": prompt,
        "weight_version": version,
        "num_retractions": 0,
    }
    if logprobs is not None:
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = logprobs
        meta["output_token_logprobs_length"] = len(logprobs)
    return {
        **meta,
        "reasoning_tokens": 0,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "cached_tokens_details": cached_tokens_details(cached),
        "dp_rank": None,
        "e2e_latency": time.time() - started,
        "response_sent_to_client_ts": time.time(),
    }


class _Generation:
    """The tokenizer manager's pause gate and the scheduler's view of the built-in engine (ServerHooks)."""

    def __init__(self, engine: BuiltinEngine, lora: SGLangLora, weights_cpu_backup: bool = False) -> None:
        from .sglang_radix import PrefixCache

        self.engine = engine
        self.lora = lora
        self.cache = PrefixCache()  # the radix cache's reuse, for meta_info's cached_tokens
        # SGLang 0.5.17 without --enable-weights-cpu-backup resumes released weights as zeros
        # (torch_memory_saver keeps no contents; seen on a real server): so does the stand-in.
        self.weights_cpu_backup = weights_cpu_backup
        self.cond = threading.Condition()
        self.paused_mode: str | None = None
        self.running = 0  # in the scheduler's running batch
        self.waiting = 0  # retracted: back in the scheduler's waiting queue until continue_generation

    # -- ServerHooks -----------------------------------------------------------------------------------
    def pause(self, mode: str) -> None:
        with self.cond:
            self.paused_mode = mode
        if mode == "in_place":
            self.engine.pause_generation()
            return
        # abort: requests in flight end now; retract: they end now and run again after continue. SGLang's
        # abort pause returns once none is left running (tokenizer_manager.pause_generation's loop).
        self.engine.abort_requests()
        deadline = time.monotonic() + 60
        while self.engine.active_requests() and time.monotonic() < deadline:
            time.sleep(0.01)

    def resume(self) -> None:
        self.engine.continue_generation()
        with self.cond:
            self.paused_mode = None
            self.cond.notify_all()

    def running_requests(self) -> int:
        with self.cond:
            return self.running

    def waiting_requests(self) -> int:
        with self.cond:
            return self.waiting

    def flush(self) -> None:
        self.engine.flush_cache()
        self.cache.clear()

    def release(self, tags: Sequence[str]) -> None:
        from ..engine.builtin import MEMORY_TAGS

        if "kv_cache" in tags:  # weight_updater.release_memory_occupation: the KV cache goes, flushed
            self.cache.clear()
        reply = self.engine.release_memory_occupation(tags=[t for t in tags if t in MEMORY_TAGS])
        if not reply.success:
            raise RuntimeError(reply.message)

    def restore(self, tags: Sequence[str]) -> None:
        from ..engine.builtin import MEMORY_TAGS

        reply = self.engine.resume_memory_occupation(tags=[t for t in tags if t in MEMORY_TAGS])
        if not reply.success:
            raise RuntimeError(reply.message)
        if "weights" in tags and not self.weights_cpu_backup:
            import torch

            zeros = [(n, torch.zeros_like(t)) for n, t in self.engine._core.named_tensors()]
            self.engine._load_weights(zeros)  # through the loader: fused copies follow

    def cache_key(self, adapter: str | None) -> tuple[str | None, int]:
        """The radix cache's key of a request with ``adapter``: its LoRA id (a reload is another)."""
        return adapter, id(self.lora.adapters.get(adapter)) if adapter is not None else 0

    # -- one request -----------------------------------------------------------------------------------
    def run(self, prompt: list[int], cfg: SamplingConfig, seed: int, adapter: str | None) -> Any:
        """The engine's output, or None when the request was aborted. ``adapter``: the LoRA adapter the
        request names (``lora_path``), held while it runs."""
        from ..engine.builtin import GenerationAborted

        retracted = False
        while True:
            with self.cond:
                # New requests wait while paused (tokenizer_manager: is_pause_cond.wait_for(not is_pause)),
                # outside the scheduler; a retracted one waits in the scheduler's waiting queue.
                while self.paused_mode is not None and self.paused_mode != "in_place":
                    self.cond.wait()
                if retracted:
                    self.waiting -= 1
                    retracted = False
                self.running += 1
            try:
                with self.lora.use(adapter):
                    return self.engine.generate([prompt], cfg, seed=seed)[0]
            except GenerationAborted:
                with self.cond:
                    retracted = self.paused_mode == "retract"
                    self.waiting += int(retracted)
                if not retracted:
                    return None
            finally:
                with self.cond:
                    self.running -= 1


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, payload: Any, path: str = "") -> None:
        text = isinstance(payload, str)
        body = (payload if text else json.dumps(payload)).encode()
        # One record per request, with its answer's status, written before the answer leaves: a client
        # that reads the record after its answer finds it there.
        self.server.record({**getattr(self, "_request", {"path": path or self.path}), "status": status})
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if text else "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw) if raw else None

    def do_GET(self) -> None:
        self._route("GET", None)

    def do_POST(self) -> None:
        from ppo_weight_sync.routes import validation_error

        try:
            body = self._body()
        except ValueError as exc:
            refusal = validation_error(f"JSON decode error: {exc}")
            self._send(refusal.status, refusal.body)
            return
        self._route("POST", body)

    def _route(self, method: str, body: Any) -> None:
        path = self.path.split("?", 1)[0]
        self._request = {"method": method, "path": path, "body": body}
        try:
            if path in ("/health", "/health_generate"):
                self._send(200, "", path)
            elif path == "/generate" and method == "POST":
                try:
                    self._generate(body or {}, path)
                except ValueError as exc:  # http_server.generate_request: _create_error_response(e)
                    self._send(400, {"error": {"message": str(exc)}}, path)
            elif path == "/get_weights_by_name" and method in ("GET", "POST"):
                self._weights_by_name(body, path)
            elif path == "/standin_tp_checksums" and method == "GET":
                # for tests: TP rank 0's weights (whole) and ranks 1..'s shards, in rank order
                checksums = [
                    self.server.engine.weights_checksum(),
                    *self.server.state.ranks.remote_checksums(),
                ]
                self._send(200, {"checksums": checksums}, path)
            elif (answer := self._answer(method, path, body)) is not None:
                self._send(answer.status, answer.body, path)
            else:
                self._send(404, {"detail": "Not Found"}, path)
        except Exception as exc:  # FastAPI answers an unhandled error with 500
            with contextlib.suppress(OSError):
                self._send(500, {"error": {"message": f"{type(exc).__name__}: {exc}"}}, path)

    def _weights_by_name(self, body: Any, path: str) -> None:
        from ppo_weight_sync.requests import ValidationError
        from ppo_weight_sync.routes import validation_error

        from .sglang_get_weights import get_weights_by_name

        engine = self.server.engine
        try:
            status, answer = get_weights_by_name(
                dict(engine.named_tensors()), engine._core.model.config, body
            )
        except ValidationError as exc:
            refusal = validation_error(str(exc))
            status, answer = refusal.status, refusal.body
        self._send(status, answer, path)

    def _answer(self, method: str, path: str, body: Any) -> RouteResult | None:
        """The LoRA routes, then the rest of SGLang's (None: no such route). Tensor payloads must be
        base64 (0.5.17 ``utils/msgspec_utils.py`` ``Base64Bytes``: a validation error, 400, otherwise)."""
        from ppo_weight_sync.routes import validation_error

        payload = (body or {}).get("serialized_named_tensors") if isinstance(body, dict) else None
        if isinstance(payload, list) and not all(_is_base64(p) for p in payload):
            return validation_error(
                f"1 validation error: body.serialized_named_tensors: Value error, Expected base64-encoded "
                f"bytes [{path}]"
            )
        answer = self.server.lora.handle(method, path, body)
        answer = answer if answer is not None else self.server.state.handle(method, path, body)
        if answer is None or answer.status != 200:
            return answer
        if path in ("/model_info", "/get_model_info"):
            return type(answer)(200, {**self.server.model_info, **answer.body})
        if path in ("/server_info", "/get_server_info"):  # the state's keys: what changes while it runs
            held = self.server.args.server_info(self.server.state.version)
            return type(answer)(200, {**held, **answer.body})
        return answer

    def _generate(self, body: dict[str, Any], path: str) -> None:
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            self._send(400, {"error": {"message": "input_ids is required"}}, path)
            return
        single = not isinstance(ids[0], list)
        batch = [ids] if single else ids
        params = body.get("sampling_params") or {}
        per_req = params if isinstance(params, list) else [params] * len(batch)
        # lora_path: one adapter name for every request, or one per request (GenerateReqInput)
        paths = body.get("lora_path")
        adapters = paths if isinstance(paths, list) else [paths] * len(batch)
        if len(adapters) != len(batch):
            raise ValueError(f"lora_path list length ({len(adapters)}) must match batch size ({len(batch)})")
        generation = self.server.generation
        keys = [generation.cache_key(adapter) for adapter in adapters]
        # one prefill batch: every request finds the cache as it was when the call came
        cached = [generation.cache.match(key, prompt) for key, prompt in zip(keys, batch, strict=True)]
        results = []
        for prompt, sp, adapter, key, hit in zip(batch, per_req, adapters, keys, cached, strict=True):
            started = time.time()
            cfg, seed = _sampling(sp)
            stops = _stop_strings(sp)
            if stops and self.server.decode([]) is None:
                raise ValueError("sampling_params.stop needs the model's tokenizer, which its folder lacks")
            out = generation.run(list(prompt), cfg, seed, adapter)
            version = self.server.state.receiver.weight_version
            logprobs: list[Any] | None = [] if body.get("return_logprob") else None
            if out is None:  # aborted: SGLang's abort result, no tokens to train on
                abort = {"type": "abort", "message": "Abort before prefill"}
                meta = _meta_info(abort, len(prompt), 0, version, started, hit, logprobs)
                results.append({"text": "", "output_ids": [], "meta_info": meta})
                continue
            out, reason, text = _finish(out, stops, self.server.decode, cfg.max_new_tokens)
            generation.cache.insert(key, [*prompt, *out.token_ids])
            if logprobs is not None:
                logprobs = [[lp, t, None] for lp, t in zip(out.log_probs, out.token_ids, strict=True)]
            meta = _meta_info(reason, len(prompt), len(out.token_ids), version, started, hit, logprobs)
            results.append({"text": text, "output_ids": list(out.token_ids), "meta_info": meta})
        self._send(200, results[0] if single else results, path)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        addr: tuple[str, int],
        generation: _Generation,
        state: SGLangServerState,
        record_path: str | None,
        decode: Any,
        args: StandinArgs,
    ) -> None:
        from .sglang_server_args import embedding_plan

        super().__init__(addr, _Handler)
        self.engine = generation.engine
        self.generation = generation
        self.lora = generation.lora
        self.state = state
        self.decode = decode  # token ids -> text, as SGLang's detokenizer (skip_special_tokens)
        self.args = args  # /server_info's server arguments
        config = generation.engine._core.model.config
        # /model_info's other keys (0.5.17 http_server.py model_info; weight_version comes from the state)
        self.model_info: dict[str, Any] = {
            "model_path": args.model_path,
            "tokenizer_path": args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
            "embedding": embedding_plan(args),
        }
        self._record_path = record_path
        self._record_lock = threading.Lock()

    def record(self, entry: dict[str, Any]) -> None:
        if self._record_path is None:
            return
        with self._record_lock, open(self._record_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry) + "\n")


def _is_base64(value: Any) -> bool:
    import base64
    import binascii

    try:
        base64.b64decode(value, validate=True)
    except (binascii.Error, TypeError, ValueError):
        return False
    return True


def _die(message: str) -> None:
    """Where SGLang's scheduler raises, the whole server goes down; so does the stand-in."""
    print(f"stand-in: the scheduler died: {message}", flush=True)
    os._exit(1)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """SGLang's flags the stand-in reads, and its own knobs; other flags are taken and ignored."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--base-gpu-id", type=int, default=0)
    parser.add_argument("--random-seed", type=int, default=None)
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    parser.add_argument("--skip-server-warmup", action="store_true")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-lora-rank", type=int, default=None)
    parser.add_argument("--lora-target-modules", nargs="*", default=[])
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--standin-version", default=DEFAULT_VERSION)
    parser.add_argument("--standin-record", default=None)
    parser.add_argument("--standin-startup-delay", type=float, default=0.0)
    parser.add_argument("--standin-exit-code", type=int, default=None)
    parser.add_argument("--standin-ignore-sigterm", action="store_true")
    parser.add_argument("--standin-step-delay", type=float, default=0.0)
    args, _unknown = parser.parse_known_args(argv)
    return args


def _slow_steps(engine: BuiltinEngine, delay_s: float) -> None:
    """``--standin-step-delay``: each decode step sleeps first, so tests can act while it generates."""
    step = engine._step

    @contextlib.contextmanager
    def slow_step(epoch: int) -> Any:
        time.sleep(delay_s)
        with step(epoch):
            yield

    engine._step = slow_step  # type: ignore[method-assign]


def _server_state(args: argparse.Namespace, engine: BuiltinEngine) -> tuple[_Generation, SGLangServerState]:
    """The generation hooks (LoRA included) and SGLang's server state around the engine's receiver."""
    from ppo_weight_sync.buckets import dtype_name
    from ppo_weight_sync.sglang import SGLangProtocol
    from ppo_weight_sync.testing.sglang_like import SGLangReceiver, SGLangServerState
    from ppo_weight_sync.testing.sglang_lora import SGLangLora
    from ppo_weight_sync.testing.sglang_tp import TPRanks, start_remote_ranks

    config = engine._core.model.config
    lora = SGLangLora(
        lambda: dict(engine._core.named_tensors()),
        engine._load_weights,
        per_rank=SGLangProtocol.for_version(args.standin_version).lora_payload_per_rank,
        enabled=args.enable_lora,
        max_rank=args.max_lora_rank,
        target_modules=args.lora_target_modules,
        model_name=args.model_path,
        context_len=args.context_length or getattr(config, "max_position_embeddings", None),
    )

    def load(named: Iterable[tuple[str, torch.Tensor]]) -> None:
        held = dict(engine._expected())
        named = list(named)
        for name, tensor in named:
            if name not in held:
                raise KeyError(f"{name} is not a parameter of the model")
            if tuple(tensor.shape) != tuple(held[name][1]):
                raise ValueError(f"{name}: shape {list(tensor.shape)} != {list(held[name][1])}")
        engine._load_weights(named)
        lora.base_updated([name for name, _ in named])  # whole weights are the base adapters merge onto

    receiver = SGLangReceiver(load, engine.device, version=args.standin_version, tp_rank=0)
    receiver.weight_version = args.weight_version
    # --tp-size: TP ranks 1.. in processes of their own, each joining the weight group at rank_offset +
    # tp_rank and keeping its shard of every tensor it receives (ppo_weight_sync.testing.sglang_tp)
    spec = {n: (dtype_name(d), list(shape)) for n, (d, shape) in engine._expected().items()}
    remotes = start_remote_ranks(
        spec, version=args.standin_version, tp_size=args.tp_size, device=str(engine.device), timeout_s=1800.0
    )
    generation = _Generation(engine, lora, args.enable_weights_cpu_backup)
    return generation, SGLangServerState(args.standin_version, TPRanks(receiver, remotes), generation, _die)


def _decoder(model_path: str) -> Any:
    """Token ids -> text as SGLang's detokenizer (``skip_special_tokens``); None without a tokenizer."""
    from transformers import AutoTokenizer

    try:
        tokenizer: Any = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError):  # a weights-only model folder: no text, no stop strings
        tokenizer = None

    def decode(ids: list[int]) -> str | None:
        return None if tokenizer is None else str(tokenizer.decode(ids, skip_special_tokens=True))

    return decode


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.standin_exit_code is not None:
        print(f"stand-in: exiting with code {args.standin_exit_code} as asked", flush=True)
        return int(args.standin_exit_code)
    if args.standin_ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if args.standin_startup_delay:
        time.sleep(args.standin_startup_delay)
    from ..engine.builtin import BuiltinEngine
    from .sglang_server_args import StandinArgs

    engine = BuiltinEngine(args.model_path, name=f"standin:{args.port}", torch_threads=1)
    if args.standin_step_delay:
        _slow_steps(engine, args.standin_step_delay)
    generation, state = _server_state(args, engine)
    decode = _decoder(args.model_path)
    held = StandinArgs.parsed(args, str(engine.device.type))
    server = _Server((args.host, args.port), generation, state, args.standin_record, decode, held)
    print(
        f"stand-in SGLang {args.standin_version} on http://{args.host}:{args.port} argv={sys.argv[1:]}",
        flush=True,
    )
    try:
        server.serve_forever(poll_interval=0.1)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
