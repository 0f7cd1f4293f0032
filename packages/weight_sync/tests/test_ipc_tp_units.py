"""CPU tests of the colocated TP path (ipc/exchange.py, ipc/tp.py): the gloo exchange between trainer
ranks (real processes), its errors, the boards' protocol across processes, and what the transport refuses."""

from __future__ import annotations

import json
import multiprocessing
import re
import time
from datetime import timedelta
from typing import Any

import pytest

from ppo_weight_sync import ColocatedIpc, free_port
from ppo_weight_sync.ipc.exchange import GlooExchange
from ppo_weight_sync.ipc.tp import IpcExporter, PeerBoard, TpLink

pytestmark = pytest.mark.timeout(180)

EXCHANGE_TIMEOUT_S = 4.0


def _rank_main(rank: int, world: int, port: int, role: str, out: Any) -> None:
    """One trainer rank: a gloo world on 127.0.0.1, a gloo subgroup as the exchange, then ``role``."""
    import torch.distributed as dist

    from ppo_weight_sync.ipc.tp import _gather

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=EXCHANGE_TIMEOUT_S))
    exchange = GlooExchange(group, EXCHANGE_TIMEOUT_S)
    start = time.monotonic()
    try:
        if role == "absent":
            time.sleep(EXCHANGE_TIMEOUT_S * 3)  # never takes part
            result: object = "absent"
        elif role == "plain":
            result = exchange.all_gather(f"from {rank}", "every rank's greeting")
        else:
            engine = "other" if role == "wrong-engine" else "e0"
            tp_rank = 0 if role == "duplicate" else rank
            link = TpLink(engine=engine, tp_rank=tp_rank, tp_size=world, exchange=exchange)
            result = sorted(_gather(link, {"x": rank}, "the boards").items())
        out.put((rank, "ok", json.dumps(result), time.monotonic() - start))
    except Exception as exc:
        out.put((rank, type(exc).__name__, str(exc), time.monotonic() - start))
    finally:
        if role != "absent":
            dist.destroy_process_group()


def _run(roles: list[str]) -> dict[int, tuple[str, str, float]]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [
        ctx.Process(target=_rank_main, args=(r, len(roles), port, role, out)) for r, role in enumerate(roles)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, str, float]] = {}
    try:
        for _ in roles:
            rank, kind, text, seconds = out.get(timeout=120)
            results[rank] = (kind, text, seconds)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return results


def test_the_exchange_gathers_every_ranks_text_over_gloo() -> None:
    results = _run(["plain", "plain", "plain"])
    for rank in range(3):
        kind, text, _ = results[rank]
        assert kind == "ok", text
        assert json.loads(text) == ["from 0", "from 1", "from 2"]


def test_a_rank_that_never_takes_part_is_named_within_the_timeout() -> None:
    results = _run(["plain", "plain", "absent"])
    for rank in (0, 1):
        kind, text, seconds = results[rank]
        assert kind == "ExchangeError", text
        assert "waiting for every rank's greeting from trainer ranks [0, 1, 2] (timeout 4 s) failed" in text
        assert seconds < EXCHANGE_TIMEOUT_S + 10


def test_the_gather_orders_messages_by_tp_rank() -> None:
    results = _run(["tp", "tp"])
    for rank in (0, 1):
        kind, text, _ = results[rank]
        assert kind == "ok", text
        assert [(i, m["x"]) for i, m in json.loads(text)] == [(0, 0), (1, 1)]


@pytest.mark.parametrize(
    ("roles", "message"),
    [
        (["tp", "wrong-engine"], "a trainer rank of the exchange feeds 'other'"),
        (["tp", "duplicate"], r"feed TP ranks \[0\]; each of 0..1 needs exactly one"),
    ],
)
def test_a_mismatched_exchange_is_refused_on_every_rank(roles: list[str], message: str) -> None:
    results = _run(roles)
    # the rank feeding "other" sees "e0" from the first: both refuse
    for rank in range(len(roles)):
        kind, text, _ = results[rank]
        assert kind == "ExchangeError", text
    assert any(re.search(message, results[r][1]) for r in results)


# ------------------------------------------------------------------ boards


def _exporter_side(path: str, abort_after_s: float) -> None:
    board = PeerBoard.attach(path)  # the test plays the lead's side in the parent; here the exporter's
    board.set("epoch", 1)
    board.put(0, json.dumps({"k": 0, "handle": "h0"}))
    board.set("packed", 1)
    time.sleep(abort_after_s)
    board.set("abort", 1)
    board.close()


