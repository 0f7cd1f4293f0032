"""SGLang adapter: launch ``sglang.launch_server`` as a subprocess, drive it over HTTP, stop it.

Nothing here imports sglang. The routes and fields follow SGLang's ``http_server.py`` and
``io_struct.py``: ``/health``, ``/generate`` (``input_ids`` + ``sampling_params`` +
``return_logprob``; each result's ``meta_info.output_token_logprobs`` holds
``[logprob, token_id, text]`` triples and ``meta_info.finish_reason.type`` is ``stop``, ``length``
or ``abort``), the weight-update routes, ``/pause_generation``, ``/continue_generation``,
``/flush_cache``, ``/get_weight_version``, ``/release_memory_occupation`` and
``/resume_memory_occupation`` (``{"tags": [...]}``).

This adapter has been tested against a stand-in server that serves the same routes
(:mod:`ppo_rollout.testing.sglang_standin`), not against a real SGLang server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppo_weight_sync import EngineOps, EngineReply, HttpEngineEndpoint, TensorOps, reply_from_http

from ..config import SamplingConfig
from .core import GenerationOutput

__all__ = ["SGLangClient", "SGLangError", "SGLangServer", "SGLangServerSpec"]

DEFAULT_COMMAND: tuple[str, ...] = (sys.executable, "-m", "sglang.launch_server")


class SGLangError(RuntimeError):
    """An SGLang server refused a request, answered something unexpected, or failed to start."""


@dataclass(frozen=True)
class SGLangServerSpec:
    """The arguments we derive for one server. ``command`` replaces ``python -m sglang.launch_server``."""

    model_path: str
    port: int
    tp_size: int = 1
    base_gpu_id: int = 0
    host: str = "127.0.0.1"
    enable_memory_saver: bool = False  # on when the server shares its GPUs with training
    random_seed: int | None = None
    extra_args: tuple[str, ...] = ()
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
            # slime skips the warmup request: it can outlast launch timeouts and serves no purpose here.
            "--skip-server-warmup",
        ]
        if self.enable_memory_saver:
            args.append("--enable-memory-saver")
        if self.random_seed is not None:
            args += ["--random-seed", str(self.random_seed)]
        return args + list(self.extra_args)


class SGLangServer:
    """One server subprocess in its own process group. ``start()`` returns once ``/health`` answers 200."""

    def __init__(
        self,
        spec: SGLangServerSpec,
        *,
        startup_timeout_s: float = 600.0,
        stop_grace_s: float = 15.0,
        log_path: str | Path | None = None,
        name: str = "",
    ) -> None:
        self.spec = spec
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.name = name or f"sglang@{spec.url}"
        self.log_path = (
            Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="sglang-", suffix=".log")[1])
        )
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        if self.is_running():
            return
        env = dict(os.environ)
        if self.spec.physical_gpu_ids:
            env.pop("CUDA_VISIBLE_DEVICES", None)
        env.update(self.spec.env)
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self.spec.argv(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # own process group: stop() reaches the server's children too
            )
        try:
            self.wait_healthy(self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise SGLangError(
                    f"SGLang server {self.name} exited with code {self._proc.returncode} "
                    "before /health answered; "
                    f"log {self.log_path}:\n{self._log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"SGLang server {self.name} did not answer /health with 200 within {timeout_s:.0f} s; "
                    f"log {self.log_path}:\n{self._log_tail()}"
                )
            time.sleep(0.2)

    def stop(self) -> int | None:
        """SIGTERM to the process group, SIGKILL after ``stop_grace_s``. Idempotent; returns the exit code."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        # The leader is gone; whatever it left in its group (scheduler, detokenizer) goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.returncode


