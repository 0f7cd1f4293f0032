"""`ppo-driver train --ray-address` on a simulated multi-node Ray cluster (``ray.cluster_utils.Cluster``).

One cluster serves the module: a head (no CPUs: the drivers only, as a head that runs no roles) and two
worker nodes of one CPU each, at their own loopback addresses (Linux routes all of 127.0.0.0/8 to the
loopback device), so the nodes differ by address as real ones do and the placement orders their bundles
by it. Node A is 127.0.0.2 with the custom resource ``node_a``, node B 127.0.0.3 with ``node_b``. Each
node has its own raylet, object store and worker processes: the roles' processes, the weight-update
group (gloo over TCP between node addresses) and the object-store transfers between nodes are real; only
the network is the loopback device. The commands are those of docs/guide/cluster.md.

- the bundles: sorted by node address, and a role tagged with a node resource keeps its own bundles;
- a disaggregated run with the actor on node A and a dedicated critic and the engine on node B: the
  weight update's group is hosted by the actor on node A's address and the engine on node B joins it
  there, the critic's values cross to the actor through the object stores, the engines end with the
  actor's weights, and the curve is the single-node run's, bit for bit. Node B is removed mid-run: the
  stop names it and its roles, the last complete checkpoint stays; with node B back, the same command
  resumes and ends with the single-node run's weights;
- the colocated layout over both nodes (one rank, its engine and its critic per node);
- a run folder that only the driver sees (a mount of its own) stops before any role starts, naming the
  node and the folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray
from conftest import DRILL_SETTINGS, RUN_S, Run, final_checksum, latest, listening, ppo_driver_exe
from ray.cluster_utils import Cluster

from ppo_driver import checkpoint as ck
from ppo_driver.ray_start import LOCAL_RAY_ENV

NODE_A, NODE_B = "127.0.0.2", "127.0.0.3"
STEPS = 4
# Few steps, a checkpoint every 2; half a CPU per bundle: node A or B holds two bundles.
SETTINGS = {
    **DRILL_SETTINGS,
    "train.steps": STEPS,
    "rollout.eval_prompts": 8,
    "placement.cpus_per_bundle": 0.5,
}
DISAGGREGATED = {
    "placement.mode": "disaggregate",
    "placement.critic": "dedicated",
}
# Actor on node A; the critic and the engine on node B: every hand-over of a step crosses nodes.
SPLIT = {"placement.node_resources": "{actor: node_a, critic: node_b, rollout: node_b}"}
COLOCATED = {
    "placement.mode": "colocate",
    "placement.actor_gpus": 2,
    "placement.critic": "none",
    "algorithm.estimator": "grpo",
    "placement.cpus_per_bundle": 1.0,  # one bundle per node: the two ranks go to the two nodes
}
# The curve of a run: what it measured of its samples and losses, step by step.
CURVE = ("rollout/reward_mean", "actor/loss", "critic/loss", "actor/kl", "actor/grad_norm")


def _args(*sections: dict[str, Any]) -> list[str]:
    out = []
    for section in sections:
        for key, value in section.items():
            out += ["--set", f"{key}={value}"]
    return out


@dataclass
class SimCluster:
    cluster: Cluster
    address: str
    node_b: Any

    def remove_b(self) -> None:
        self.cluster.remove_node(self.node_b)

    def restore_b(self) -> None:
        self.node_b = _add(self.cluster, NODE_B, "node_b")
        self.cluster.wait_for_nodes()


def _add(cluster: Cluster, address: str, resource: str) -> Any:
    return cluster.add_node(num_cpus=1, node_ip_address=address, resources={resource: 1})


@pytest.fixture(scope="module")
def single_node_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The disaggregated run on one local Ray node (no node resources there), the reference; started
    before the cluster, whose start-up it overlaps."""
    run = Run(tmp_path_factory.mktemp("single") / "run", *_args(SETTINGS, DISAGGREGATED))
    yield run
    if run.proc.poll() is None:  # no test waited for it (a selection of the tests ran)
        run.proc.terminate()
    run.finish()


