"""Transports: how an update's bytes reach the engines, behind one small :class:`Transport` protocol.

Group-based, one module per wire format: :class:`StreamTransport` (``ppo_flat_stream:<bytes>``),
:class:`FlattenedBucketTransport` (SGLang's ``flattened_bucket``), :class:`PerTensorTransport`
(``load_format`` None). :func:`choose_group_format` picks the best one every group engine accepts.
Other transports (CUDA IPC for colocated engines) come in through a :class:`TransportFactory`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ppo_weight_sync.buckets import FLATTENED_BUCKET, STREAM_FORMAT_PREFIX
from ppo_weight_sync.endpoints import EngineEndpoint
from ppo_weight_sync.transports.base import Sent, Transport, TransportFactory
from ppo_weight_sync.transports.broadcast import GroupLink, GroupTransport
from ppo_weight_sync.transports.flattened import FlattenedBucketTransport
from ppo_weight_sync.transports.per_tensor import PerTensorTransport
from ppo_weight_sync.transports.stream import StreamTransport

__all__ = [
    "LOAD_FORMATS",
    "FlattenedBucketTransport",
    "GroupLink",
    "GroupTransport",
    "PerTensorTransport",
    "Sent",
    "StreamTransport",
    "Transport",
    "TransportFactory",
    "choose_group_format",
    "open_group_transport",
]

# What a sender may be asked for; "auto" picks the best format every engine accepts:
# stream > flattened_bucket > per-tensor.
LOAD_FORMATS = ("auto", "stream", FLATTENED_BUCKET, "per_tensor")

_TRANSPORTS: dict[str, Callable[[GroupLink], GroupTransport]] = {
    "stream": StreamTransport,
    FLATTENED_BUCKET: FlattenedBucketTransport,
    "per_tensor": PerTensorTransport,
}


def choose_group_format(requested: str, engines: Sequence[EngineEndpoint]) -> str:
    """``"stream"``, ``"flattened_bucket"`` or ``"per_tensor"``: ``requested`` (one of
    :data:`LOAD_FORMATS`) resolved against the engines' ``load_formats``; ValueError naming the engines
    that refuse an explicitly requested format."""

    def all_accept(fmt: str) -> bool:
        return all(fmt in e.load_formats for e in engines)

    if requested == "per_tensor":
        return "per_tensor"
    if requested in ("auto", "stream") and all_accept(STREAM_FORMAT_PREFIX):
        return "stream"
    if requested in ("auto", FLATTENED_BUCKET) and all_accept(FLATTENED_BUCKET):
        return FLATTENED_BUCKET
    if requested != "auto":
        marker = STREAM_FORMAT_PREFIX if requested == "stream" else requested
        refusing = [e.name for e in engines if marker not in e.load_formats]
        raise ValueError(
            f"load_format={requested!r}: engines {refusing} do not accept it (their load_formats)"
        )
    return "per_tensor"


def open_group_transport(link: GroupLink, fmt: str) -> GroupTransport:
    """The group-based transport for ``fmt`` (a value of :func:`choose_group_format`)."""
    return _TRANSPORTS[fmt](link)
