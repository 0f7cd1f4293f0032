"""The weight-update group must never be made by splitting the trainer's own default group.

torch builds a new NCCL group by ``ncclCommSplit`` of the default communicator whenever the default
group is bound to a device; a weight group made that way would not include the engines and rank 0 would
never publish the NCCL unique id they wait for. ``ppo_weight_sync`` hides the binding while it builds its
group; this checks that it does (and restores it), in a separate process with its own default group.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

_CHILD = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from ppo_weight_sync.group import _unbound_default_group, free_port

    port = free_port("127.0.0.1")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, device_id=torch.device("cpu", 0)
    )
    default = c10d._world.default_pg
    assert default.bound_device_id == torch.device("cpu", 0)
    with _unbound_default_group("nccl"):
        # what _new_process_group_helper reads to decide on a split
        assert not c10d._get_default_group().bound_device_id
    assert default.bound_device_id == torch.device("cpu", 0), "binding not restored"
    with _unbound_default_group("gloo"):
        assert default.bound_device_id == torch.device("cpu", 0), "gloo groups never split: left alone"
    try:
        with _unbound_default_group("nccl"):
            raise KeyError("boom")
    except KeyError:
        pass
    assert default.bound_device_id == torch.device("cpu", 0), "binding not restored after an error"
    dist.destroy_process_group()
    print("ok")
    """
)


def test_weight_group_hides_the_default_groups_device_binding() -> None:
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok"), done.stdout
