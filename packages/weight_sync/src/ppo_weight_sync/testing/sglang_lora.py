"""The LoRA side of an SGLang server, rebuilt from SGLang 0.5.23's source (``sglang/srt/``; 0.5.15.post1 and
0.5.16 where noted) for the stand-in and for tests of :mod:`ppo_weight_sync.sglang_lora`.

- :func:`decode_adapter_tensors` is what a TP rank does with a ``/load_lora_adapter_from_tensors`` body
  (``managers/tp_worker.py`` ``load_lora_adapter_from_tensors``): take its own entry of
  ``serialized_named_tensors`` (0.5.17 on; ``serialized_tensors`` before), base64-decode it
  (``Base64Bytes``, ``utils/msgspec_utils.py``: ``b64decode(validate=True)``), unpickle it with
  ``SafeUnpickler`` (``utils/common.py``: an allow-list of globals, ``torch.storage._load_from_bytes``
  through ``torch.load(weights_only=True)``; the entries below are the part of that list a tensor
  bucket needs) and, for ``load_format == "flattened_bucket"``, view each metadata entry's
  ``start_idx:end_idx`` bytes as its dtype and shape (``weight_sync/tensor_bucket.py``
  ``FlattenedTensorBucket.reconstruct_tensors``).
- :class:`SGLangLora` answers the LoRA routes as the tokenizer manager and ``LoRAManager`` do
  (``managers/tokenizer_control_mixin.py``, ``lora/lora_manager.py``, ``lora/mem_pool.py``
  ``can_support``, ``lora/utils.py`` ``get_normalized_target_modules``): ``--enable-lora`` required,
  a loaded name refused, a rank above ``--max-lora-rank`` or modules outside ``--lora-target-modules``
  refused, ``peft_type`` ``lora``; replies ``{"success", "error_message", "loaded_adapters"}`` with 200
  or 400; ``GET /v1/models`` lists the base model and each adapter (``parent`` set; 0.5.17's
  ``ModelCard`` fields); a request naming an adapter never loaded is refused as the tokenizer manager
  refuses it (``Got LoRA adapter that has never been loaded``, 0.5.17 ``managers/tokenizer_manager.py``),
  one loaded once and unloaded since as ``LoRARegistry.acquire`` does. Generation uses
  ``W + lora_alpha / r * B A`` (``lora/lora.py`` ``scaling``) for every adapted weight: here merged into the
  engine's weights, from a kept copy of the base, by :func:`ppo_weight_sync.lora.merge_lora`.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import pickle
import threading
import time
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ppo_weight_sync.lora import adapter_module, merge_lora
from ppo_weight_sync.routes import RouteResult

__all__ = ["LoraAdapter", "SGLangLora", "decode_adapter_tensors", "normalized_modules"]

PEFT_PREFIX = "base_model.model."


def _load_storage(data: bytes) -> Any:
    """``_safe_load_torch_storage``: torch's ``_load_from_bytes`` without an unrestricted ``torch.load``."""
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, torch.storage.TypedStorage | torch.UntypedStorage):
        raise pickle.UnpicklingError(f"Expected a Torch storage, got {type(storage).__name__}")
    return storage


_ALLOWED: dict[tuple[str, str], Any] = {
    ("builtins", "dict"): dict,
    ("builtins", "list"): list,
    ("builtins", "tuple"): tuple,
    ("collections", "OrderedDict"): OrderedDict,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("torch", "Size"): torch.Size,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch.storage", "_load_from_bytes"): _load_storage,
    **{("torch", n): getattr(torch, n) for n in ("float32", "bfloat16", "float16", "uint8")},
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
        return found


def decode_adapter_tensors(body: Mapping[str, Any], tp_rank: int, per_rank: bool) -> dict[str, torch.Tensor]:
    """The named tensors TP rank ``tp_rank`` reads from a ``/load_lora_adapter_from_tensors`` body
    (``per_rank``: 0.5.17 and later). Raises ValueError (or pickle's errors) where SGLang fails."""
    if per_rank:
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or len(entries) <= tp_rank:
            raise ValueError(f"serialized_named_tensors needs an entry for TP rank {tp_rank}")
        entry = entries[tp_rank]
    else:
        entry = body.get("serialized_tensors")
    if not isinstance(entry, str):
        raise ValueError("Expected base64-encoded bytes")
    try:
        raw = base64.b64decode(entry, validate=True)
    except binascii.Error as exc:
        raise ValueError("Expected base64-encoded bytes") from exc
    data = _SafeUnpickler(io.BytesIO(raw)).load()
    if body.get("load_format") != "flattened_bucket":
        return dict(data)
    flat, metadata = data["flattened_tensor"], data["metadata"]
    return {
        meta.name: flat[meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape)
        for meta in metadata
    }


# get_normalized_target_modules' mapping, for the modules a decoder layer has
_NORMALIZED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
_NORMALIZED |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def normalized_modules(target_modules: str | Sequence[str]) -> set[str]:
    if isinstance(target_modules, str):
        if target_modules not in ("all", "all-linear"):
            raise ValueError("Only 'all' or 'all-linear' can be used as the string for target module")
        return {"all"}
    return {_NORMALIZED.get(m.split(".")[-1], m.split(".")[-1]) for m in target_modules}


@dataclass(frozen=True)
class LoraAdapter:
    """One loaded adapter: its scale and ``(A, B)`` per adapted weight (``<module path>.weight``)."""

    name: str
    rank: int
    scale: float
    pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]


