"""One gloo rank of ``test_critic_health``: its uneven share of the batch, the metrics over both ranks.

Usage: ``python _critic_health_worker.py RANK WORLD PORT OUT_JSON``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from conftest import make_fields
from test_critic_health import step_of

from ppo_trainer import critic_health as ch
from ppo_trainer.backend_protocol import DataParallel
from ppo_trainer.batch import Samples


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    fields = make_fields(8, seed=6, samples_per_prompt=2)
    _samples, values, advantages, returns = step_of(fields)
    rows = [0, 1] if rank == 0 else [2, 3, 4, 5, 6, 7]
    mine = Samples.from_fields({k: [v[i] for i in rows] for k, v in fields.items()})
    # The rank's tensors are as wide as its own longest response, as the trainer's are.
    width = mine.max_response

    def own(x: torch.Tensor) -> torch.Tensor:
        return x[rows][:, :width]

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t)
        return t

    dp = DataParallel(rank=rank, world_size=world, sum_fn=all_reduce)
    metrics = ch.critic_health(dp, ch.inputs_of(mine, own(values), own(returns), own(advantages)))
    out.write_text(json.dumps(metrics))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