@pytest.fixture(scope="module")
def cluster(single_node_run: Run) -> Iterator[SimCluster]:
    for key, value in LOCAL_RAY_ENV.items():  # start-up waits for a loaded machine, as a local run's
        os.environ.setdefault(key, value)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        _add(c, NODE_A, "node_a")
        node_b = _add(c, NODE_B, "node_b")
        c.wait_for_nodes()
        yield SimCluster(c, c.address, node_b)
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def single_node(single_node_run: Run) -> Path:
    run = single_node_run
    assert run.finish() == 0, run.text()
    # Its own local Ray instance: one node, on the loopback address a one-machine run uses.
    assert list(_nodes(run.run_dir)) == ["127.0.0.1"], _nodes(run.run_dir)
    return run.run_dir


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _curve(run_dir: Path) -> list[tuple[Any, ...]]:
    return [tuple(r.get(k) for k in ("step", *CURVE)) for r in _metrics(run_dir)]


def _nodes(run_dir: Path) -> dict[str, list[str]]:
    listing = json.loads((run_dir / "nodes.json").read_text())["nodes"]
    return {n["node_ip"]: n["roles"] for n in listing}


# --- the bundles ---------------------------------------------------------------------------------


def test_bundles_follow_node_order_and_node_resources(cluster: SimCluster) -> None:
    from ppo_placement import PlacementSpec, create_placement_groups, remove_placement_groups

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        # Colocated, two bundles of a whole CPU: one per node; rank order is node address order.
        spec = PlacementSpec(actor_gpus=2, rollout_gpus=2, colocate=True, use_gpus=False)
        placed = create_placement_groups(spec, timeout_s=120)
        try:
            assert placed.slots["actor"].node_ips == (NODE_A, NODE_B)
            assert placed.slots["rollout"].node_ips == (NODE_A, NODE_B)
        finally:
            remove_placement_groups(placed)
        # Tagged the other way round: the actor on node B although node A sorts first, and the
        # engines on node A (without the tags, node A's bundles would be the actor's).
        spec = PlacementSpec(
            actor_gpus=1,
            rollout_gpus=1,
            critic="dedicated",
            use_gpus=False,
            cpus_per_bundle=0.5,
            node_resources=(("actor", "node_b"), ("critic", "node_b"), ("rollout", "node_a")),
        )
        placed = create_placement_groups(spec, timeout_s=120)
        try:
            assert placed.slots["actor"].node_ips == (NODE_B,)
            assert placed.slots["critic"].node_ips == (NODE_B,)
            assert placed.slots["rollout"].node_ips == (NODE_A,)
        finally:
            remove_placement_groups(placed)
    finally:
        ray.shutdown()


# --- a disaggregated run over two nodes, node B lost and back -----------------------------------


