"""Trainer ranks as real processes for colocated GPU tests: each plans from opaque device labels, holds the
full weights on its GPU, and sends what :func:`~ppo_weight_sync.plan_senders` gives it (a
``WeightSender`` with ``ColocatedIpc`` for the engines it posts, an ``IpcExporter`` for a TP rank it feeds),
exchanging over a gloo subgroup per TP engine, as ``ppo-trainer``'s actor ranks do.

Device labels are opaque to the plan, so two ranks on one GPU can play ranks on "gpu-a" and "gpu-b" (one
GPU machine): every process here uses ``cuda:0``. :class:`RankProcesses` starts them (spawn) and sends
every rank the same command at once (``connect``, ``update``, ``memory``, ``disconnect``), collecting each
rank's answer or error, so a test sees what each rank raised and how long it took.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["EngineInfo", "RankProcesses", "RankReply"]


@dataclass(frozen=True)
class EngineInfo:
    url: str
    name: str
    num_gpus: int
    load_formats: tuple[str, ...]
    sglang: bool = False  # an SGLang server (or its stand-in): its endpoint reads the protocol from it


@dataclass(frozen=True)
class RankReply:
    rank: int
    ok: bool
    value: Any  # the command's result, or the error's text
    error_type: str
    seconds: float


def _rank_main(
    conn: Connection,
    rank: int,
    world: int,
    port: int,
    rank_devices: list[str],
    engine_devices: list[list[str]],
    engines: list[EngineInfo],
    spec: dict[str, Any],
    bucket_bytes: int | None,
    timeout_s: float,
) -> None:
    """One trainer rank's process: join the ranks' group, build its sender (or exporter) from the plan,
    then serve the commands it is sent until ``exit``."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")  # the CUDA context before the baseline
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    trainer = _Rank.planned(rank, rank_devices, engine_devices, engines, spec, bucket_bytes, timeout_s)
    conn.send(("ready", trainer.described))
    _serve(conn, trainer)


@dataclass
class _Rank:
    """What one rank sends with: its ``WeightSender`` (engines it posts to or reaches over the group)
    and its ``IpcExporter`` (a TP engine's rank it feeds), either may be None."""

    spec: dict[str, Any]
    targets: list[Any]  # HttpEngineEndpoint
    sender: Any  # WeightSender | None
    exporter: Any  # IpcExporter | None
    described: list[str]  # the plan, as plan_senders describes it

    @classmethod
    def planned(
        cls,
        rank: int,
        rank_devices: list[str],
        engine_devices: list[list[str]],
        engines: list[EngineInfo],
        spec: dict[str, Any],
        bucket_bytes: int | None,
        timeout_s: float,
    ) -> _Rank:
        from ppo_weight_sync import ColocatedIpc, WeightSender, plan_senders
        from ppo_weight_sync.ipc.tp import IpcExporter

        plan = plan_senders(rank_devices, engine_devices)
        links = _tp_links(plan, rank, engines, timeout_s)
        mine = plan.for_rank(rank)
        endpoints = _endpoints(engines, timeout_s)
        targets = [endpoints[i] for i in (*mine.ipc, *mine.group)]
        sender = None
        if targets:
            colocated = ColocatedIpc(
                [endpoints[i].name for i in mine.ipc],
                bucket_bytes=bucket_bytes,
                tp={endpoints[i].name: links[i] for i in mine.ipc if i in links},
            )
            sender = WeightSender(backend="gloo", timeout_s=timeout_s, transports=[colocated])
        exporter = None
        if mine.exports:
            exporter = IpcExporter(links[mine.exports[0][0]], bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        return cls(spec, targets, sender, exporter, plan.describe())

    def run(self, cmd: str, args: Any) -> Any:
        """One command's result (None for those that return nothing)."""
        if cmd == "connect":
            if self.sender is not None:
                self.sender.connect(self.targets)
            if self.exporter is not None:
                self.exporter.connect()
            return None
        if cmd == "update":
            return self._update(*args)
        if cmd == "memory":
            return _memory()
        if cmd == "disconnect":
            if self.sender is not None:
                self.sender.disconnect()
            if self.exporter is not None:
                self.exporter.disconnect()
            return None
        raise ValueError(f"unknown command {cmd!r}")

    def _update(self, seed: int, version: str) -> Any:
        from ppo_weight_sync.testing.engine import make_weights

        value: Any = None
        weights = make_weights(self.spec, seed, device="cuda")
        try:
            if self.sender is not None:
                if not self.sender.is_connected:
                    self.sender.connect(self.targets)
                self.sender.update(weights.items(), version)
                value = self.sender.pop_metrics()
            if self.exporter is not None:
                self.exporter.update(list(weights.items()), version)
                value = self.exporter.pop_metrics()
        finally:
            del weights  # also after a failure: a memory reading must see the library's share only
        return value


def _tp_links(plan: Any, rank: int, engines: list[EngineInfo], timeout_s: float) -> dict[int, Any]:
    """This rank's link to each TP engine it serves: one gloo subgroup per TP engine."""
    import torch.distributed as dist

    from ppo_weight_sync.ipc.exchange import GlooExchange
    from ppo_weight_sync.ipc.tp import TpLink

    links: dict[int, Any] = {}
    for tp in plan.tp:  # every rank creates every subgroup, in the same order (torch's rule)
        group = dist.new_group(ranks=sorted(tp.ranks), backend="gloo", timeout=timedelta(seconds=timeout_s))
        if rank in tp.ranks and isinstance(group, dist.ProcessGroup):
            exchange = GlooExchange(group, timeout_s)
            links[tp.engine] = TpLink(engines[tp.engine].name, tp.ranks.index(rank), len(tp.ranks), exchange)
    return links


def _endpoints(engines: list[EngineInfo], timeout_s: float) -> list[Any]:
    from ppo_weight_sync import HttpEngineEndpoint

    return [
        HttpEngineEndpoint.for_sglang(e.url, num_gpus=e.num_gpus, timeout_s=timeout_s, name=e.name)
        if e.sglang  # its protocol (the weight-update session of 0.5.21+) read from the server
        else HttpEngineEndpoint(
            e.url, name=e.name, num_gpus=e.num_gpus, timeout_s=timeout_s, load_formats=e.load_formats
        )
        for e in engines
    ]


def _memory() -> dict[str, int]:
    import torch

    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}


