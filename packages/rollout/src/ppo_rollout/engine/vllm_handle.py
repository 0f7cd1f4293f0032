"""vLLM adapter, the handle: a vLLM server launched by a Ray actor on the engine's slot, driven over HTTP.

The rollout manager holds it through :class:`~ppo_rollout.engine.handles.EngineHandle`, as the built-in
engine and SGLang; the sender reaches the server through its
:class:`~ppo_weight_sync.vllm_endpoint.VLLMEngineEndpoint`.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any, cast

import ray

from ppo_lifecycle.startup import SetupTimer
from ppo_weight_sync import EngineEndpoint, EngineReply, free_port
from ppo_weight_sync.vllm_endpoint import VLLMEngineEndpoint

from ..config import SamplingConfig
from ..stops import RequestStop
from .core import GenerationOutput
from .early_stop import EarlyStop
from .handles import Waiter, _ray_get, model_manifest
from .vllm_client import VLLMClient
from .vllm_server import VLLMServer, VLLMServerSpec

__all__ = ["VLLMEngineHandle", "VLLMServerActor"]


class _VLLMServerHost:
    """Owns one vLLM server subprocess on the node of the engine's slot (run as a Ray actor)."""

    def __init__(
        self, spec_args: dict[str, Any], startup_timeout_s: float, stop_grace_s: float, name: str
    ) -> None:
        self._setup = SetupTimer()
        args = dict(spec_args)
        if args.get("port") is None:  # picked here, on the server's node
            args["port"] = free_port(args.get("host", "127.0.0.1"))
        self.server = VLLMServer(
            VLLMServerSpec(**args), startup_timeout_s=startup_timeout_s, stop_grace_s=stop_grace_s, name=name
        )

    def start(self) -> str:
        with self._setup.part("server"):  # the vLLM processes: their imports, the model's load
            self.server.start()
        return self.server.url

    def startup(self) -> dict[str, float]:
        return self._setup.report()

    def stop(self) -> int | None:
        return self.server.stop()


VLLMServerActor = ray.remote(_VLLMServerHost)


class VLLMEngineHandle:
    """A vLLM server on the engine's slot. ``weights``: the dtype the actor sends and the rows
    :meth:`weights_checksum` reads of each tensor (None: all)."""

    def __init__(
        self,
        name: str,
        spec_args: dict[str, Any],
        actor_options: dict[str, Any],
        *,
        startup_timeout_s: float,
        stop_grace_s: float,
        request_timeout_s: float,
        weights: tuple[str, int | None] = ("float32", None),
    ) -> None:
        self.name = name
        self._model_path = str(spec_args["model_path"])
        self._dtype, self._check_rows = weights
        self._gpus = int(spec_args.get("tp_size", 1))
        self._request_timeout_s = request_timeout_s
        # max_concurrency 2: stop() must be able to run while a start() still waits for /health.
        self._host_actor: Any = (
            cast(Any, VLLMServerActor)
            .options(max_concurrency=2, **actor_options)
            .remote(spec_args, startup_timeout_s, stop_grace_s, name)
        )
        self._started = self._host_actor.start.remote()
        self._client: VLLMClient | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"gen-{name}")

    def wait_ready(self, timeout_s: float) -> None:
        if self._client is None:
            url = _ray_get(self._started, timeout_s, self.name, "starting the vLLM server")
            manifest = model_manifest(self._model_path, self._dtype)
            endpoint = VLLMEngineEndpoint.for_server(
                url, manifest, self._gpus, timeout_s=self._request_timeout_s, name=self.name
            )
            self._client = VLLMClient(endpoint)

    def startup(self, timeout_s: float) -> dict[str, float]:
        report: dict[str, float] = _ray_get(
            self._host_actor.startup.remote(), timeout_s, self.name, "start-up report"
        )
        return report

    @property
    def client(self) -> VLLMClient:
        if self._client is None:
            raise RuntimeError(f"engine {self.name}: the vLLM server is not started; call wait_ready() first")
        return self._client

    def submit_generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: int,
        *,
        max_new_tokens: Sequence[int] | None = None,
        stop: Sequence[RequestStop] | None = None,
        until: EarlyStop | None = None,
    ) -> Waiter:
        if until is not None:  # rollout.partial refuses other engines than the built-in one at load
            raise ValueError(f"engine {self.name}: an early stop (rollout.partial) needs the built-in engine")
        strings = None if stop is None else [list(s.strings) for s in stop]
        future = self._pool.submit(
            self.client.generate, prompts, sampling, seed, max_new_tokens=max_new_tokens, stop=strings
        )

        def wait(timeout_s: float) -> list[GenerationOutput]:
            try:
                return future.result(timeout=timeout_s)
            except concurrent.futures.TimeoutError:
                raise TimeoutError(
                    f"engine {self.name}: generate did not finish within {timeout_s:.0f} s"
                ) from None

        return wait

    def endpoint(self) -> EngineEndpoint:
        return self.client.endpoint

    def release_memory_occupation(self, tags: Sequence[str] | None, timeout_s: float) -> EngineReply:
        return self.client.release_memory_occupation(tags=tags)

    def resume_memory_occupation(self, tags: Sequence[str] | None, timeout_s: float) -> EngineReply:
        return self.client.resume_memory_occupation(tags=tags)

    def memory_stats(self, timeout_s: float) -> dict[str, float] | None:
        return None  # a vLLM server does not report what its sleep and wake moved

    def weights_checksum(self, timeout_s: float) -> str:
        """The worker's checksum of its weights read back in Hugging Face names (every tensor the actor
        sends, each tensor's first ``check_rows`` rows): equal to the actor's exactly when the weights are."""
        future = self._pool.submit(self.client.weights_checksum, self._check_rows)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"engine {self.name}: reading the weights back did not finish within {timeout_s:.0f} s"
            ) from None

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            ray.get(self._host_actor.stop.remote(), timeout=120)
        finally:
            ray.kill(self._host_actor, no_restart=True)
