"""The weight update across nodes, on a simulated Ray cluster, against a raw gloo broadcast of its bytes.

A ``ray.cluster_utils.Cluster`` on this machine: a head with no CPUs, node A (127.0.0.2, resource
``node_a``) and node B (127.0.0.3, resource ``node_b``), each its own raylet and object store. The run's
own roles start there as a run starts them (``create_roles``): the actor on node A, one built-in engine
on node B (``placement.node_resources``), the tiny model at the size given. Then:

- ``ours``: ``actor.update_weights`` (what the loop calls each step: the engine paused, the weights
  packed into buckets, broadcast over the weight-update group whose store the actor hosts on node A's
  address, loaded by the engine, which replies), wall time per update;
- ``baseline``: two bare Ray actors on node A and node B in a torch.distributed gloo group of their
  own (store on node A's address), broadcasting one uint8 tensor of the same byte count.

Median of ``--reps`` after a warm-up; the ratio is ours over the baseline. Both go through the loopback
device: the figure is the update's own overhead over a bare broadcast (packing, control calls, loading),
not a network's bandwidth or latency (docs/guide/cluster.md).

    python benchmarks/bench_multinode_update.py                      # the tiny model's default size
    python benchmarks/bench_multinode_update.py --hidden 512 --layers 8 --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray
import torch
from ray.cluster_utils import Cluster

from ppo_driver.config import load_config
from ppo_driver.ray_start import LOCAL_RAY_ENV
from ppo_driver.roles import create_roles, shutdown_roles
from ppo_rollout.tasks import make_tiny_model

NODE_A, NODE_B = "127.0.0.2", "127.0.0.3"


@ray.remote(num_cpus=0)
class Peer:
    """One end of the baseline: a gloo group of two, rank 0 hosting the store on node A's address."""

    def join(self, rank: int, port: int, nbytes: int) -> None:
        import torch.distributed as dist

        store = dist.TCPStore(NODE_A, port, 2, is_master=rank == 0, timeout=timedelta(seconds=120))
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timedelta(seconds=120)
        # Each end's gloo device on its own node's address, as the run's group binds its members.
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=(NODE_A, NODE_B)[rank])]
        self.group: Any = dist.ProcessGroupGloo(store, rank, 2, options)  # broadcast is not in the stubs
        self.buf = torch.full((nbytes,), rank, dtype=torch.uint8)

    def broadcast(self) -> float:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        t0 = time.perf_counter()
        self.group.broadcast([self.buf], opts).wait()
        return time.perf_counter() - t0


def baseline(nbytes: int, reps: int) -> list[float]:
    from ppo_weight_sync import free_port

    sender = Peer.options(resources={"node_a": 0.001}).remote()  # type: ignore[attr-defined]
    receiver = Peer.options(resources={"node_b": 0.001}).remote()  # type: ignore[attr-defined]
    port = free_port(NODE_A)
    ray.get([sender.join.remote(0, port, nbytes), receiver.join.remote(1, port, nbytes)], timeout=300)
    times = []
    for _ in range(reps + 1):  # the first is the warm-up
        refs = [sender.broadcast.remote(), receiver.broadcast.remote()]
        t0 = time.perf_counter()
        ray.get(refs, timeout=300)
        times.append(time.perf_counter() - t0)
    for peer in (sender, receiver):
        ray.kill(peer)
    return times[1:]


def ours(args: argparse.Namespace, work: Path) -> tuple[int, list[float], dict[str, Any]]:
    overrides = [
        "placement.mode=disaggregate",
        "placement.critic=none",
        "algorithm.estimator=grpo",
        "placement.cpus_per_bundle=0.5",
        "placement.node_resources={actor: node_a, rollout: node_b}",
        f"model.tiny.hidden_size={args.hidden}",
        f"model.tiny.num_layers={args.layers}",
        f"model.tiny.intermediate_size={args.hidden * 4}",
        f"ray.address={ray.get_runtime_context().gcs_address}",
    ]
    config = load_config(None, overrides)
    tiny = config.model.tiny
    model = make_tiny_model(
        "copy_small",
        work / "model",
        config.train.seed,
        hidden_size=tiny.hidden_size,
        num_layers=tiny.num_layers,
        num_heads=tiny.num_heads,
        intermediate_size=tiny.intermediate_size,
        max_positions=tiny.max_positions,
    )
    roles = create_roles(config, model, 600.0)
    try:
        roles.actor.connect_engines(roles.rollout.endpoints())
        times, metrics = [], {}
        for version in range(args.reps + 1):  # the first is the warm-up
            t0 = time.perf_counter()
            metrics = roles.actor.update_weights(version=str(version))
            times.append(time.perf_counter() - t0)
        checksums = roles.rollout.weights_checksums()
        assert checksums == [roles.actor.weights_checksum()], "the engine does not hold the actor's weights"
        return int(metrics["weight_sync/bytes"]), times[1:], metrics
    finally:
        shutdown_roles(roles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=64, help="model.tiny.hidden_size (64: the default)")
    parser.add_argument("--layers", type=int, default=2, help="model.tiny.num_layers")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, node_ip_address=NODE_A, resources={"node_a": 1})
        cluster.add_node(num_cpus=1, node_ip_address=NODE_B, resources={"node_b": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        with tempfile.TemporaryDirectory() as work:
            nbytes, mine, metrics = ours(args, Path(work))
        base = baseline(nbytes, args.reps)
    finally:
        ray.shutdown()
        cluster.shutdown()
    ours_s, base_s = statistics.median(mine), statistics.median(base)
    mb = nbytes / 1e6

    def row(name: str, seconds: float) -> str:
        return f"{name:<50} {seconds * 1e3:8.2f} ms  {mb / 1e3 / seconds:.3f} GB/s"

    print(f"weights: {mb:.2f} MB (tiny model, hidden {args.hidden}, {args.layers} layers, float32)")
    print(row("ours (actor.update_weights, node A -> node B)", ours_s))
    print(f"  of which the transfer (weight_sync/seconds): {metrics['weight_sync/seconds'] * 1e3:.2f} ms")
    print(row("baseline (raw gloo broadcast, node A -> node B)", base_s))
    print(f"ratio ours / baseline: {ours_s / base_s:.2f}x (median of {args.reps}; loopback, not a network)")


if __name__ == "__main__":
    main()