def _serve(conn: Connection, trainer: _Rank) -> None:
    """Answer each command with (ok, value or error text, error type, seconds) until ``exit``."""
    while True:
        try:
            cmd, args = conn.recv()
        except (EOFError, OSError):
            return
        if cmd == "exit":
            conn.send((True, None, "", 0.0))
            return
        start = time.monotonic()
        try:
            value = trainer.run(cmd, args)
        except Exception as exc:
            conn.send((False, str(exc), type(exc).__name__, time.monotonic() - start))
            continue
        conn.send((True, value, "", time.monotonic() - start))


class RankProcesses:
    """``len(rank_devices)`` trainer ranks (spawned processes on ``cuda:0``) planned from the labels."""

    def __init__(
        self,
        rank_devices: Sequence[str],
        engine_devices: Sequence[Sequence[str]],
        engines: Sequence[EngineInfo],
        spec: Mapping[str, Any],
        *,
        bucket_bytes: int | None,
        timeout_s: float,
        start_timeout_s: float = 180.0,
    ) -> None:
        from ppo_weight_sync.net import free_port

        ctx = multiprocessing.get_context("spawn")
        port = free_port("127.0.0.1")
        self._conns: list[Connection] = []
        self.processes = []
        for rank in range(len(rank_devices)):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main,
                args=(
                    child,
                    rank,
                    len(rank_devices),
                    port,
                    list(rank_devices),
                    [list(d) for d in engine_devices],
                    list(engines),
                    dict(spec),
                    bucket_bytes,
                    timeout_s,
                ),
                name=f"trainer-rank-{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self.processes.append(proc)
        self.plan: list[str] = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(start_timeout_s):
                self.close()
                raise TimeoutError(f"trainer rank {rank} did not start within {start_timeout_s:g} s")
            _, self.plan = conn.recv()

    def call(self, cmd: str, *args: Any, timeout_s: float = 120.0) -> list[RankReply]:
        """Send ``cmd`` to every rank at once; every rank's reply, in rank order."""
        for conn in self._conns:
            conn.send((cmd, args))
        replies = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(timeout_s):
                raise TimeoutError(f"trainer rank {rank} did not answer {cmd} within {timeout_s:g} s")
            ok, value, error_type, seconds = conn.recv()
            replies.append(RankReply(rank, ok, value, error_type, seconds))
        return replies

    def ok(self, cmd: str, *args: Any, timeout_s: float = 120.0) -> list[Any]:
        """:meth:`call`, raising the first rank's error."""
        replies = self.call(cmd, *args, timeout_s=timeout_s)
        for r in replies:
            if not r.ok:
                raise RuntimeError(f"trainer rank {r.rank}: {cmd}: {r.error_type}: {r.value}")
        return [r.value for r in replies]

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(("exit", ()))
        for proc in self.processes:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
