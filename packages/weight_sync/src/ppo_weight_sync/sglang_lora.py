"""Adapter-only weight updates to SGLang: the actor's LoRA adapters, loaded as one SGLang LoRA adapter.

Followed from SGLang 0.5.23's source (``sglang/srt/``; 0.5.15.post1 and 0.5.16 where noted):

- ``POST /load_lora_adapter_from_tensors`` (``entrypoints/http_server.py``) takes
  ``LoadLoRAAdapterFromTensorsReqInput`` (``managers/io_struct.py``): ``lora_name``, ``config_dict`` (the
  PEFT ``adapter_config.json``), ``serialized_named_tensors`` (base64, one entry per TP rank; before
  0.5.17 one string in ``serialized_tensors``) and ``load_format``. It answers ``LoRAUpdateOutput``
  (``success``, ``error_message``, ``loaded_adapters``), 200 or 400.
- Each TP rank decodes its own entry (``managers/tp_worker.py`` ``load_lora_adapter_from_tensors``):
  ``MultiprocessingSerializer.deserialize`` (``utils/common.py``, a ``SafeUnpickler`` that admits torch's
  tensor and storage rebuilders, ``types.SimpleNamespace`` and ``torch.storage._load_from_bytes``
  through ``torch.load(weights_only=True)``), then for ``load_format == "flattened_bucket"``
  ``FlattenedTensorBucket(flattened_tensor=..., metadata=...).reconstruct_tensors()``
  (``weight_sync/tensor_bucket.py``: each entry's ``start_idx:end_idx`` bytes viewed as its dtype and
  shape). We pickle the bucket by value (a CPU ``uint8`` tensor), so it reaches a server on any host.
- ``LoRAConfig`` (``lora/lora_config.py``) reads ``r``, ``lora_alpha`` and ``target_modules``;
  ``LoRAAdapter`` (``lora/lora.py``) needs ``peft_type`` ``lora`` and scales by ``lora_alpha / r``, as
  peft and :func:`ppo_weight_sync.lora.merge_lora` do. Tensor names are PEFT's
  (``base_model.model.<module path>.lora_A.weight``); SGLang files them by their ``layers.<i>.`` id.
- A name loads once: a loaded name is refused ("already loaded", ``LoRAManager.validate_new_adapter``),
  so an update first unloads (``POST /unload_lora_adapter {"lora_name"}``) the adapter of that name
  when ``GET /v1/models`` lists it. An unload waits for the requests using the adapter to finish
  (``TokenizerManager._unload_lora_adapter_locked``): a weight update never overlaps a rollout here.
- Loading an adapter leaves the weight version as it was; ``POST /update_weight_version``
  (``{"new_version", "abort_all_requests": false}``) sets it.
- ``/generate`` requests name the adapter in ``lora_path`` (``GenerateReqInput``; resolved by
  ``TokenizerManager._resolve_lora_path``). The server needs ``--enable-lora``, ``--max-lora-rank`` and
  ``--lora-target-modules`` (:func:`server_args`) to take adapters it did not start with.
"""

from __future__ import annotations

import base64
import io
import pickle
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ppo_weight_sync.endpoints import EngineEndpoint, HttpEngineEndpoint
from ppo_weight_sync.errors import EngineRejectedError
from ppo_weight_sync.lora import adapter_module
from ppo_weight_sync.transports.base import Sent

__all__ = [
    "ADAPTER_NAME",
    "PEFT_PREFIX",
    "AdapterPayload",
    "SGLangAdapterTransport",
    "SGLangAdapters",
    "server_args",
]

ADAPTER_NAME = "ppo_actor"  # the one adapter an update keeps loaded; generate requests name it
PEFT_PREFIX = "base_model.model."  # peft's get_peft_model_state_dict names, as adapter files hold them
FLATTENED_BUCKET = "flattened_bucket"


def server_args(rank: int, target_modules: Sequence[str]) -> list[str]:
    """SGLang's launch arguments for adapters loaded at run time: LoRA on, the largest rank, the modules
    (``all``: every module SGLang supports in the model; the server requires both without
    ``--lora-paths``, ``arg_groups/lora_hook.py``)."""
    modules = list(target_modules) or ["all"]
    return ["--enable-lora", "--max-lora-rank", str(int(rank)), "--lora-target-modules", *modules]


@dataclass(frozen=True)
class AdapterPayload:
    """One update's adapters, encoded once for every engine: the PEFT config and the flattened bucket."""

    config: dict[str, Any]
    bucket: str  # base64 of the pickled {"flattened_tensor", "metadata"}
    nbytes: int  # the tensors' bytes (what the update moves, before base64)

    @classmethod
    def encode(cls, items: Sequence[tuple[str, torch.Tensor]], alpha: float) -> AdapterPayload:
        """ValueError for a tensor that is not an adapter (``<module path>.lora_A.weight`` / ``lora_B``),
        or for adapters of different ranks."""
        modules: set[str] = set()
        ranks: set[int] = set()
        for name, tensor in items:
            split = adapter_module(name)
            if split is None:
                raise ValueError(
                    f"{name!r} is not a LoRA adapter tensor: an adapter update to SGLang carries "
                    "<module>.lora_A.weight and <module>.lora_B.weight only (train.lora.update='adapters')"
                )
            modules.add(split[0].rsplit(".", 1)[-1])
            ranks.add(int(tensor.shape[0] if split[1] == "lora_A.weight" else tensor.shape[1]))
        if len(ranks) != 1:
            raise ValueError(f"the adapters have ranks {sorted(ranks)}; SGLang loads one rank per adapter")
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": ranks.pop(),
            "lora_alpha": float(alpha),
            "target_modules": sorted(modules),
            "bias": "none",
        }
        bucket, nbytes = encode_bucket([(PEFT_PREFIX + n, t) for n, t in items])
        return cls(config, bucket, nbytes)

    def request(self, name: str, tp_size: int, per_rank: bool) -> dict[str, Any]:
        """The ``/load_lora_adapter_from_tensors`` body: one payload per TP rank from 0.5.17, one
        ``serialized_tensors`` string before (``per_rank``: :attr:`SGLangProtocol.lora_payload_per_rank`)."""
        body: dict[str, Any] = {
            "lora_name": name,
            "config_dict": self.config,
            "load_format": FLATTENED_BUCKET,
        }
        if per_rank:
            body["serialized_named_tensors"] = [self.bucket] * tp_size
        else:
            body["serialized_tensors"] = self.bucket
        return body


