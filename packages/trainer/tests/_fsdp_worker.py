"""One rank of the FSDP2 sleep/wake check (run by test_sharding.py: ``rank world port out backend``).

Shards a tiny Llama over a ``ReloadableProcessGroups`` default group, trains a step, destroys and
rebuilds the groups as a sleep and wake do, and records what FSDP holds before and after
``rebind_process_groups``; then trains again and gathers the weights.
"""

from __future__ import annotations

import json
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ppo_lifecycle.process_groups import ReloadableProcessGroups
from ppo_trainer import sharding

sys.path.insert(0, str(Path(__file__).parent))
from conftest import save_tiny_llama


def first_mesh_info(model: torch.nn.Module) -> object:
    return next(iter(sharding._fsdp_param_groups(model))).mesh_info  # type: ignore[attr-defined]


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> float:
    ids = torch.arange(12, device=device).reshape(2, 6) % 16
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    norm = float(sharding.total_grad_norm(list(model.parameters())))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def main() -> None:
    rank, world, port, out, backend = sys.argv[1:6]
    rank_i, world_i = int(rank), int(world)
    device = torch.device("cuda", rank_i) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from transformers import AutoModelForCausalLM

    groups = ReloadableProcessGroups()
    groups.init_default(backend, f"tcp://127.0.0.1:{port}", world_i, rank_i, timedelta(seconds=60))
    pair = groups.new_group([0, 1])
    folder = Path(tempfile.mkdtemp()) if rank_i == 0 else None
    names = [str(save_tiny_llama(folder)) if folder else None]
    dist.broadcast_object_list(names, src=0)
    model = AutoModelForCausalLM.from_pretrained(names[0]).float().to(device)
    torch.manual_seed(0)
    sharding.shard_model(model, groups.default.group, device.type, None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    record: dict[str, object] = {"norms": [train_step(model, optimizer, device)]}

    local = sharding.local_tensors([p.data for p in model.parameters()])
    record["local_share_storage"] = all(
        t.untyped_storage().data_ptr() == p.to_local().untyped_storage().data_ptr()
        for t, p in zip(local, model.parameters(), strict=True)
    )
    record["local_numel"] = sum(t.numel() for t in local)
    record["full_numel"] = sum(p.numel() for p in model.parameters())

    groups.destroy()  # sleep
    groups.reload()  # wake
    info = first_mesh_info(model)
    record["stale_before_rebind"] = info.shard_process_group is not dist.group.WORLD  # type: ignore[attr-defined]
    record["rebound"] = sharding.rebind_process_groups(model, groups.default.group)
    record["live_after_rebind"] = info.shard_process_group is dist.group.WORLD  # type: ignore[attr-defined]
    try:
        sharding.rebind_process_groups(model, pair.group)
    except RuntimeError as exc:
        record["wrong_group_error"] = str(exc)
    record["norms"].append(train_step(model, optimizer, device))  # type: ignore[attr-defined]
    full = {n: sharding.full_tensor(t).float().cpu() for n, t in model.state_dict().items()}
    record["weights_sum"] = float(sum(t.double().sum() for t in full.values()))
    groups.destroy()
    Path(out).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
