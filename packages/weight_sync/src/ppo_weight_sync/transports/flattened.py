"""``flattened_bucket`` (SGLang's name): one update call and one flat buffer per bucket, the tensors'
bytes back to back (SGLang's ``FlattenedTensorBucket`` layout), a new bucket wherever a tensor would start
unaligned for its dtype (SGLang views each in place). The version goes with the last bucket."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ppo_weight_sync.buckets import FLATTENED_BUCKET, plan_aligned_buckets
from ppo_weight_sync.transports.base import Sent
from ppo_weight_sync.transports.broadcast import GroupLink, GroupTransport, Metadata

__all__ = ["FlattenedBucketTransport"]


class FlattenedBucketTransport(GroupTransport):
    def __init__(self, link: GroupLink) -> None:
        super().__init__(link, FLATTENED_BUCKET)

    def plan(self, items: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[int, int]]:
        sizes = [t.numel() * t.element_size() for _, t in items]
        return plan_aligned_buckets(sizes, [t.element_size() for _, t in items], self.link.bucket_bytes)

    def send(self, items: Sequence[tuple[str, torch.Tensor]], version: str) -> Sent:
        meta = Metadata.of(items)
        plan = self.plan(items)
        pipe = self.pipeline(items, plan)  # bucket 0 may be packed already (prepare)
        for k, (a, b) in enumerate(plan):
            last = k == len(plan) - 1
            pipe.calls = self.call_update(meta, a, b, version=version if last else None, flush_cache=last)
            pipe.send_flat(k)  # packs bucket k+1 while bucket k is on the wire
            pipe.drain()
            if last:
                pipe.settle()
            pipe.replies(pipe.calls)
        return Sent(sum(meta.sizes), len(plan))
