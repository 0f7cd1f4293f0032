"""The weight operations' requests, declared once: each operation takes one frozen request value.

A value is the body of one of SGLang's weight routes, with SGLang's field names
(``sglang/srt/managers/io_struct.py`` and ``sglang/srt/entrypoints/http_server.py``, 0.5.15.post1 and
0.5.23 alike): ``InitWeightsUpdateGroupReqInput`` (:class:`InitRequest`),
``UpdateWeightsFromDistributedReqInput`` (:class:`UpdateRequest`), ``UpdateWeightsFromTensorReqInput``
(:class:`TensorRequest`), ``DestroyWeightsUpdateGroupReqInput`` (:class:`DestroyRequest`). SGLang's fields
that we do not use (``selector``, ``torch_empty_cache``, ``abort_all_requests`` of a distributed update)
are left out, so SGLang applies its defaults to them, and accepted and ignored when a body carries them.

The same value serves both ends: the sender builds it; an endpoint sends its :meth:`to_json` to SGLang's
route ``"/" + OP`` (HTTP) or hands the value itself to the actor's method ``OP`` (Ray); an engine's route
``parse``s the body back into it, filling SGLang's defaults for a field left out (and refusing what
SGLang's validation refuses, :class:`ValidationError`), and :meth:`send_to` hands it to the engine's
operation of that name. Each field is declared once, with its JSON type and SGLang's default in its
metadata (what ``parse`` reads); the values themselves have no defaults: every sender says which group,
which backend and which format it means.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any, ClassVar, Protocol, Self, TypeVar

__all__ = [
    "DEFAULT_GROUP_NAME",
    "DestroyRequest",
    "InitRequest",
    "TensorRequest",
    "UpdateRequest",
    "ValidationError",
    "WeightRequest",
]

DEFAULT_GROUP_NAME = "weight_update_group"  # io_struct.py's default for every weight request


class ValidationError(ValueError):
    """A request body that SGLang's FastAPI layer would refuse before reaching the engine."""


_REQUIRED: Any = object()  # a field SGLang's model gives no default

# What ``send_to`` hands a request to: the one operation of its name, whatever it replies (an
# ``EngineReply``, or a ``Pending`` of one). ``ppo_weight_sync.ops`` declares the engines' operations in
# full on top of these requests; declaring the one method each request needs here keeps this module
# free of ``ops`` (no import circle, not even for annotations).
R_co = TypeVar("R_co", covariant=True)


class InitsGroups(Protocol[R_co]):
    def init_weights_update_group(self, request: InitRequest) -> R_co: ...


class UpdatesFromDistributed(Protocol[R_co]):
    def update_weights_from_distributed(self, request: UpdateRequest) -> R_co: ...


class DestroysGroups(Protocol[R_co]):
    def destroy_weights_update_group(self, request: DestroyRequest) -> R_co: ...


class UpdatesFromTensor(Protocol[R_co]):
    def update_weights_from_tensor(self, request: TensorRequest) -> R_co: ...


R = TypeVar("R")


def _json(kind: type, default: Any = _REQUIRED, *, items: type | None = None) -> dict[str, Any]:
    """A field's metadata: its JSON type (``items``: a list's element type) and SGLang's default."""
    return {"json": (kind, default, items)}


def _read(body: Mapping[str, Any], f: Field[Any]) -> Any:
    """Field ``f`` of ``body`` as SGLang's validation reads it: a missing field (or a null one that has a
    default) takes the default; a required one missing, or a value of another type, is refused."""
    kind, default, items = f.metadata["json"]
    if f.name not in body or (body[f.name] is None and default is not _REQUIRED):
        if default is _REQUIRED:
            raise ValidationError(f"field required: body.{f.name}")
        return default
    value = body[f.name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ValidationError(f"body.{f.name}: expected {kind.__name__}, got {type(value).__name__}")
    if items is not None and not all(isinstance(v, items) for v in value):
        raise ValidationError(f"body.{f.name}: expected a list of {items.__name__}")
    return value


@dataclass(frozen=True)
class _Body:
    """What every request value does with its fields: ``parse`` a body, write ``to_json``."""

    OP: ClassVar[str]  # the operation's name, SGLang's; its route is "/" + OP

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        """The request in ``body``: SGLang's defaults for the fields it leaves out (ValidationError for a
        required one missing or a value of the wrong type); fields we do not use are ignored."""
        return cls(**{f.name: _read(body, f) for f in fields(cls)})

    def to_json(self) -> dict[str, Any]:
        """The route's JSON body: every field under SGLang's name; a None is left out (SGLang's default
        for each optional field is None)."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass(frozen=True)
class InitRequest(_Body):
    """``POST /init_weights_update_group``: join the weight group at ``rank_offset + tp_rank``."""

    OP: ClassVar[str] = "init_weights_update_group"
    master_address: str = field(metadata=_json(str))
    master_port: int = field(metadata=_json(int))
    rank_offset: int = field(metadata=_json(int))
    world_size: int = field(metadata=_json(int))
    group_name: str = field(metadata=_json(str, DEFAULT_GROUP_NAME))
    backend: str = field(metadata=_json(str, "nccl"))

    def send_to(self, ops: InitsGroups[R]) -> R:
        return ops.init_weights_update_group(self)


@dataclass(frozen=True)
class UpdateRequest(_Body):
    """``POST /update_weights_from_distributed``: receive these tensors over the group, then load them.
    ``load_format`` None: one broadcast per tensor (every SGLang); ``"flattened_bucket"``: one flat buffer;
    ``"ppo_flat_stream:<bytes>"``: ours (:class:`~ppo_weight_sync.WeightReceiver`)."""

    OP: ClassVar[str] = "update_weights_from_distributed"
    names: list[str] = field(metadata=_json(list))
    dtypes: list[str] = field(metadata=_json(list))
    shapes: list[list[int]] = field(metadata=_json(list))
    group_name: str = field(metadata=_json(str, DEFAULT_GROUP_NAME))
    weight_version: str | None = field(metadata=_json(str, None))
    flush_cache: bool = field(metadata=_json(bool, True))
    load_format: str | None = field(metadata=_json(str, None))

    def send_to(self, ops: UpdatesFromDistributed[R]) -> R:
        return ops.update_weights_from_distributed(self)


@dataclass(frozen=True)
class DestroyRequest(_Body):
    """``POST /destroy_weights_update_group``: leave the group."""

    OP: ClassVar[str] = "destroy_weights_update_group"
    group_name: str = field(metadata=_json(str, DEFAULT_GROUP_NAME))

    def send_to(self, ops: DestroysGroups[R]) -> R:
        return ops.destroy_weights_update_group(self)


@dataclass(frozen=True)
class TensorRequest(_Body):
    """``POST /update_weights_from_tensor``: one bucket of a colocated update (CUDA IPC,
    :mod:`ppo_weight_sync.ipc`). ``serialized_named_tensors`` holds one entry per TP rank (TP rank ``i``
    reads entry ``i``; base64 text in JSON); the version and the cache flush apply once the call's bucket
    is loaded."""

    OP: ClassVar[str] = "update_weights_from_tensor"
    serialized_named_tensors: list[str] = field(metadata=_json(list, items=str))
    load_format: str | None = field(metadata=_json(str, None))
    flush_cache: bool = field(metadata=_json(bool, True))
    abort_all_requests: bool = field(metadata=_json(bool, False))
    weight_version: str | None = field(metadata=_json(str, None))

    def send_to(self, ops: UpdatesFromTensor[R]) -> R:
        return ops.update_weights_from_tensor(self)


WeightRequest = InitRequest | UpdateRequest | DestroyRequest | TensorRequest
