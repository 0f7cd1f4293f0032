"""vLLM adapter, the handle: a vLLM server launched by a Ray actor on the engine's slot, driven over HTTP.

The rollout manager holds it through :class:`~ppo_rollout.engine.handles.EngineHandle`, as the built-in
engine and SGLang; the sender reaches the server through its
:class:`~ppo_weight_sync.vllm_endpoint.VLLMEngineEndpoint`.
"""

from __future__ import annotations

from typing import Any

import ray

from ppo_weight_sync import free_port
from ppo_weight_sync.vllm_endpoint import VLLMEngineEndpoint

from .handles import ServerEngineHandle, ServerHost, model_manifest
from .vllm_client import VLLMClient
from .vllm_server import VLLMServer, VLLMServerSpec

__all__ = ["VLLMEngineHandle", "VLLMServerActor"]


class _VLLMServerHost(ServerHost):
    """Owns one vLLM server subprocess on the node of the engine's slot (run as a Ray actor)."""

    def __init__(
        self, spec_args: dict[str, Any], startup_timeout_s: float, stop_grace_s: float, name: str
    ) -> None:
        args = dict(spec_args)
        if args.get("port") is None:  # picked here, on the server's node
            args["port"] = free_port(args.get("host", "127.0.0.1"))
        super().__init__(
            VLLMServer(
                VLLMServerSpec(**args),
                startup_timeout_s=startup_timeout_s,
                stop_grace_s=stop_grace_s,
                name=name,
            )
        )


VLLMServerActor = ray.remote(_VLLMServerHost)


class VLLMEngineHandle(ServerEngineHandle[VLLMClient]):
    """A vLLM server on the engine's slot. ``weights``: the dtype the actor sends and the rows
    :meth:`weights_checksum` reads of each tensor (None: all)."""

    KIND = "vLLM"

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
        self._model_path = str(spec_args["model_path"])
        self._dtype, self._check_rows = weights
        self._gpus = int(spec_args.get("tp_size", 1))
        self._request_timeout_s = request_timeout_s
        self._launch(name, VLLMServerActor, spec_args, actor_options, (startup_timeout_s, stop_grace_s))

    def wait_ready(self, timeout_s: float) -> None:
        if self._client is None:
            url = self._server_url(timeout_s)
            manifest = model_manifest(self._model_path, self._dtype)
            endpoint = VLLMEngineEndpoint.for_server(
                url, manifest, self._gpus, timeout_s=self._request_timeout_s, name=self.name
            )
            self._client = VLLMClient(endpoint)

    def weights_checksum(self, timeout_s: float) -> str:
        """The worker's checksum of its weights read back in Hugging Face names (every tensor the actor
        sends, each tensor's first ``check_rows`` rows): equal to the actor's exactly when the weights are."""
        future = self._pool.submit(self.client.weights_checksum, self._check_rows)
        return self._result(future, timeout_s, "reading the weights back")