class _Refused(ValueError):
    """A load or unload SGLang answers with ``success: false``."""


class SGLangLora:
    """The LoRA routes and the adapted weights of one server (module docstring).

    ``held()`` gives the engine's weights by name, ``load(named)`` sets some of them, ``tp_size`` the
    entries a request carries; ``enabled``, ``max_rank`` and ``target_modules`` are the server's
    ``--enable-lora``, ``--max-lora-rank`` and ``--lora-target-modules``. The engine holds the base merged
    with one adapter at a time: the last loaded, or the one the requests in flight name (a request for
    another waits until they are done, at most ``timeout_s``)."""

    def __init__(
        self,
        held: Callable[[], Mapping[str, torch.Tensor]],
        load: Callable[[list[tuple[str, torch.Tensor]]], None],
        *,
        per_rank: bool,
        enabled: bool,
        max_rank: int | None,
        target_modules: Sequence[str],
        model_name: str = "model",
        context_len: int | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self._held, self._load = held, load
        self.per_rank = per_rank
        self.enabled = enabled
        self.max_rank = max_rank
        self.target_modules = normalized_modules(list(target_modules)) if target_modules else set()
        self.model_name = model_name
        self.context_len = context_len  # the base card's max_model_len (model_config.context_len)
        self.timeout_s = timeout_s
        self.adapters: dict[str, LoraAdapter] = {}
        self.ever_loaded: list[str] = []  # the tokenizer manager's lora_ref_cache: never forgets a name
        self.bases: dict[str, torch.Tensor] = {}  # every weight an adapter reached: its base
        self.active: str | None = None  # the adapter merged into the engine's weights
        self._users = 0  # requests in flight with the active adapter (or the base)
        self._cond = threading.Condition()

    # -- routes ------------------------------------------------------------------------------------
    def handle(self, method: str, path: str, body: Mapping[str, Any] | None) -> RouteResult | None:
        data = body or {}
        if path == "/v1/models" and method == "GET":
            # 0.5.17 http_server.py available_models: ModelCard (entrypoints/openai/protocol.py) per served
            # model and per adapter; an adapter's root is its lora_path (tensors: "__tensor__")
            cards = [self._card(self.model_name, self.model_name, None, self.context_len)]
            cards += [self._card(n, "__tensor__", self.model_name, None) for n in self.adapters]
            return RouteResult(200, {"object": "list", "data": cards})
        if path == "/load_lora_adapter_from_tensors" and method == "POST":
            return self._reply(lambda: self._load_adapter(data))
        if path == "/unload_lora_adapter" and method == "POST":
            return self._reply(lambda: self._unload(str(data.get("lora_name"))))
        return None

    @staticmethod
    def _card(name: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": root,
            "parent": parent,
            "max_model_len": max_model_len,
        }

    def _reply(self, op: Callable[[], None]) -> RouteResult:
        try:
            if not self.enabled:
                raise _Refused("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
            op()
        except _Refused as exc:
            return RouteResult(400, self._output(False, str(exc)))
        return RouteResult(200, self._output(True, ""))

    def _output(self, success: bool, message: str) -> dict[str, Any]:
        # LoRAUpdateOutput through msgspec_to_builtins: every field, BaseReq's included
        loaded = dict.fromkeys(self.adapters, "__tensor__")
        return {
            "rid": None,
            "http_worker_ipc": None,
            "success": success,
            "error_message": message,
            "loaded_adapters": loaded,
        }

    def _load_adapter(self, data: Mapping[str, Any]) -> None:
        name = str(data.get("lora_name"))
        config = data.get("config_dict")
        try:
            if not isinstance(config, Mapping):
                raise _Refused("config_dict: Input should be a valid dictionary")
            if str(config["peft_type"]).lower() != "lora":
                raise _Refused(f"peft_type {config['peft_type']!r} is not LoRA")
            rank, alpha, modules = int(config["r"]), float(config["lora_alpha"]), config["target_modules"]
        except KeyError as exc:
            raise _Refused(str(exc)) from None
        if name in self.adapters:
            raise _Refused(f"Failed to load LoRA adapter {name} because it is already loaded")
        wanted = normalized_modules(modules)
        fits = self.max_rank is not None and rank <= self.max_rank
        fits = fits and ("all" in wanted or "all" in self.target_modules or wanted <= self.target_modules)
        if not fits:
            raise _Refused(
                f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory pool "
                "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`."
            )
        try:
            tensors = decode_adapter_tensors(data, 0, self.per_rank)
        except (ValueError, KeyError, RuntimeError, pickle.UnpicklingError) as exc:
            raise _Refused(str(exc)) from None
        adapter = LoraAdapter(name, rank, alpha / rank, self._pairs(name, rank, tensors))
        with self._cond:
            self.adapters[name] = adapter
            if name not in self.ever_loaded:
                self.ever_loaded.append(name)
            if self._users == 0:
                self._apply(name)  # the newest adapter is what the engine holds (its checksum's)

    def _pairs(
        self, name: str, rank: int, tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``(A, B)`` per adapted weight; every tensor must land on a weight of the model in its shape
        (``LoRAMemoryPool.load_lora_weight_to_buffer`` asserts each buffer's shape)."""
        held = self._held()
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            split = adapter_module(key.removeprefix(PEFT_PREFIX))
            weight = f"{split[0]}.weight" if split is not None else ""
            if split is None or weight not in held:
                raise _Refused(f"LoRA adapter {name}: {key} matches no linear layer of the model")
            parts.setdefault(weight, {})[split[1]] = tensor
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for weight, found in parts.items():
            a, b = found.get("lora_A.weight"), found.get("lora_B.weight")
            out, inp = held[weight].shape
            if a is None or b is None or tuple(a.shape) != (rank, inp) or tuple(b.shape) != (out, rank):
                raise _Refused(
                    f"LoRA adapter {name}: {weight} needs lora_A {(rank, inp)} and lora_B {(out, rank)}"
                )
            pairs[weight] = (a.clone(), b.clone())
        return pairs

    def _unload(self, name: str) -> None:
        with self._cond:
            if name not in self.adapters:
                raise _Refused(f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.adapters)}")
            # the requests in flight with it finish first (LoRARegistry.wait_for_unload)
            self._wait(lambda: self.active != name or self._users == 0, f"unloading {name}")
            del self.adapters[name]

    # -- generation --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def use(self, name: str | None) -> Iterator[None]:
        """Hold the engine's weights at the base merged with adapter ``name`` (None: the base) while a
        request runs. ValueError (SGLang's 400) for an adapter not loaded, or with LoRA off."""
        with self._cond:
            if name is not None and not self.enabled:
                raise ValueError(
                    f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server "
                    "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter "
                    "endpoint."
                )
            if name is not None and name not in self.ever_loaded:
                # 0.5.17 tokenizer_manager.py (the lora_path check before LoRARegistry.acquire): a name no
                # load ever named; its dict_keys are those of every adapter ever loaded
                raise ValueError(
                    f"Got LoRA adapter that has never been loaded: {name}\n"
                    f"All loaded adapters: dict_keys({self.ever_loaded!r})."
                )
            if name is not None and name not in self.adapters:
                # loaded once, unloaded since: SGLang reloads it from its lora_path, which an adapter
                # loaded from tensors lacks; refused as LoRARegistry.acquire refuses a name it lacks
                raise ValueError(
                    f"The following requested LoRA adapters are not loaded: {name}\n"
                    f"Loaded adapters: {list(self.adapters)}."
                )
            self._wait(lambda: self._users == 0 or self.active == name, f"generating with {name}")
            if self.active != name:
                self._apply(name)
            self._users += 1
        try:
            yield
        finally:
            with self._cond:
                self._users -= 1
                self._cond.notify_all()

    def base_updated(self, names: Sequence[str]) -> None:
        """A whole-weight update loaded ``names``: those are the bases from now on; the adapter in use is
        merged again from them."""
        with self._cond:
            held = self._held()
            for name in names:
                if name in self.bases:
                    self.bases[name] = held[name].detach().clone()
            active, self.active = self.active, None
            if self.bases:
                self._load([(n, b.clone()) for n, b in self.bases.items()])
            if active is not None and active in self.adapters:
                self._apply(active)

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{what}: requests with another adapter still ran after {self.timeout_s} s"
                )
            self._cond.wait(left)

    def _apply(self, name: str | None) -> None:
        """Set every weight the previous or the next adapter touches to its base, merged with ``name``'s
        adapter where it has one (from the base copy, never from a previous merge)."""
        adapter = self.adapters.get(name) if name is not None else None
        held = self._held()
        out: list[tuple[str, torch.Tensor]] = []
        # the bases: every weight an adapter merged before (the previous one's included)
        for weight in sorted(set(adapter.pairs if adapter else ()) | set(self.bases)):
            base = self.bases.get(weight)
            if base is None:
                base = self.bases[weight] = held[weight].detach().clone()
            if adapter is not None and weight in adapter.pairs:
                a, b = adapter.pairs[weight]
                out.append((weight, merge_lora(base, a.to(base.device), b.to(base.device), adapter.scale)))
            else:
                out.append((weight, base.clone()))
        if out:
            self._load(out)
        self.active = name
