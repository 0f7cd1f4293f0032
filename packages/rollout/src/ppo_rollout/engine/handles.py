"""How the rollout manager holds an engine: one interface over the built-in Ray actor and SGLang."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar, cast

import ray

from ppo_lifecycle.startup import SetupTimer
from ppo_weight_sync import EngineEndpoint, EngineReply, RayEngineEndpoint, free_port

from ..config import AdapterUpdates, SamplingConfig
from ..stops import RequestStop
from .builtin import BuiltinEngineActor
from .core import GenerationOutput
from .early_stop import EarlyStop
from .server_chunks import generate_in_chunks
from .server_process import ServerProcess
from .sglang import SGLangClient, SGLangServer, SGLangServerSpec

__all__ = [
    "BuiltinEngineHandle",
    "EngineHandle",
    "SGLangEngineHandle",
    "SGLangServerActor",
    "ServerEngineHandle",
    "ServerHost",
    "Waiter",
    "WarmUpWaiter",
]

Waiter = Callable[[float], list[GenerationOutput]]
C = TypeVar("C", bound="ServerClient")
R = TypeVar("R")
WarmUpWaiter = Callable[[float], dict[str, float]]


class EngineHandle(Protocol):
    """One engine as the rollout manager drives it. Every wait is bounded by the timeout it is given."""

    name: str

    def wait_ready(self, timeout_s: float) -> None: ...
    def startup(self, timeout_s: float) -> dict[str, float]:
        """The engine's start-up report (``ppo_lifecycle.startup.SetupTimer.report``), once ready."""
        ...

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
        """``max_new_tokens``: one limit per prompt in place of ``sampling.max_new_tokens``; ``stop``:
        one :class:`~ppo_rollout.stops.RequestStop` per prompt (the built-in engine matches its token
        sequences, SGLang and vLLM its strings); ``until``: the call may end early, its unfinished
        samples paused (``early_stop``; a server engine generates such a call in chunks,
        ``server_chunks``)."""
        ...

    def endpoint(self) -> EngineEndpoint: ...
    def release_memory_occupation(self, tags: Sequence[str] | None, timeout_s: float) -> EngineReply: ...
    def resume_memory_occupation(self, tags: Sequence[str] | None, timeout_s: float) -> EngineReply: ...
    def weights_checksum(self, timeout_s: float) -> str: ...
    def memory_stats(self, timeout_s: float) -> dict[str, float] | None: ...
    def shutdown(self) -> None: ...


def _ray_get(ref: Any, timeout_s: float, engine: str, what: str) -> Any:
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"engine {engine}: {what} did not finish within {timeout_s:.0f} s") from None
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if exc.cause is not None else exc
        if isinstance(cause, ValueError):
            raise ValueError(f"engine {engine}: {what}: {cause}") from exc
        raise RuntimeError(f"engine {engine}: {what} failed: {cause!r}") from exc
    except ray.exceptions.RayActorError as exc:
        # Ray's text runs to a dozen lines (ids, pid, possible causes): its first line says enough.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RuntimeError(f"engine {engine}: {what}: the engine actor died ({first})") from exc


class BuiltinEngineHandle:
    """A :class:`~ppo_rollout.engine.builtin.BuiltinEngine` Ray actor."""

    def __init__(
        self,
        name: str,
        model_path: str,
        device: str,
        dtype: str,
        gpus: int,
        actor_options: dict[str, Any],
        timeout_s: float,
        lora: AdapterUpdates | None = None,
    ) -> None:
        self.name = name
        self._gpus = max(1, gpus)
        # Typed Any: Ray's stubs do not see the actor's methods' .remote.
        self.actor: Any = (
            cast(Any, BuiltinEngineActor)
            .options(name=None, max_concurrency=4, **actor_options)
            .remote(
                model_path,
                device,
                dtype,
                name=name,
                timeout_s=timeout_s,
                torch_threads=1 if device == "cpu" else None,
                lora=lora,
            )
        )
        self._ready = self.actor.ready.remote()

    def wait_ready(self, timeout_s: float) -> None:
        _ray_get(self._ready, timeout_s, self.name, "loading the model")

    def startup(self, timeout_s: float) -> dict[str, float]:
        report: dict[str, float] = _ray_get(
            self.actor.startup.remote(), timeout_s, self.name, "start-up report"
        )
        return report

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
        limits = None if max_new_tokens is None else [int(n) for n in max_new_tokens]
        sequences = None if stop is None else [[list(seq) for seq in s.token_ids] for s in stop]
        ref = self.actor.generate.remote(
            [list(p) for p in prompts], sampling, seed, max_new_tokens=limits, stop=sequences, until=until
        )
        name = self.name

        def wait(timeout_s: float) -> list[GenerationOutput]:
            out: list[GenerationOutput] = _ray_get(ref, timeout_s, name, "generate")
            return out

        return wait

    def submit_warm_up(self, rows: int, max_prompt_tokens: int, sampling: SamplingConfig) -> WarmUpWaiter:
        """Start ``BuiltinEngine.warm_up``; the waiter returns its report (``{"warm_up_s": ...}``)."""
        ref = self.actor.warm_up.remote(rows, max_prompt_tokens, sampling)
        name = self.name

        def wait(timeout_s: float) -> dict[str, float]:
            out: dict[str, float] = _ray_get(ref, timeout_s, name, "warm-up")
            return out

        return wait

    def endpoint(self) -> EngineEndpoint:
        return RayEngineEndpoint(self.actor, num_gpus=self._gpus, name=self.name)

    def release_memory_occupation(self, tags: Sequence[str] | None, timeout_s: float) -> EngineReply:
        reply: EngineReply = _ray_get(
            self.actor.release_memory_occupation.remote(tags=tags), timeout_s, self.name, "release memory"
        )
        return reply

    def resume_memory_occupation(self, tags: Sequence[str] | None, timeout_s: float) -> EngineReply:
        reply: EngineReply = _ray_get(
            self.actor.resume_memory_occupation.remote(tags=tags), timeout_s, self.name, "resume memory"
        )
        return reply

    def weights_checksum(self, timeout_s: float) -> str:
        return _ray_get(self.actor.weights_checksum.remote(), timeout_s, self.name, "weights checksum")

    def memory_stats(self, timeout_s: float) -> dict[str, float] | None:
        """Running totals of what release/resume moved: ``release_bytes``, ``release_seconds``, ..."""
        stats: dict[str, float] = _ray_get(
            self.actor.memory_stats.remote(), timeout_s, self.name, "memory stats"
        )
        return stats

    def shutdown(self) -> None:
        ray.kill(self.actor, no_restart=True)


