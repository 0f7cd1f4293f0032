"""Which trainer rank sends to which engine (ppo_weight_sync.plan): the rules and the bad inputs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_weight_sync import RankSends, SenderPlan, TpIpc, plan_senders


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


# ------------------------------------------------------------------ colocated engines of several GPUs


def test_a_tp_engine_on_trainer_gpus_is_posted_by_its_tp_rank_0_rank_and_fed_by_the_others() -> None:
    # 4 ranks on a..d; engine 0 on (b, a): TP rank 0 on b (rank 1, the lead), TP rank 1 on a... rank 0
    # never exports, so it goes to the group; engine 1 on (c, d): rank 2 posts, rank 3 exports TP rank 1.
    plan = plan_senders(["a", "b", "c", "d"], [["b", "a"], ["c", "d"]])
    assert plan.ranks == (
        RankSends(0, (), (0,)),
        RankSends(1, (), ()),
        RankSends(2, (1,), ()),
        RankSends(3, (), (), exports=((1, 1),)),
    )
    assert plan.tp == (TpIpc(engine=1, ranks=(2, 3)),)
    assert plan.tp_wire == ((1, 2, 3),)
    assert plan.describe("gloo") == [
        "rank 0: engine 0 over gloo",
        "rank 2: engine 1 over CUDA IPC (posts TP ranks 0-1: ranks 2, 3)",
        "rank 3: exports for engine 1's TP rank 1 over CUDA IPC (rank 2 posts)",
    ]
    assert SenderPlan.from_ipc(plan.ipc_by_rank, 2, 4, plan.tp_wire) == plan


def test_the_2gpu_colocated_layout_with_tp_2_has_no_group() -> None:
    plan = plan_senders(["g0", "g1"], [["g0", "g1"]])
    assert plan.ranks == (RankSends(0, (0,), ()), RankSends(1, (), (), exports=((0, 1),)))
    assert plan.describe() == [
        "rank 0: engine 0 over CUDA IPC (posts TP ranks 0-1: ranks 0, 1)",
        "rank 1: exports for engine 0's TP rank 1 over CUDA IPC (rank 0 posts)",
    ]


@pytest.mark.parametrize(
    ("engines", "why"),
    [
        ([["a", "x"]], "partly on a GPU no rank trains on"),
        ([["a", "a"]], "two TP ranks on one GPU"),
        ([["b"], ["a", "b"]], "rank 1 already posts engine 0"),
        ([["a", "b"], ["c", "b"]], "rank 1 already exports for engine 0"),
    ],
)
def test_tp_engines_ipc_cannot_serve_go_to_the_group(engines: list[list[str]], why: str) -> None:
    plan = plan_senders(["a", "b", "c"], engines)
    last = len(engines) - 1
    assert last in plan.for_rank(0).group, why
    assert all(t.engine != last for t in plan.tp), why


def test_bad_tp_plans_are_refused_with_the_reason() -> None:
    ok = plan_senders(["a", "b"], [["a", "b"]])
    cases = [
        (lambda: SenderPlan.from_ipc([[0]], 1, 2, [(0, 0)]), "at least two TP ranks"),
        (lambda: SenderPlan.from_ipc([[0]], 1, 2, [(0, 0, 0)]), "one distinct trainer rank per TP rank"),
        (lambda: SenderPlan.from_ipc([[0]], 1, 2, [(0, 0, 5)]), r"names rank\(s\) \[5\]"),
        (lambda: SenderPlan.from_ipc([[0]], 1, 2, [(3, 0, 1)]), "tp names engine 3"),
        (lambda: SenderPlan.from_ipc([[], [0]], 1, 2, [(0, 0, 1)]), "its lead, rank 0 .* must post it"),
        (lambda: SenderPlan.from_ipc([[], [0]], 1, 2, [(0, 1, 0)]), "rank 0 never exports"),
        (lambda: SenderPlan.from_ipc([[0], [1]], 2, 2, [(0, 0, 1)]), "rank 1 exports for .* also sends"),
        (
            lambda: SenderPlan((ok.ranks[0], RankSends(1, (), (), exports=((0, 1),))), ()),
            "no TP engine of the plan gives it",
        ),
        (lambda: SenderPlan((ok.ranks[0], RankSends(1, (), ())), ok.tp), "rank 1 must export for TP rank 1"),
        (lambda: SenderPlan(ok.ranks, (*ok.tp, *ok.tp)), "listed twice"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


_devices = st.sampled_from(["a", "b", "c", "d", "e", "x", "y"])


@settings(max_examples=300, deadline=None)
@given(
    ranks=st.lists(st.sampled_from(["a", "b", "c", "d", "e"]), min_size=1, max_size=5, unique=True),
    engines=st.lists(st.lists(_devices, min_size=1, max_size=3), min_size=1, max_size=5),
    ipc=st.booleans(),
)
def test_every_plan_sends_each_engine_once_from_the_right_ranks(
    ranks: list[str], engines: list[list[str]], ipc: bool
) -> None:
    plan = plan_senders(ranks, engines, ipc=ipc)
    posted = [i for s in plan.ranks for i in (*s.ipc, *s.group)]
    assert sorted(posted) == list(range(len(engines)))  # every engine exactly once
    owner = {d: r for r, d in enumerate(ranks)}
    tp = {t.engine: t for t in plan.tp}
    for s in plan.ranks:
        for i in s.ipc:
            assert ipc
            # the lead is the rank on the engine's TP-rank-0 GPU; TP 1: the rank on its one GPU
            assert owner.get(engines[i][0]) == s.rank
            if len(engines[i]) > 1:
                assert tp[i].ranks == tuple(owner[d] for d in engines[i])
            else:
                assert i not in tp
        for engine, tp_rank in s.exports:
            assert owner[engines[engine][tp_rank]] == s.rank
            assert tp_rank >= 1
            assert s.exports == ((engine, tp_rank),)  # an exporting rank does nothing else
            assert (s.ipc, s.group, s.rank != 0) == ((), (), True)
        if s.rank != 0:
            assert not s.group
    for i, devices in enumerate(engines):
        if not all(d in owner for d in devices) or len(set(devices)) != len(devices):
            assert i in plan.for_rank(0).group  # anything not wholly on distinct trainer GPUs: the group
    # the trainer's config round trip
    assert SenderPlan.from_ipc(plan.ipc_by_rank, len(engines), len(ranks), plan.tp_wire) == plan