class SGLangClient:
    """The engine operations over a server's HTTP routes (stdlib HTTP via ``HttpEngineEndpoint``)."""

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, name: str = "", num_gpus: int = 1) -> None:
        self.endpoint = HttpEngineEndpoint(base_url, num_gpus=num_gpus, timeout_s=timeout_s, name=name)
        self.timeout_s = timeout_s
        self.name = self.endpoint.name
        self.base_url = self.endpoint.base_url

    def _post(self, route: str, body: dict[str, Any] | None = None) -> Any:
        return self.endpoint.request("POST", route, {} if body is None else body)

    def health(self) -> bool:
        try:
            self.endpoint.request("GET", "/health")
        except Exception:
            return False
        return True

    # -- generation --------------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seed: int | None = None
    ) -> list[GenerationOutput]:
        if not prompts:
            raise ValueError("generate needs at least one prompt; got an empty list")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        n = sampling.n_samples_per_prompt
        base_seed = sampling.seed if seed is None else seed
        input_ids = [list(map(int, p)) for p in prompts for _ in range(n)]
        params = []
        for k in range(len(input_ids)):
            sp: dict[str, Any] = {
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                "max_new_tokens": sampling.max_new_tokens,
                # SGLang seeds per request; distinct seeds keep the n samples of a prompt apart.
                "sampling_seed": (base_seed * 1_000_003 + k) % (2**31 - 1),
            }
            if sampling.stop_token_ids:
                sp["stop_token_ids"] = list(sampling.stop_token_ids)
            params.append(sp)
        body = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True}
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
        out = []
        for k, item in enumerate(reply):
            out.append(self._parse(item, k, k // n))
        return out

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
        kind = reason.get("type") if isinstance(reason, dict) else reason
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

    # -- the engine operations (EngineOps, over the endpoint's HTTP calls) ---------------------------
    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> EngineReply:
        return self.endpoint.init_weights_update_group(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        ).result(self.timeout_s)

    def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None,
        flush_cache: bool,
        load_format: str | None,
    ) -> EngineReply:
        return self.endpoint.update_weights_from_distributed(
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            group_name=group_name,
            weight_version=weight_version,
            flush_cache=flush_cache,
            load_format=load_format,
        ).result(self.timeout_s)

    def update_weights_from_tensor(
        self,
        *,
        serialized_named_tensors: list[str],
        load_format: str | None,
        flush_cache: bool,
        abort_all_requests: bool,
        weight_version: str | None,
    ) -> EngineReply:
        """SGLang's ``POST /update_weights_from_tensor`` (0.5.15.post1 and 0.5.23): one entry per TP rank,
        built by ``ppo_weight_sync.ipc`` (``flattened_bucket``)."""
        return self.endpoint.update_weights_from_tensor(
            serialized_named_tensors=serialized_named_tensors,
            load_format=load_format,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            weight_version=weight_version,
        ).result(self.timeout_s)

    def destroy_weights_update_group(self, *, group_name: str) -> EngineReply:
        return self.endpoint.destroy_weights_update_group(group_name=group_name).result(self.timeout_s)

    def pause_generation(self) -> EngineReply:
        return self.endpoint.pause_generation().result(self.timeout_s)

    def continue_generation(self) -> EngineReply:
        return self.endpoint.continue_generation().result(self.timeout_s)

    def flush_cache(self) -> EngineReply:
        return self.endpoint.flush_cache().result(self.timeout_s)

    def get_weight_version(self) -> str | None:
        return self.endpoint.get_weight_version().result(self.timeout_s)

    def release_memory_occupation(self, *, tags: Sequence[str] | None) -> EngineReply:
        body = {"tags": None if tags is None else list(tags)}
        return self.endpoint.call("POST", "/release_memory_occupation", body)

    def resume_memory_occupation(self, *, tags: Sequence[str] | None) -> EngineReply:
        body = {"tags": None if tags is None else list(tags)}
        return self.endpoint.call("POST", "/resume_memory_occupation", body)

    def close(self) -> None:
        self.endpoint.close()


if TYPE_CHECKING:  # mypy checks that the client has the engine operations' exact signatures

    def _is_tensor_ops(client: SGLangClient) -> TensorOps:
        return client

    def _is_engine_ops(client: SGLangClient) -> EngineOps:
        return client