class ServerHost:
    """Owns one server subprocess on the node of the engine's slot (run as a Ray actor); subclasses make
    the server (SGLang's, vLLM's) from the spec's arguments on that node."""

    def __init__(self, server: ServerProcess) -> None:
        self._setup = SetupTimer()
        self.server = server

    def start(self) -> str:
        with self._setup.part("server"):  # the server's processes: imports, the model's load, warm-up
            self.server.start()
        return self.server.url

    def startup(self) -> dict[str, float]:
        return self._setup.report()

    def stop(self) -> int | None:
        return self.server.stop()

    def pid(self) -> int | None:
        return self.server.pid


class ServerClient(Protocol):
    """What :class:`ServerEngineHandle` needs of a server's HTTP client."""

    @property
    def endpoint(self) -> EngineEndpoint: ...
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: int | None = None,
        *,
        max_new_tokens: Sequence[int] | None = None,
        stop: Sequence[Sequence[str]] | None = None,
    ) -> list[GenerationOutput]: ...
    def release_memory_occupation(self, *, tags: Sequence[str] | None) -> EngineReply: ...
    def resume_memory_occupation(self, *, tags: Sequence[str] | None) -> EngineReply: ...
    def close(self) -> None: ...


class ServerEngineHandle(Generic[C]):
    """An inference server launched by a Ray actor (a :class:`ServerHost`) on the engine's slot and
    driven over HTTP from here, through a client made once the server answers (``_client``). SGLang's
    and vLLM's handles add how they make the client and read the weights back."""

    KIND: ClassVar[str] = "inference"  # "the SGLang server", "the vLLM server" in messages

    def _launch(
        self,
        name: str,
        host: Any,
        spec_args: dict[str, Any],
        actor_options: dict[str, Any],
        timeouts: tuple[float, float],
    ) -> None:
        """Start ``host`` (a Ray actor class of a :class:`ServerHost`) with the spec's arguments and
        ``timeouts`` (start-up, stop grace); the server starts at once, :meth:`_server_url` waits."""
        self.name = name
        # max_concurrency 2: stop() must be able to run while a start() still waits for /health.
        self._host_actor: Any = (
            cast(Any, host).options(max_concurrency=2, **actor_options).remote(spec_args, *timeouts, name)
        )
        self._started = self._host_actor.start.remote()
        self._client: C | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"gen-{name}")

    def _server_url(self, timeout_s: float) -> str:
        url: str = _ray_get(self._started, timeout_s, self.name, f"starting the {self.KIND} server")
        return url

    def startup(self, timeout_s: float) -> dict[str, float]:
        report: dict[str, float] = _ray_get(
            self._host_actor.startup.remote(), timeout_s, self.name, "start-up report"
        )
        return report

    @property
    def client(self) -> C:
        if self._client is None:
            raise RuntimeError(
                f"engine {self.name}: the {self.KIND} server is not started; call wait_ready() first"
            )
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
        if until is not None:  # rollout.partial: chunks, checked between them (server_chunks)
            chunked = self._pool.submit(
                generate_in_chunks,
                self.client.generate,
                prompts,
                sampling,
                seed,
                until,
                max_new_tokens=max_new_tokens,
                stop=stop,
                engine=self.name,
            )
            return lambda timeout_s: self._result(chunked, timeout_s, "generate")
        strings = None if stop is None else [list(s.strings) for s in stop]
        future = self._pool.submit(
            self.client.generate, prompts, sampling, seed, max_new_tokens=max_new_tokens, stop=strings
        )
        return lambda timeout_s: self._result(future, timeout_s, "generate")

    def _result(self, future: concurrent.futures.Future[R], timeout_s: float, what: str, hint: str = "") -> R:
        """``future``'s result within ``timeout_s``, else a TimeoutError naming the engine and ``what``."""
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"engine {self.name}: {what} did not finish within {timeout_s:.0f} s{hint}"
            ) from None

    def endpoint(self) -> EngineEndpoint:
        return self.client.endpoint  # knows the server's protocol (read at wait_ready)

    def release_memory_occupation(self, tags: Sequence[str] | None, timeout_s: float) -> EngineReply:
        return self.client.release_memory_occupation(tags=tags)

    def resume_memory_occupation(self, tags: Sequence[str] | None, timeout_s: float) -> EngineReply:
        return self.client.resume_memory_occupation(tags=tags)

    def memory_stats(self, timeout_s: float) -> dict[str, float] | None:
        return None  # a server does not report what its release and resume moved

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            ray.get(self._host_actor.stop.remote(), timeout=120)
        finally:
            ray.kill(self._host_actor, no_restart=True)


