"""``ppo_flat_stream:<bucket_bytes>`` (ours): one update call carries every tensor's metadata; the data
follows as one flat buffer per bucket of ``plan_buckets(sizes, bucket_bytes)``, which the receiver
derives too, so no request/reply round trip sits between buckets. The version goes with the metadata;
the engine reports it only once every bucket is loaded."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ppo_weight_sync.buckets import plan_buckets, stream_format
from ppo_weight_sync.transports.base import Sent
from ppo_weight_sync.transports.broadcast import GroupLink, GroupTransport, Metadata

__all__ = ["StreamTransport"]


class StreamTransport(GroupTransport):
    def __init__(self, link: GroupLink) -> None:
        super().__init__(link, stream_format(link.bucket_bytes))

    def plan(self, items: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[int, int]]:
        return plan_buckets([t.numel() * t.element_size() for _, t in items], self.link.bucket_bytes)

    def send(self, items: Sequence[tuple[str, torch.Tensor]], version: str) -> Sent:
        meta = Metadata.of(items)
        plan = self.plan(items)
        pipe = self.pipeline(items, plan)  # bucket 0 may be packed already (prepare)
        calls = self.call_update(meta, 0, len(items), version=version, flush_cache=True)
        pipe.calls = calls
        for k in range(len(plan)):
            pipe.send_flat(k)
        pipe.drain()
        pipe.settle()
        pipe.replies(calls)
        return Sent(sum(meta.sizes), len(plan))
