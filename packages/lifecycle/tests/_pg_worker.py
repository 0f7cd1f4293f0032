"""One rank of the multi-process test: all-reduce, sleep, wake, all-reduce, for N cycles.

Run as ``python _pg_worker.py RANK WORLD_SIZE PORT CYCLES OUT_JSON``.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ppo_lifecycle.lifecycle import Lifecycle
from ppo_lifecycle.memory import HostMemoryBackend
from ppo_lifecycle.process_groups import ReloadableProcessGroups, group_timeout
from ppo_testsupport import listening_addresses

DEFAULT_TIMEOUT = timedelta(seconds=123)
SUB_TIMEOUT = timedelta(seconds=45)


def main() -> None:
    rank, world, port, cycles = (int(a) for a in sys.argv[1:5])
    out = sys.argv[5]
    torch.set_num_threads(1)
    groups = ReloadableProcessGroups()
    groups.init_default("gloo", f"tcp://127.0.0.1:{port}", world, rank, DEFAULT_TIMEOUT)
    pair = groups.new_group(ranks=[0, 1], timeout=SUB_TIMEOUT)
    # As megatron's groups are made: the same rank sets asked for again, every rank asking for all.
    shared_pairs = [groups.new_group(ranks=rs, timeout=SUB_TIMEOUT, share=True) for rs in ([0, 1], [1, 0])]
    shared_singles = [
        [groups.new_group(ranks=[r], timeout=SUB_TIMEOUT, share=True) for r in range(world)] for _ in range(2)
    ]
    # What listens on the store's port in this process (rank 0 hosts the store).
    store_listeners = [[host, p] for host, p in listening_addresses() if p == port]
    weights = torch.full((1000,), float(rank))
    memory = HostMemoryBackend()
    memory.track("weights", lambda: [weights])
    lifecycle = Lifecycle(memory, groups, name=f"rank{rank}")
    record: dict[str, list] = {
        "world": [],
        "pair": [],
        "timeouts": [],
        "alive_asleep": [],
        "weights_ok": [],
        "shared": [],
    }
    for cycle in range(cycles):
        t = torch.tensor([float(rank + cycle)])
        dist.all_reduce(t, group=groups.default.group)
        record["world"].append(t.item())
        if rank in (0, 1):
            p = torch.tensor([1.0])
            dist.all_reduce(p, group=pair.group)
            record["pair"].append(p.item())
        shared_pair = None
        if rank in (0, 1):
            p = torch.tensor([1.0])
            dist.all_reduce(p, group=shared_pairs[1].group)
            shared_pair = p.item()
        s = torch.tensor([1.0])
        dist.all_reduce(s, group=shared_singles[1][rank].group)
        same = shared_pairs[0].group is shared_pairs[1].group and all(
            a.group is b.group for a, b in zip(*shared_singles, strict=True)
        )
        record["shared"].append([shared_pair, s.item(), same])
        lifecycle.sleep()
        record["alive_asleep"].append(
            [groups.is_alive, dist.is_initialized(), weights.untyped_storage().nbytes()]
        )
        lifecycle.wake_up()
        record["weights_ok"].append(bool(torch.equal(weights, torch.full((1000,), float(rank)))))
        record["timeouts"].append(
            [
                group_timeout(groups.default.group).total_seconds(),
                group_timeout(pair.group).total_seconds() if rank in (0, 1) else None,
            ]
        )
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=groups.default.group)
    record["final"] = [t.item()]
    record["generation"] = [groups.generation]
    record["subgroups"] = list(groups.subgroup_count)
    record["store_listeners"] = store_listeners
    groups.destroy()
    with open(out, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