class _SGLangServerHost(ServerHost):
    """Owns one SGLang server subprocess on the node of the engine's slot (run as a Ray actor)."""

    def __init__(
        self, spec_args: dict[str, Any], startup_timeout_s: float, stop_grace_s: float, name: str
    ) -> None:
        spec = _spec_on_node(spec_args)  # here, so that a free port is picked on the server's node
        super().__init__(
            SGLangServer(spec, startup_timeout_s=startup_timeout_s, stop_grace_s=stop_grace_s, name=name)
        )


SGLangServerActor = ray.remote(_SGLangServerHost)


class SGLangEngineHandle(ServerEngineHandle[SGLangClient]):
    """An SGLang server launched by a Ray actor on the engine's slot; driven over HTTP from here."""

    KIND = "SGLang"

    def __init__(
        self,
        name: str,
        spec_args: dict[str, Any],
        actor_options: dict[str, Any],
        *,
        startup_timeout_s: float,
        stop_grace_s: float,
        request_timeout_s: float,
        adapter: str | None = None,
        weights: tuple[str, int | None] = ("bfloat16", None),
    ) -> None:
        """``weights``: the dtype the actor sends and the rows :meth:`weights_checksum` reads of each
        tensor (``rollout.dtype``, ``rollout.sglang.check_rows``)."""
        self._model_path = str(spec_args["model_path"])
        self._weights_dtype, self._check_rows = weights
        self._adapter = adapter  # the LoRA adapter every generate request names (adapter-only updates)
        self._gpus = int(spec_args["tp_size"])
        self._request_timeout_s = request_timeout_s
        self._launch(name, SGLangServerActor, spec_args, actor_options, (startup_timeout_s, stop_grace_s))

    def wait_ready(self, timeout_s: float) -> None:
        if self._client is None:
            url = self._server_url(timeout_s)
            self._client = SGLangClient(
                url,
                timeout_s=self._request_timeout_s,
                name=self.name,
                num_gpus=self._gpus,
                adapter=self._adapter,
                vocab_size=_vocab_size(self._model_path),
            )

    @property
    def url(self) -> str:
        return self.client.base_url

    def weights_checksum(self, timeout_s: float) -> str:
        """The checksum of the weights read back from the server (``/get_weights_by_name``): every tensor
        the actor sends (the model's state dict, in the sync dtype), each tensor's first ``check_rows``
        rows; equal to the actor's ``weights_checksum(rows)`` exactly when the weights are equal."""
        manifest = model_manifest(self._model_path, self._weights_dtype)
        future = self._pool.submit(self.client.weights_checksum, manifest, self._check_rows)
        hint = " (set rollout.sglang.check_rows to read fewer rows)"
        return self._result(future, timeout_s, "reading the weights back", hint)


def _vocab_size(model_path: str) -> int | None:
    """The model's ``vocab_size`` from its folder's config (None where the folder has none)."""
    from transformers import AutoConfig

    try:
        return int(AutoConfig.from_pretrained(model_path).vocab_size)
    except (OSError, ValueError, AttributeError):
        return None


def model_manifest(model_path: str, dtype: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """Name, dtype and shape of every tensor of the model's state dict (tied weights under each name, as
    the actor's ``named_weights`` exports them), built on the meta device: no weights are read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(n, dtype, tuple(t.shape)) for n, t in model.state_dict().items()]


def _spec_on_node(spec_args: dict[str, Any]) -> SGLangServerSpec:
    """The spec, with a free port picked here when none was given (the actor runs on the same node)."""
    args = dict(spec_args)
    env = dict(args.pop("env", {}))
    if args.get("port") is None:
        args["port"] = free_port(args.get("host", "127.0.0.1"))
    return SGLangServerSpec(env=env, **args)
