"""The multi-node pieces that need no cluster: ``placement.node_resources`` in the config, the lost-node
report (``nodes.py``) and the shared-folder check's verdicts (``cluster_check.py``). The simulated
cluster runs them for real in tests-e2e/test_multinode.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray.exceptions

from ppo_driver import build, cluster_check, nodes
from ppo_driver.config import ConfigError, load_config


def test_node_resources_reach_the_placement_spec() -> None:
    config = load_config(
        None,
        [
            "placement.mode=disaggregate",
            "placement.critic=dedicated",
            "placement.node_resources={rollout: engines, actor: train, critic: train}",
        ],
    )
    assert build.placement_spec(config).node_resources == (
        ("actor", "train"),
        ("critic", "train"),
        ("rollout", "engines"),
    )
    assert build.placement_spec(load_config()).node_resources == ()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("placement.node_resources={actor: GPU}", "placement.node_resources.actor='GPU': name a custom"),
        ("placement.node_resources={actor: ''}", "placement.node_resources.actor='': name a custom"),
        ("placement.node_resources={trainer: x}", "Input should be 'actor', 'critic' or 'rollout'"),
    ],
)
def test_bad_node_resources_name_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_a_critic_resource_needs_a_critic() -> None:
    overrides = ["placement.critic=none", "algorithm.estimator=grpo", "placement.node_resources={critic: x}"]
    with pytest.raises(
        ConfigError, match=r"placement\.node_resources\.critic is set but placement\.critic='none'"
    ):
        load_config(None, overrides)


PLACED = [
    nodes.Placed("engine 0", "bbbb", "10.0.0.10"),
    nodes.Placed("actor rank 0", "aaaa", "10.0.0.9"),
    nodes.Placed("critic rank 0", "bbbb", "10.0.0.10"),
]


def test_nodes_in_address_order_with_their_processes() -> None:
    grouped = nodes.by_node(PLACED)
    assert list(grouped) == ["aaaa", "bbbb"]  # 10.0.0.9 before 10.0.0.10, as numbers
    assert [p.label for p in grouped["bbbb"]] == ["engine 0", "critic rank 0"]


def test_lost_node_message_names_the_node_and_its_roles() -> None:
    error = nodes.NodeLostError("10.0.0.10", "bbbb" * 8, ["critic rank 0", "engine 0"])
    assert (
        str(error)
        == "node 10.0.0.10 (id bbbbbbbbbbbb) left the Ray cluster; it ran the critic rank 0, engine 0"
    )


def test_only_ray_s_own_failures_wait_for_a_node_death() -> None:
    assert nodes._ray_failure(ray.exceptions.RayActorError())
    wrapped = RuntimeError("critic rank 0: the worker process died")
    wrapped.__cause__ = ray.exceptions.ActorUnavailableError("gone", None)
    assert nodes._ray_failure(wrapped)
    assert not nodes._ray_failure(ValueError("a role's own error"))
    assert nodes.lost_node([], wrapped) is None  # nothing placed: nothing to name


def test_a_node_sees_a_folder_by_its_token(tmp_path: Path) -> None:
    (tmp_path / cluster_check.TOKEN_FILE).write_text("abc")
    good = cluster_check.Needed("run folder", str(tmp_path), "abc")
    other = cluster_check.Needed("checkpoint folder (checkpoint.dir)", str(tmp_path), "xyz")
    absent = cluster_check.Needed("model folder (model.path)", str(tmp_path / "nope"))
    _, missing = cluster_check._look([good, other, absent])
    # A folder of the same path holding another token is another storage: not seen.
    assert missing == ["checkpoint folder (checkpoint.dir)", "model folder (model.path)"]


def test_the_first_blind_node_by_address_is_named() -> None:
    folders = [cluster_check.Needed("run folder", "/runs/a", "t")]
    views = [("10.0.0.10", ["run folder"]), ("10.0.0.2", []), ("10.0.0.9", ["run folder"])]
    with pytest.raises(cluster_check.SharedStorageError) as caught:
        cluster_check._raise_first(views, folders)
    assert str(caught.value).startswith(
        "node 10.0.0.9 does not see the run folder /runs/a (nor do 10.0.0.10); "
    )
    cluster_check._raise_first([("10.0.0.2", [])], folders)  # every node sees it: nothing raised