@pytest.mark.timeout(900)
def test_split_run_matches_one_node_survives_a_lost_node_and_resumes(
    cluster: SimCluster, single_node: Path, tmp_path: Path
) -> None:
    cli = ["--ray-address", cluster.address, *_args(SETTINGS, DISAGGREGATED, SPLIT)]
    run = Run(tmp_path / "run", *cli)
    pids = run.pids()
    run.wait_until("step 1", lambda: f"step 1/{STEPS} " in run.text())
    text = run.text()
    assert f"roles by node: {NODE_A}: actor rank 0; {NODE_B}: critic rank 0, engine 0" in text, text
    # The weight-update group's rendezvous: the actor (its rank 0) hosts the group's store on node A's
    # own address, not the loopback a one-node run uses (Ray's own servers listen on every address); the
    # engine on node B joined it there, or its weights (checked below) would not be the actor's.
    hosted = [address for address, _, _ in listening(pids["actor"][:1])]
    assert NODE_A in hosted, hosted

    # Node B goes once step 2's checkpoint is complete: the run stops, naming it and its roles.
    run.wait_until("step 2's checkpoint", lambda: (latest(run.run_dir) or (0,))[0] >= 2)
    cluster.remove_b()
    try:
        assert run.finish() == 1, run.text()
        text = run.text()
        saved = latest(run.run_dir)
        assert saved is not None
        assert saved[0] >= 2
        stop = [line for line in text.splitlines() if line.startswith("error: the run stopped")]
        assert len(stop) == 1, text
        assert f"NodeLostError: node {NODE_B} (id " in stop[0], stop[0]
        assert "left the Ray cluster; it ran the critic rank 0, engine 0" in stop[0], stop[0]
        assert f"resumes from {saved[1]} (step {saved[0]})" in stop[0], stop[0]
        ck.verify(saved[1])
        assert run.leftovers() == [], text
    finally:
        cluster.restore_b()

    # The same command, node B back: resumes, and ends where the single-node run did, bit for bit.
    again = Run(tmp_path / "run", *cli)
    assert again.finish() == 0, again.text()
    assert f"resumed from {saved[1]} (step {saved[0]})" in again.text()
    assert _nodes(again.run_dir) == {NODE_A: ["actor rank 0"], NODE_B: ["critic rank 0", "engine 0"]}
    summary = json.loads((again.run_dir / "summary.json").read_text())
    assert summary["engine_checksums"] == [summary["actor_checksum"]]
    assert final_checksum(again.run_dir) == final_checksum(single_node)
    # Every step's values went from the critic on node B to the actor on node A.
    records = _metrics(again.run_dir)
    assert [r["handoff/values_used"] for r in records] == [1] * STEPS
    assert all(r["bytes/handoff"] > 0 and r["weight_sync/bytes"] > 0 for r in records)
    assert _curve(again.run_dir) == _curve(single_node)


# --- the colocated layout over two nodes ---------------------------------------------------------


@pytest.mark.timeout(600)
def test_colocated_ranks_on_two_nodes(cluster: SimCluster, tmp_path: Path) -> None:
    run = Run(tmp_path / "run", "--ray-address", cluster.address, *_args(SETTINGS, COLOCATED))
    assert run.finish() == 0, run.text()
    assert _nodes(run.run_dir) == {NODE_A: ["actor rank 0", "engine 0"], NODE_B: ["actor rank 1", "engine 1"]}
    summary = json.loads((run.run_dir / "summary.json").read_text())
    # Rank 0 on node A sent the weights to both engines, engine 1 on node B through the group.
    assert summary["engine_checksums"] == [summary["actor_checksum"]] * 2
    assert all(r["weight_sync/bytes"] > 0 for r in _metrics(run.run_dir))
    assert [r["step"] for r in _metrics(run.run_dir)] == list(range(1, STEPS + 1))


# --- what every node must see --------------------------------------------------------------------


def _private_mounts() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not _private_mounts(), reason="needs `unshare -m` (root, or user namespaces)")
@pytest.mark.timeout(300)
def test_a_run_folder_only_the_driver_sees_stops_before_the_roles(
    cluster: SimCluster, tmp_path: Path
) -> None:
    # The driver runs in a mount namespace of its own with a fresh tmpfs on `local`: a folder of the
    # driver's machine that no node sees, as a node-local disk of a real cluster.
    local = tmp_path / "local"
    local.mkdir()
    train = [ppo_driver_exe(), "train", "--run-dir", str(local / "run"), "--ray-address", cluster.address]
    train += _args(SETTINGS, DISAGGREGATED)
    script = 'mount -t tmpfs tmpfs "$1" && shift && exec "$@"'
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", str(local), *train],
        capture_output=True,
        text=True,
        timeout=RUN_S,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"},
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    stop = [line for line in out.splitlines() if line.startswith("error: the run stopped")]
    assert len(stop) == 1, out
    assert (
        f"SharedStorageError: node {NODE_A} does not see the run folder {local / 'run'} (nor do {NODE_B}"
        in (stop[0])
    )
    assert "starting the rollout engine" not in out, out
    assert "Traceback" not in out, out
    assert not (local / "run").exists()  # the driver's tmpfs went with its namespace
