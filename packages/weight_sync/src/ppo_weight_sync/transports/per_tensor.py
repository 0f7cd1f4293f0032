"""Per-tensor broadcast (``load_format`` None, what every SGLang accepts): one update call per bucket
and one broadcast per tensor, as slime does. The version goes with the last bucket."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ppo_weight_sync.buckets import plan_buckets
from ppo_weight_sync.transports.base import Sent
from ppo_weight_sync.transports.broadcast import GroupLink, GroupTransport, Metadata, Pipeline

__all__ = ["PerTensorTransport"]


class PerTensorTransport(GroupTransport):
    def __init__(self, link: GroupLink) -> None:
        super().__init__(link, None)

    def send(self, items: Sequence[tuple[str, torch.Tensor]], version: str) -> Sent:
        meta = Metadata.of(items)
        plan = plan_buckets(meta.sizes, self.link.bucket_bytes)
        pipe = Pipeline(self.link, self.staging, [], [])
        a, b = plan[0]
        current = [self.link.prepare(t) for _, t in items[a:b]]
        for k, (a, b) in enumerate(plan):
            last = k == len(plan) - 1
            pipe.calls = self.call_update(meta, a, b, version=version if last else None, flush_cache=last)
            works = [self.link.group.broadcast(t) for t in current]
            # Prepare the next bucket's tensors (device copies) while this one is on the wire.
            nxt = [] if last else [self.link.prepare(t) for _, t in items[plan[k + 1][0] : plan[k + 1][1]]]
            for work in works:
                pipe.wait(work)
            if last:
                pipe.settle()
            del works  # the tensors they sent are complete (waited above) and may be freed
            current = nxt
            pipe.replies(pipe.calls)
        return Sent(sum(meta.sizes), len(plan))
