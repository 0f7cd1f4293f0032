"""SGLang adapter: launch ``sglang.launch_server`` as a subprocess, drive it over HTTP, stop it.

Nothing here imports sglang. The routes and fields follow SGLang's ``http_server.py`` and
``io_struct.py``: ``/health``, ``/generate`` (``input_ids`` + ``sampling_params`` +
``return_logprob``; each result's ``meta_info.output_token_logprobs`` holds
``[logprob, token_id, text]`` triples and ``meta_info.finish_reason.type`` is ``stop``, ``length``
or ``abort``), the weight-update routes, ``/pause_generation``, ``/continue_generation``,
``/flush_cache``, ``/model_info`` (the weight version), ``/server_info`` (version and ``tp_size``),
``/release_memory_occupation`` and ``/resume_memory_occupation`` (``{"tags": [...]}``).

``/get_weights_by_name`` reads the weights back for ``train.check_weights``
(:mod:`ppo_weight_sync.sglang_weights`). Checked against SGLang v0.5.17's source
(``sglang/srt/entrypoints/http_server.py``, ``managers/io_struct.py``, ``server_args.py``,
``models/llama.py`` ``get_weights_by_name``, ``utils/weight_checker.py``).

Tested with real-server recordings replayed in CI: ``benchmarks/sglang/record.py`` drives a real SGLang
0.5.17 server through this adapter and records every exchange
(``packages/rollout/tests/fixtures/sglang-0.5.17/``); ``test_sglang_replay.py`` replays them against the
stand-in (:mod:`ppo_rollout.testing.sglang_standin`), which the other tests drive. SGLang 0.5.17 has run
for real (one H100: the colocated loop, weights read back, learning; ``docs/benchmarks/sglang.md``); the
other supported versions are followed from their source.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppo_weight_sync import EngineReply, HttpEngineEndpoint, reply_from_http
from ppo_weight_sync.sglang import SGLangProtocol
from ppo_weight_sync.sglang_lora import server_args as lora_server_args
from ppo_weight_sync.sglang_weights import rows_checksum, tensor_from_reply, weights_request

from ..config import AdapterUpdates, SamplingConfig
from .core import GenerationOutput
from .server_process import ServerProcess

__all__ = ["SGLangClient", "SGLangError", "SGLangServer", "SGLangServerSpec"]

DEFAULT_COMMAND: tuple[str, ...] = (sys.executable, "-m", "sglang.launch_server")


class SGLangError(RuntimeError):
    """An SGLang server refused a request, answered something unexpected, or failed to start."""


@dataclass(frozen=True)
class SGLangServerSpec:
    """The arguments we derive for one server. ``command`` replaces ``python -m sglang.launch_server``.

    Every flag :meth:`argv` writes is one that SGLang v0.5.17's ``sglang/srt/server_args.py`` defines
    (``ServerArgs.add_cli_args``; the LoRA ones in ``arg_groups/``); ``test_sglang_launch.py`` checks them
    against the list read from that file. The flags, and why:

    - ``--skip-server-warmup``: the warm-up request can outlast launch timeouts and serves no purpose here
      (slime skips it too).
    - ``--enable-deterministic-inference`` with ``--sampling-backend pytorch`` (``deterministic``): SGLang
      honours ``sampling_seed`` only in deterministic mode, which needs the pytorch sampling backend
      (``arg_groups/overrides.py`` ``_deterministic_sampling_backend`` sets it from 0.5.17 on; 0.5.15.post1
      does not, so we always pass it).
    - ``--attention-backend triton`` (``attention_backend``): deterministic mode with no backend named
      falls back to ``fa3`` on Hopper (``_deterministic_attention_backend``), whose kernels (sgl_kernel's
      ``flash_ops``, 1.1 GB) a slim install leaves out and which older GPUs lack; triton runs wherever
      SGLang does, is one of ``DETERMINISTIC_ATTENTION_BACKEND_CHOICES`` and keeps the radix cache
      (``RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND``). None: SGLang's choice; extra_args' wins.
    - ``--enable-memory-saver`` (``enable_memory_saver``): on when the server shares its GPUs with
      training; ``release_memory_occupation`` / ``resume_memory_occupation`` need it (torch_memory_saver).
    - ``--mem-fraction-static``: the server's share of the GPU when it is not the GPU's only user.
    - ``--dtype`` (``dtype``): the dtype the actor sends its weights in. With ``--dtype auto`` SGLang serves
      a float32 checkpoint (what ``ppo-driver import-model`` writes) in float16
      (``configs/model_config.py`` ``_get_and_verify_dtype``), so bfloat16 updates were rounded to float16
      on load: seen on a real 0.5.17 server, whose weights read back then differed from the actor's.
    - ``--enable-weights-cpu-backup`` (``weights_cpu_backup``): a real 0.5.17 server that released its
      ``weights`` tag resumes them as zeros (torch_memory_saver keeps no contents without it; seen on an
      H100, and generation then ran on the zeros). The loop sends whole weights after every resume, so
      it is needed only where a resume is not followed by one: adapter-only updates, critic-only steps.
    """

    model_path: str
    port: int
    tp_size: int = 1
    base_gpu_id: int = 0
    host: str = "127.0.0.1"
    enable_memory_saver: bool = False  # on when the server shares its GPUs with training
    # The share of GPU memory the server takes for weights and KV cache (--mem-fraction-static); None:
    # SGLang's own choice, which assumes the GPU is the server's alone. Left out when extra_args has it.
    mem_fraction_static: float | None = None
    # Seeded sampling: SGLang ignores sampling_seed unless --enable-deterministic-inference is on, which
    # needs --sampling-backend pytorch (0.5.23 sets it itself, 0.5.15.post1 does not: we always pass it).
    deterministic: bool = True
    attention_backend: str | None = "triton"
    # the weights' dtype on the server (--dtype): the dtype the actor sends; None: SGLang's "auto"
    dtype: str | None = None
    # a host copy of the weights across release/resume (--enable-weights-cpu-backup)
    weights_cpu_backup: bool = False
    random_seed: int | None = None
    extra_args: tuple[str, ...] = ()
    # adapter-only weight updates: LoRA on, with train.lora's rank and modules (--enable-lora ...)
    lora: AdapterUpdates | None = None
    command: tuple[str, ...] = DEFAULT_COMMAND
    env: Mapping[str, str] = field(default_factory=dict)  # added to the server's environment
    # base_gpu_id is a physical GPU id (as placement reports it): the server's environment drops
    # CUDA_VISIBLE_DEVICES, which Ray narrows for the actor that launches it.
    physical_gpu_ids: bool = True

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.base_gpu_id < 0:
            raise ValueError(f"base_gpu_id must be >= 0, got {self.base_gpu_id}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if not self.command:
            raise ValueError(
                "command must not be empty; leave the default for python -m sglang.launch_server"
            )
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(
                "mem_fraction_static must be in (0, 1) (a share of GPU memory), "
                f"got {self.mem_fraction_static}"
            )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        args = [
            *self.command,
            "--model-path",
            self.model_path,
            "--tp-size",
            str(self.tp_size),
            "--base-gpu-id",
            str(self.base_gpu_id),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--skip-server-warmup",
        ]
        if self.enable_memory_saver:
            args.append("--enable-memory-saver")
        if self.mem_fraction_static is not None and "--mem-fraction-static" not in self.extra_args:
            args += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.deterministic:
            args += ["--enable-deterministic-inference", "--sampling-backend", "pytorch"]
        if self.attention_backend is not None and "--attention-backend" not in self.extra_args:
            args += ["--attention-backend", self.attention_backend]
        if self.dtype is not None and "--dtype" not in self.extra_args:
            args += ["--dtype", self.dtype]
        if self.weights_cpu_backup:
            args.append("--enable-weights-cpu-backup")
        if self.random_seed is not None:
            args += ["--random-seed", str(self.random_seed)]
        if self.lora is not None:
            args += lora_server_args(self.lora.rank, self.lora.target_modules)
        return args + list(self.extra_args)


class SGLangServer(ServerProcess):
    """One SGLang server subprocess in its own process group. ``start()`` returns once ``/health``
    answers 200 (:class:`~ppo_rollout.engine.server_process.ServerProcess`)."""

    KIND = "SGLang server"
    ERROR = SGLangError
    POLL_S = 0.2

    def __init__(
        self,
        spec: SGLangServerSpec,
        *,
        startup_timeout_s: float = 600.0,
        stop_grace_s: float = 15.0,
        log_path: str | Path | None = None,
        name: str = "",
    ) -> None:
        super().__init__(
            spec.url,
            startup_timeout_s=startup_timeout_s,
            stop_grace_s=stop_grace_s,
            log_path=log_path,
            name=name or f"sglang@{spec.url}",
            log_prefix="sglang-",
        )
        self.spec = spec

    def argv(self) -> Sequence[str]:
        return self.spec.argv()

    def environment(self) -> Mapping[str, str]:
        env = dict(os.environ)
        if self.spec.physical_gpu_ids:
            env.pop("CUDA_VISIBLE_DEVICES", None)
        env.update(self.spec.env)
        return env


class SGLangClient:
    """Generation and memory release over a server's HTTP routes (stdlib HTTP via ``HttpEngineEndpoint``).

    The weight and generation-control operations are ``endpoint``'s (an ``EngineEndpoint``): the sender
    reaches the server through it, and so does everything else that updates weights."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        name: str = "",
        num_gpus: int | None = None,
        abort_retries: int = 3,
        adapter: str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """``adapter``: the LoRA adapter (loaded by adapter-only weight updates,
        :mod:`ppo_weight_sync.sglang_lora`) that every generate request names in ``lora_path``.
        ``vocab_size``: prompts holding a token id outside ``0..vocab_size-1`` are refused here: a real
        0.5.17 server given one fails a device-side assert in its embedding and dies (seen on an H100),
        taking every request in flight with it."""
        # The server's version decides the protocol (pause mode, update session, version route), and its
        # tp_size the ranks it adds to a weight group: read once, here, from /server_info; an unsupported
        # version fails now, naming itself, and so does a tp_size other than num_gpus (the config's).
        self.endpoint = HttpEngineEndpoint.for_sglang(
            base_url, num_gpus=num_gpus, timeout_s=timeout_s, name=name
        )
        self.protocol: SGLangProtocol = _protocol_of(self.endpoint)
        self.timeout_s = timeout_s
        self.abort_retries = abort_retries
        self.adapter = adapter
        self.vocab_size = vocab_size
        self._released: set[str] = set()
        self._paused_to_release = False  # we paused it to release memory: resume continues it
        self._memory_lock = threading.Lock()
        self.name = self.endpoint.name
        self.base_url = self.endpoint.base_url

    def _post(self, route: str, body: dict[str, Any] | None = None) -> Any:
        return self.endpoint.request("POST", route, {} if body is None else body)

    def _check_vocab(self, prompts: Sequence[Sequence[int]]) -> None:
        if self.vocab_size is None:
            return
        for i, prompt in enumerate(prompts):
            bad = [int(t) for t in prompt if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {i} holds token id(s) {bad[:5]} outside the model's vocabulary "
                    f"(0..{self.vocab_size - 1}); SGLang server {self.name} was not sent it (a real server "
                    "dies on one)"
                )

    def health(self) -> bool:
        try:
            self.endpoint.request("GET", "/health")
        except Exception:
            return False
        return True

    # -- generation --------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: int | None = None,
        *,
        max_new_tokens: Sequence[int] | None = None,
        stop: Sequence[Sequence[str]] | None = None,
    ) -> list[GenerationOutput]:
        """``max_new_tokens``: one limit per prompt in place of ``sampling.max_new_tokens`` (SGLang takes
        a limit per request); ``stop``: stop strings per prompt, SGLang's ``stop`` sampling parameter
        (matched on decoded text, ``Req.update_finish_state`` in SGLang 0.5.23's schedule_batch.py)."""
        if not prompts:
            raise ValueError("generate needs at least one prompt; got an empty list")
        limits = _per_prompt_limits(prompts, sampling, max_new_tokens)
        if stop is not None and len(stop) != len(prompts):
            raise ValueError(f"stop needs one entry per prompt: {len(stop)} for {len(prompts)} prompts")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        n = sampling.n_samples_per_prompt
        base_seed = sampling.seed if seed is None else seed
        self._check_vocab(prompts)
        input_ids = [list(map(int, p)) for p in prompts for _ in range(n)]
        params = []
        for k in range(len(input_ids)):
            sp: dict[str, Any] = {
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                "max_new_tokens": limits[k // n],
                # SGLang seeds per request; distinct seeds keep the n samples of a prompt apart.
                "sampling_seed": (base_seed * 1_000_003 + k) % (2**31 - 1),
            }
            if sampling.stop_token_ids:
                sp["stop_token_ids"] = list(sampling.stop_token_ids)
            if sampling.ignore_eos:
                sp["ignore_eos"] = True
            if stop is not None and stop[k // n]:
                sp["stop"] = [str(x) for x in stop[k // n]]
            params.append(sp)
        results: list[Any] = [None] * len(input_ids)
        todo = list(range(len(input_ids)))
        for attempt in range(self.abort_retries + 1):
            replies = self._generate_once([input_ids[k] for k in todo], [params[k] for k in todo])
            for k, item in zip(todo, replies, strict=True):
                results[k] = item
            # An update paused the server in abort mode (SGLang < 0.5.23): those requests came back with
            # finish_reason "abort" and no tokens. Send them again, as slime does; the server holds them
            # until continue_generation, so they run with the new weights.
            todo = [k for k in todo if _finish_kind(results[k]) == "abort"]
            if not todo:
                break
            if attempt == self.abort_retries:
                raise SGLangError(
                    f"SGLang server {self.name}: {len(todo)} request(s) were aborted {attempt + 1} times "
                    "in a row (a weight update pauses generation in abort mode); giving up"
                )
        return [self._parse(item, k, k // n) for k, item in enumerate(results)]

    def _generate_once(self, input_ids: list[list[int]], params: list[dict[str, Any]]) -> list[Any]:
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True}
        if self.adapter is not None:
            body["lora_path"] = (
                self.adapter
            )  # one name for the batch (GenerateReqInput._normalize_lora_paths)
        reply = self._post("/generate", body)
        if isinstance(reply, dict) and ("error" in reply or reply.get("object") == "error"):
            raise SGLangError(
                f"SGLang server {self.name} refused /generate: {reply_from_http(400, reply).message}"
            )
        if isinstance(reply, dict) and len(input_ids) == 1:
            reply = [reply]
        if not isinstance(reply, list) or len(reply) != len(input_ids):
            got = len(reply) if isinstance(reply, list) else type(reply).__name__
            raise SGLangError(
                f"SGLang server {self.name}: /generate returned {got} results for {len(input_ids)} requests"
            )
        return reply

    def _parse(self, item: Any, k: int, prompt_position: int) -> GenerationOutput:
        try:
            meta = item["meta_info"]
            triples = meta["output_token_logprobs"]
            reason = meta["finish_reason"]
        except (KeyError, TypeError):
            raise SGLangError(
                f"SGLang server {self.name}: result {k} of /generate lacks "
                "meta_info.output_token_logprobs or "
                f"finish_reason (was return_logprob honoured?): {str(item)[:200]}"
            ) from None
        kind = _finish_kind(item)
        if kind not in ("stop", "length"):
            raise SGLangError(
                f"SGLang server {self.name}: request {k} finished with {reason!r} "
                "(aborted?); nothing to train on"
            )
        return GenerationOutput(
            prompt_position=prompt_position,
            token_ids=tuple(int(t[1]) for t in triples),
            log_probs=tuple(float(t[0]) for t in triples),
            finish_reason=str(kind),
        )

    # -- memory (the weight and generation operations go through ``endpoint``, as the sender's do) ----
    def _sglang_tags(self, tags: Sequence[str] | None) -> list[str]:
        # Ours ("weights", "kv_cache") or None -> SGLang's, cuda_graph included: the captured graphs hold
        # GPU memory too, and a tag left out is never given back to training.
        if tags is None or set(tags) >= {"weights", "kv_cache"}:
            return list(self.protocol.memory_tags)
        unknown = [t for t in tags if t not in self.protocol.memory_tags]
        if unknown:
            raise ValueError(f"unknown memory tags {unknown}; SGLang knows {list(self.protocol.memory_tags)}")
        return list(tags)

    def _make_idle(self) -> EngineReply:
        """Pause generation and wait until the scheduler is idle, as ``release_memory_occupation`` needs.

        SGLang asserts idleness in the scheduler (``scheduler_components/weight_updater.py``
        ``release_memory_occupation``); a failed assert kills the server. ``flush_cache`` succeeds only
        under the same idle check (``is_fully_idle``, ignoring the waiting queue while paused from 0.5.21),
        so it is retried until it does, as slime flushes before it releases. The pause (the version's mode)
        ends or retracts the requests in flight and holds new ones outside the scheduler until
        ``continue_generation``; aborted ones are sent again by :meth:`generate` and wait there too.
        """
        paused = self.endpoint.pause_generation().result(self.timeout_s)
        if not paused.success:
            return EngineReply.refused(f"could not pause generation to release memory: {paused.message}")
        flushed = self.endpoint.flush_cache().result(self.timeout_s)
        if flushed.success:
            return flushed
        self.endpoint.continue_generation().result(self.timeout_s)
        return EngineReply.refused(
            f"SGLang server {self.name} did not become idle within {self.endpoint.flush_retry_s:g} s after "
            f"a pause ({flushed.message}); memory not released (SGLang asserts the server is idle and "
            "goes down otherwise); generation continued"
        )

    def release_memory_occupation(self, *, tags: Sequence[str] | None) -> EngineReply:
        """Releases the tags not released yet (SGLang's release is not idempotent), after making the server
        idle (:meth:`_make_idle`). Generation stays paused until every tag is resumed."""
        try:
            wanted = self._sglang_tags(tags)
        except ValueError as exc:
            return EngineReply.refused(str(exc))
        with self._memory_lock:
            todo = [t for t in wanted if t not in self._released]
            if not todo:
                return EngineReply.ok(f"already released: {wanted}")
            if not self._paused_to_release:
                idle = self._make_idle()
                if not idle.success:
                    return idle
                self._paused_to_release = True
            reply = self.endpoint.call("POST", "/release_memory_occupation", {"tags": todo})
            if reply.success:
                self._released.update(todo)
            elif not self._released:
                self._paused_to_release = False
                self.endpoint.continue_generation().result(self.timeout_s)
        return reply

    def resume_memory_occupation(self, *, tags: Sequence[str] | None) -> EngineReply:
        """Resumes the released tags only: SGLang's resume of a tag it holds raises KeyError in the
        scheduler, which takes the server down."""
        try:
            wanted = self._sglang_tags(tags)
        except ValueError as exc:
            return EngineReply.refused(str(exc))
        with self._memory_lock:
            todo = [t for t in wanted if t in self._released]
            if not todo:
                return EngineReply.ok(f"nothing released among {wanted}")
            reply = self.endpoint.call("POST", "/resume_memory_occupation", {"tags": todo})
            if reply.success:
                self._released.difference_update(todo)
            if reply.success and not self._released and self._paused_to_release:
                # every tag is back: the pause that made the server idle for the release ends here
                self._paused_to_release = False
                resumed = self.endpoint.continue_generation().result(self.timeout_s)
                if not resumed.success:
                    return EngineReply.refused(
                        f"memory resumed, but continue_generation failed: {resumed.message}"
                    )
        return reply

    # -- weights read back (train.check_weights) -----------------------------------------------------
    def read_weights(
        self, manifest: Sequence[tuple[str, str, Sequence[int]]], rows: int | None = None
    ) -> list[tuple[str, Any]]:
        """Each tensor of ``manifest`` (name, dtype name, shape: what the actor sends) as the server holds
        it, through ``/get_weights_by_name`` (:mod:`ppo_weight_sync.sglang_weights`), cast to that dtype;
        ``rows``: each tensor's first rows only. SGLangError naming a tensor the server cannot give."""
        from ppo_weight_sync.buckets import dtype_from_name

        out = []
        for name, dtype, shape in manifest:
            body = self.endpoint.request("POST", "/get_weights_by_name", weights_request(name, shape, rows))
            if isinstance(body, dict):
                raise SGLangError(
                    f"SGLang server {self.name} could not give the weights of {name}: "
                    f"{reply_from_http(400, body).message}"
                )
            try:
                out.append((name, tensor_from_reply(name, body, shape, rows, dtype_from_name(dtype))))
            except ValueError as exc:
                raise SGLangError(f"SGLang server {self.name}: {exc}") from None
        return out

    def weights_checksum(
        self, manifest: Sequence[tuple[str, str, Sequence[int]]], rows: int | None = None
    ) -> str:
        """``rows_checksum`` of :meth:`read_weights`: equal to the actor's ``rows_checksum`` of the same
        tensors exactly when the server holds the same weights."""
        return rows_checksum(self.read_weights(manifest, rows), None)

    def close(self) -> None:
        self.endpoint.close()


def _finish_kind(item: Any) -> Any:
    reason = item.get("meta_info", {}).get("finish_reason") if isinstance(item, dict) else None
    return reason.get("type") if isinstance(reason, dict) else reason


def _protocol_of(endpoint: HttpEngineEndpoint) -> SGLangProtocol:
    if endpoint.sglang is None:  # for_sglang always sets it; this keeps the type exact
        raise SGLangError(f"SGLang server {endpoint.name}: no protocol was read from /server_info")
    return endpoint.sglang


def _per_prompt_limits(
    prompts: Sequence[Sequence[int]], sampling: SamplingConfig, max_new_tokens: Sequence[int] | None
) -> list[int]:
    if max_new_tokens is None:
        return [sampling.max_new_tokens] * len(prompts)
    if len(max_new_tokens) != len(prompts):
        raise ValueError(
            f"max_new_tokens needs one entry per prompt: {len(max_new_tokens)} for {len(prompts)} prompts"
        )
    bad = [int(n) for n in max_new_tokens if int(n) < 1]
    if bad:
        raise ValueError(f"max_new_tokens must be >= 1 for every prompt, got {bad[:5]}")
    return [int(n) for n in max_new_tokens]