def encode_bucket(items: Sequence[tuple[str, torch.Tensor]]) -> tuple[str, int]:
    """``items`` as SGLang's ``flattened_bucket``: one CPU ``uint8`` tensor of their bytes back to back and
    one metadata entry per tensor (``FlattenedTensorMetadata``'s fields, as a ``SimpleNamespace``, which
    its SafeUnpickler admits), pickled by value and base64-encoded; returns it and the tensors' bytes."""
    flats = [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for _, t in items]
    metadata = []
    offset = 0
    for (name, tensor), flat in zip(items, flats, strict=True):
        metadata.append(
            types.SimpleNamespace(
                name=name,
                shape=torch.Size(tensor.shape),
                dtype=tensor.dtype,
                start_idx=offset,
                end_idx=offset + flat.numel(),
                numel=flat.numel(),
            )
        )
        offset += flat.numel()
    # torch.cat makes a fresh storage of exactly these bytes: the pickle holds nothing else.
    payload = {"flattened_tensor": torch.cat(flats), "metadata": metadata}
    buf = io.BytesIO()
    pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(payload)
    return base64.b64encode(buf.getvalue()).decode("ascii"), offset


class SGLangAdapters:
    """Claims the SGLang engines for adapter-only updates (a
    :class:`~ppo_weight_sync.transports.TransportFactory`): they load the adapters over HTTP instead of
    joining the weight group. ``alpha``: ``train.lora.alpha`` (SGLang scales by ``lora_alpha / r``)."""

    def __init__(self, alpha: float, name: str = ADAPTER_NAME) -> None:
        if alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {alpha}")
        self.alpha = alpha
        self.name = name

    def serves(self, engine: EngineEndpoint) -> bool:
        return isinstance(engine, HttpEngineEndpoint) and engine.sglang is not None

    def open(self, engines: Sequence[EngineEndpoint], timeout_s: float) -> SGLangAdapterTransport:
        return SGLangAdapterTransport(
            [e for e in engines if isinstance(e, HttpEngineEndpoint)], self.alpha, self.name
        )


class SGLangAdapterTransport:
    """Loads each update's adapters into every engine as the adapter ``name`` (module docstring): unload
    the one loaded, load the new one, set the weight version. Every call is bounded by the endpoint's
    timeout; a refusal raises :class:`~ppo_weight_sync.errors.EngineRejectedError` with SGLang's message."""

    def __init__(self, engines: Sequence[HttpEngineEndpoint], alpha: float, name: str) -> None:
        self._engines = tuple(engines)
        self.alpha = alpha
        self.name = name

    @property
    def engines(self) -> tuple[EngineEndpoint, ...]:
        return self._engines

    @property
    def load_format(self) -> str | None:
        return FLATTENED_BUCKET

    def prepare(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        pass  # the encoding is small (the adapters alone) and done in send

    def send(self, items: Sequence[tuple[str, torch.Tensor]], version: str) -> Sent:
        payload = AdapterPayload.encode(items, self.alpha)
        for engine in self._engines:
            self._load(engine, payload, version)
        return Sent(payload.nbytes, 1)

    def close(self) -> None:
        pass  # nothing is kept between updates

    def _load(self, engine: HttpEngineEndpoint, payload: AdapterPayload, version: str) -> None:
        protocol = engine.sglang
        if protocol is None:
            raise ValueError(f"engine {engine.name} is not an SGLang server")
        if self.name in loaded_adapters(engine):
            _check(engine, "unload_lora_adapter", {"lora_name": self.name})
        body = payload.request(self.name, engine.num_gpus, protocol.lora_payload_per_rank)
        _check(engine, "load_lora_adapter_from_tensors", body)
        _check(engine, "update_weight_version", {"new_version": version, "abort_all_requests": False})


def loaded_adapters(engine: HttpEngineEndpoint) -> list[str]:
    """The adapters ``GET /v1/models`` lists (the cards with a ``parent``; the base model has none)."""
    body = engine.request("GET", "/v1/models")
    cards = body.get("data") if isinstance(body, Mapping) else None
    if not isinstance(cards, list):
        raise EngineRejectedError(engine.name, "v1/models", f"no model list in {str(body)[:200]}")
    return [str(c["id"]) for c in cards if isinstance(c, Mapping) and c.get("parent") is not None]


def _check(engine: HttpEngineEndpoint, op: str, body: dict[str, Any]) -> None:
    reply = engine.request("POST", "/" + op, body)
    if isinstance(reply, Mapping) and reply.get("success") is True:
        return
    message = reply.get("error_message") or reply.get("message") if isinstance(reply, Mapping) else reply
    raise EngineRejectedError(engine.name, op, str(message or reply))
