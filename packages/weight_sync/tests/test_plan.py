"""Which trainer rank sends to which engine (ppo_weight_sync.plan): the rules and the bad inputs."""

from __future__ import annotations

import pytest

from ppo_weight_sync import RankSends, SenderPlan, plan_senders


def test_each_rank_serves_the_engine_on_its_gpu_and_rank_0_the_rest() -> None:
    # 2 actor ranks on GPUs a, b; engines on a, b, c (c: no actor rank there) and one of two GPUs (a, b).
    plan = plan_senders(["a", "b"], [["a"], ["b"], ["c"], ["a", "b"]])
    assert plan.ranks == (
        RankSends(rank=0, ipc=(0,), group=(2, 3)),
        RankSends(rank=1, ipc=(1,), group=()),
    )
    assert plan.ipc_by_rank == ((0,), (1,))
    assert plan.describe("NCCL") == [
        "rank 0: engine 0 over CUDA IPC, engine 2 over NCCL, engine 3 over NCCL",
        "rank 1: engine 1 over CUDA IPC",
    ]


def test_colocated_data_parallel_has_no_group_and_every_rank_sends() -> None:
    devices = [("node-1", g) for g in range(4)]
    plan = plan_senders(devices, [[d] for d in reversed(devices)])
    assert [s.ipc for s in plan.ranks] == [(3,), (2,), (1,), (0,)]
    assert all(s.group == () and s.sends for s in plan.ranks)


def test_without_ipc_rank_0_sends_everything_and_other_ranks_nothing() -> None:
    plan = plan_senders(["a", "b"], [["a"], ["b"]], ipc=False)
    assert plan.ranks == (RankSends(0, (), (0, 1)), RankSends(1, (), ()))
    assert not plan.for_rank(1).sends
    assert plan.ipc_by_rank == ()


def test_from_ipc_round_trips_and_fills_the_group() -> None:
    plan = plan_senders(["a", "b", "c"], [["x"], ["b"], ["y"]])
    assert plan.ipc_by_rank == ((), (1,))
    again = SenderPlan.from_ipc(plan.ipc_by_rank, num_engines=3, world_size=3)
    assert again == plan
    assert again.for_rank(0).group == (0, 2)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: plan_senders([], [["a"]]), "rank_devices is empty"),
        (lambda: plan_senders(["a", "a"], [["a"]]), "ranks 0 and 1 are both on device 'a'"),
        (lambda: plan_senders(["a"], [[]]), r"engine_devices\[0\] is empty"),
        (
            lambda: SenderPlan.from_ipc([[0], [2]], num_engines=2, world_size=2),
            r"ipc_by_rank\[1\] names engine",
        ),
        (lambda: SenderPlan.from_ipc([[0], [], []], num_engines=1, world_size=2), "lists 3 ranks"),
        (lambda: SenderPlan((RankSends(0, (0,), ()), RankSends(1, (0,), ()))), "engine 0 is sent by rank 0"),
        (lambda: SenderPlan((RankSends(0, (), ()), RankSends(1, (), (1,)))), "only rank 0 owns the group"),
        (lambda: SenderPlan((RankSends(1, (), ()),)), r"ranks\[0\] is rank 1"),
        (lambda: SenderPlan(()), "ranks is empty"),
        (lambda: plan_senders(["a"], [["a"]]).for_rank(1), "rank 1 is not in the plan"),
    ],
)
def test_bad_plans_are_refused_with_the_reason(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]
