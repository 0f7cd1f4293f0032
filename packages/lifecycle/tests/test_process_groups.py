from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ppo_lifecycle.process_groups import ReloadableProcessGroups, group_timeout
from ppo_testsupport import run_ranks

WORKER = Path(__file__).with_name("_pg_worker.py")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [3])
def test_gloo_ranks_all_reduce_sleep_wake_for_ten_cycles(tmp_path: Path, world: int) -> None:
    cycles = 10
    run_ranks(WORKER, world, lambda r: [cycles, tmp_path / f"{r}.json"], timeout_s=150)
    records = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    for r, rec in enumerate(records):
        # sum over ranks of (rank + cycle)
        assert rec["world"] == [sum(range(world)) + world * c for c in range(cycles)]
        assert rec["final"] == [float(world)]
        assert rec["generation"] == [cycles]
        assert rec["alive_asleep"] == [[False, False, 0]] * cycles
        # tcp://127.0.0.1:PORT: rank 0's store listens on 127.0.0.1 only, never every interface.
        if r == 0:
            assert [host for host, _ in rec["store_listeners"]] == ["127.0.0.1"]
        else:
            assert rec["store_listeners"] == []
        assert rec["weights_ok"] == [True] * cycles
        # Shared subgroups: one group per rank set, rebuilt on every wake, right results every cycle.
        assert rec["shared"] == [[2.0 if r in (0, 1) else None, 1.0, True]] * cycles
        assert rec["subgroups"] == [1 + 2 + 2 * world, 1 + 1 + world]
        if r in (0, 1):
            assert rec["pair"] == [2.0] * cycles
            assert rec["timeouts"] == [[123.0, 45.0]] * cycles
        else:
            assert rec["pair"] == []
            assert rec["timeouts"] == [[123.0, None]] * cycles


@pytest.fixture
def single(tmp_path: Path):  # type: ignore[no-untyped-def]
    groups = ReloadableProcessGroups()
    groups.init_default("gloo", f"file://{tmp_path / 'store'}", 1, 0, timedelta(seconds=77))
    yield groups
    groups.destroy()


def test_destroy_and_reload_are_idempotent_and_keep_options(single: ReloadableProcessGroups) -> None:
    sub = single.new_group(ranks=[0], timeout=timedelta(seconds=31))
    first = sub.group
    single.destroy()
    single.destroy()
    assert not single.is_alive
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="destroyed"):
        _ = sub.group
    single.reload()
    single.reload()
    assert single.is_alive
    assert single.generation == 1
    assert sub.group is not first
    assert group_timeout(sub.group) == timedelta(seconds=31)
    assert group_timeout(single.default.group) == timedelta(seconds=77)
    assert dist.get_backend(sub.group) == "gloo"
    t = torch.ones(3)
    dist.all_reduce(t, group=sub.group)
    assert t.tolist() == [1.0, 1.0, 1.0]


def test_misuse_is_reported(single: ReloadableProcessGroups, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="already called"):
        single.init_default("gloo", "file:///nowhere", 1, 0, timedelta(seconds=1))
    other = ReloadableProcessGroups()
    with pytest.raises(RuntimeError, match="already initialized"):
        other.init_default("gloo", f"file://{tmp_path / 'other'}", 1, 0, timedelta(seconds=1))
    other.reload()  # never initialised: nothing to rebuild
    assert not other.is_alive
    with pytest.raises(ValueError, match="rank must be in"):
        other.init_default("gloo", "file:///x", 2, 2, timedelta(seconds=1))
    with pytest.raises(ValueError, match="timeout must be a positive"):
        other.init_default("gloo", "file:///x", 1, 0, 5)  # type: ignore[arg-type]
    single.destroy()
    with pytest.raises(RuntimeError, match="not alive"):
        single.new_group([0])


def test_shared_subgroups_are_one_group_that_survives_reloads(single: ReloadableProcessGroups) -> None:
    long, short = timedelta(minutes=30), timedelta(seconds=31)
    a = single.new_group(ranks=[0], timeout=long, share=True)
    b = single.new_group(ranks=[0], timeout=long, share=True)
    other_timeout = single.new_group(ranks=[0], timeout=short, share=True)
    unshared = single.new_group(ranks=[0], timeout=long)
    with_options = single.new_group(ranks=[0], timeout=long, share=True, pg_options=_gloo_options())
    assert a.group is b.group
    assert len({id(h.group) for h in (a, other_timeout, unshared, with_options)}) == 4
    assert single.subgroup_count == (5, 4)
    for _ in range(2):
        single.destroy()
        single.reload()
        assert a.group is b.group  # still one group after a rebuild
        assert len({id(h.group) for h in (a, other_timeout, unshared, with_options)}) == 4
        assert group_timeout(a.group) == long
        assert group_timeout(b.group) == long
        assert group_timeout(other_timeout.group) == short
        assert group_timeout(unshared.group) == long
        for handle in (a, b, other_timeout, unshared, with_options):
            t = torch.full((2,), 3.0)
            dist.all_reduce(t, group=handle.group)
            assert t.tolist() == [3.0, 3.0]
    assert single.subgroup_count == (5, 4)


def test_a_retried_reload_keeps_shared_subgroups_shared(
    single: ReloadableProcessGroups, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = single.new_group(ranks=[0], share=True)
    single.new_group(ranks=[0])
    b = single.new_group(ranks=[0], share=True)
    single.destroy()
    real = ReloadableProcessGroups._make_subgroup
    made: list[int] = []

    def fail_second(spec):  # type: ignore[no-untyped-def]
        made.append(1)
        if len(made) == 2:
            raise RuntimeError("injected failure making a subgroup")
        return real(spec)

    monkeypatch.setattr(ReloadableProcessGroups, "_make_subgroup", staticmethod(fail_second))
    with pytest.raises(RuntimeError, match="injected failure"):
        single.reload()
    assert not single.is_alive
    single.reload()
    assert len(made) == 3  # the shared one once, the unshared one twice (failed, then made)
    assert a.group is b.group
    t = torch.ones(1)
    dist.all_reduce(t, group=b.group)
    assert t.item() == 1.0


def _gloo_options() -> object:
    return dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]


def test_a_group_of_ones_own_on_the_store_outlives_destroy(single: ReloadableProcessGroups) -> None:
    with pytest.raises(RuntimeError, match="init_default"):
        _ = ReloadableProcessGroups().store
    # Built like ppo_trainer's save group: a gloo group outside torch's registry, on the kept store.
    own = dist.ProcessGroupGloo(dist.PrefixStore("mine/", single.store), 0, 1, timedelta(seconds=30))
    single.destroy()  # destroy_process_group: the default group and every registered group go
    assert not dist.is_initialized()
    t = torch.full((2,), 3.0)
    own.allreduce([t]).wait()  # type: ignore[attr-defined]  # torch's stubs lack Backend collectives
    assert t.tolist() == [3.0, 3.0]
    single.store.set("mine/key", "kept")
    single.reload()
    assert single.store.get("mine/key") == b"kept"