def test_a_board_carries_slots_and_counters_between_processes_and_abort_ends_a_wait() -> None:
    board = PeerBoard.create()
    try:
        proc = multiprocessing.get_context("spawn").Process(target=_exporter_side, args=(board.path, 1.0))
        proc.start()

        def never() -> None:
            if board.get("abort"):
                raise RuntimeError("the exporter gave up")

        board.wait("packed", 1, 60, "bucket 0", never)
        assert json.loads(board.take(0)) == {"k": 0, "handle": "h0"}
        assert board.get("epoch") == 1
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="the exporter gave up"):
            board.wait("packed", 2, 60, "bucket 1", never)
        assert time.monotonic() - start < 30
        proc.join(30)
        with pytest.raises(TimeoutError, match=r"bucket 7: not done within 0.2 s \(loaded 0 < 8\)"):
            board.wait("loaded", 8, 0.2, "bucket 7", lambda: None)
        with pytest.raises(ValueError, match="a board slot holds 4088 bytes"):
            board.put(1, "x" * 5000)
    finally:
        board.close()
    assert not board.exists  # the owner removes its file
    with pytest.raises(ValueError, match="is not an exporting rank's board on this host"):
        PeerBoard.attach(board.path)


# ------------------------------------------------------------------ what is refused up front


class _NoExchange:
    """An exchange of a given size that must never be reached (the refusals come first)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def all_gather(self, text: str, what: str) -> list[str]:
        raise AssertionError("not reached")


def test_bad_tp_links_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="tp_size must be >= 2"):
        TpLink("e", 0, 1, _NoExchange(1))
    with pytest.raises(ValueError, match=r"tp_rank 2 is not in 0..1"):
        TpLink("e", 2, 2, _NoExchange(2))
    with pytest.raises(ValueError, match="must name one of the engines"):
        ColocatedIpc(["a"], tp={"b": TpLink("b", 0, 2, _NoExchange(2))})
    with pytest.raises(ValueError, match="this rank feeds TP rank 1; only TP rank 0's rank"):
        ColocatedIpc(["a"], tp={"a": TpLink("a", 1, 2, _NoExchange(2))})
    with pytest.raises(ValueError, match="IpcExporter feeds TP ranks >= 1"):
        IpcExporter(TpLink("a", 0, 2, _NoExchange(2)))
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int or None"):
        IpcExporter(TpLink("a", 1, 2, _NoExchange(2)), bucket_bytes=0)


class _Endpoint:
    def __init__(self, name: str, num_gpus: int) -> None:
        self.name, self.num_gpus, self.load_formats = name, num_gpus, ("flattened_bucket",)


def test_the_transport_refuses_a_tp_link_that_does_not_fit_the_engine() -> None:
    import torch

    from ppo_weight_sync.ipc.transport import IpcTransport

    transport = IpcTransport(device=torch.device("cuda", 0), bucket_bytes=1 << 20, timeout_s=10)
    with pytest.raises(ValueError, match="engine 'tp2' has 2 GPUs, its TpLink 3 TP ranks"):
        transport.connect(
            [_Endpoint("tp2", 2)],  # type: ignore[list-item]
            "s",
            tp={"tp2": TpLink("tp2", 0, 3, _NoExchange(3))},
        )
    with pytest.raises(ValueError, match=r"needs every TP rank's trainer rank .*plan_senders says which"):
        transport.connect([_Endpoint("tp2", 2)], "s")  # type: ignore[list-item]


def test_the_feeding_rank_refuses_non_finite_weights_as_the_lead_does_before_anything_else() -> None:
    import torch

    from ppo_weight_sync import NonFiniteTensorsError

    exporter = IpcExporter(TpLink("e", 1, 2, _NoExchange(2)))
    with pytest.raises(NonFiniteTensorsError, match=r"NaN or infinite values \(b\)"):
        exporter.update([("a", torch.ones(2)), ("b", torch.tensor([1.0, float("nan")]))], "v1")
    assert not exporter.is_connected  # nothing exchanged, nothing allocated: both ranks skip the update
    with pytest.raises(ValueError, match="named_tensors is empty"):
        exporter.update([], "v1")
    exporter.disconnect()  # idempotent when never connected
