"""The sender's connection to its engines: join, teardown and one reset.

States: disconnected -> :meth:`Connection.join` -> connected -> :meth:`Connection.teardown` (graceful:
the engines destroy their side while this side destroys its own) or :meth:`Connection.reset` (after a
failure: this side's group is aborted without waiting on peers) -> disconnected. Engines that may still
hold a group of a connection that ended badly are remembered as *stale* and asked to drop it before
they join again (:meth:`Connection.drop_stale`).

The sender is rank 0 of its own group (see :mod:`ppo_weight_sync.group`); engine ``i`` of the group
joins at ``rank_offset = 1 + sum(num_gpus of the group engines before it)``. Engines claimed by a
:class:`~ppo_weight_sync.transports.TransportFactory` do not join the group.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ppo_weight_sync.endpoints import EngineEndpoint, Pending
from ppo_weight_sync.errors import (
    EngineTimeoutError,
    EngineUnavailableError,
    WeightSyncError,
    check_reply,
)
from ppo_weight_sync.group import WeightGroup
from ppo_weight_sync.net import free_port, node_address
from ppo_weight_sync.ops import EngineReply
from ppo_weight_sync.requests import DestroyRequest, InitRequest
from ppo_weight_sync.transports import (
    GroupLink,
    Transport,
    TransportFactory,
    choose_group_format,
    open_group_transport,
)

__all__ = ["Connection", "ConnectionSettings"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionSettings:
    backend: str
    group_name: str
    master_address: str | None
    timeout_s: float
    bucket_bytes: int
    load_format: str  # one of transports.LOAD_FORMATS
    device: torch.device
    factories: tuple[TransportFactory, ...] = ()


class Connection:
    """One sender's connection state. Not thread-safe: the sender calls it under its update lock."""

    def __init__(self, settings: ConnectionSettings) -> None:
        self.settings = settings
        self.group: WeightGroup | None = None
        self.group_name = ""  # the current connection's group (group_name-<random>)
        self.engines: list[EngineEndpoint] = []
        self.group_engines: list[EngineEndpoint] = []  # the engines that joined the group
        self.transports: list[Transport] = []
        self.group_transport: Transport | None = None  # the one of self.transports that uses the group
        # (engine, group name) pairs that may still hold a group from a connection that ended badly.
        self.stale: list[tuple[EngineEndpoint, str]] = []
        self.last_disconnect_errors: list[str] = []

    @property
    def is_connected(self) -> bool:
        return bool(self.transports)

    # ------------------------------------------------------------ join

    def join(self, engines: Sequence[EngineEndpoint]) -> None:
        """Connect ``engines``: the claimed ones through their factories, the rest into a fresh group."""
        s = self.settings
        claimed: dict[int, list[EngineEndpoint]] = {}
        grouped: list[EngineEndpoint] = []
        for engine in engines:
            owner = next((i for i, f in enumerate(s.factories) if f.serves(engine)), None)
            if owner is None:
                grouped.append(engine)
            else:
                claimed.setdefault(owner, []).append(engine)
        fmt = choose_group_format(s.load_format, grouped) if grouped else ""
        self.drop_stale(engines)
        transports: list[Transport] = []
        try:
            for index, members in claimed.items():
                transports.append(s.factories[index].open(members, s.timeout_s))
            if grouped:
                group, name = self._rendezvous(grouped)
                self.group, self.group_name, self.group_engines = group, name, grouped
                link = GroupLink(group, name, tuple(grouped), s.device, s.timeout_s, s.bucket_bytes)
                group_transport = open_group_transport(link, fmt)
                self.group_transport = group_transport
                transports.append(group_transport)
        except BaseException:
            for transport in transports:
                transport.close()
            raise
        self.engines = list(engines)
        self.transports = transports

    def _rendezvous(self, engines: list[EngineEndpoint]) -> tuple[WeightGroup, str]:
        s = self.settings
        address = s.master_address or node_address()
        port = free_port(address)  # the store listens on this address only (group.py)
        world_size = 1 + sum(e.num_gpus for e in engines)
        # Each connection is its own group, named group_name-<random>: a half-built group left behind
        # by a failed connection (on either side) can never collide with the next one.
        group_name = f"{s.group_name}-{uuid.uuid4().hex[:8]}"
        box: dict[str, Any] = {}
        handoff = threading.Lock()

        def join() -> None:
            try:
                group = WeightGroup(
                    master_address=address,
                    master_port=port,
                    rank=0,
                    world_size=world_size,
                    group_name=group_name,
                    backend=s.backend,
                    timeout_s=s.timeout_s,
                )
            except BaseException as exc:
                box["error"] = exc
                return
            with handoff:
                if box.get("abandoned"):
                    group.destroy(abort=True)  # connect gave up before the group formed
                else:
                    box["group"] = group

        # The engines' init calls and our own join block until every rank is in; ours runs on a side
        # thread so that an engine that fails or dies surfaces at once instead of after the timeout.
        joiner = threading.Thread(target=join, name=f"join-{s.group_name}", daemon=True)
        joiner.start()
        pending: list[tuple[EngineEndpoint, Pending[EngineReply]]] = []
        try:
            offset = 1
            for engine in engines:
                pending.append(
                    (
                        engine,
                        engine.init_weights_update_group(
                            InitRequest(
                                master_address=address,
                                master_port=port,
                                rank_offset=offset,
                                world_size=world_size,
                                group_name=group_name,
                                backend=s.backend,
                            )
                        ),
                    )
                )
                offset += engine.num_gpus
            self._await_join(engines, pending, joiner, box)
        except BaseException:
            with handoff:
                box["abandoned"] = True
                group = box.pop("group", None)
            self._reset(group, engines, group_name)
            raise
        return box["group"], group_name

    def _await_join(
        self,
        engines: list[EngineEndpoint],
        pending: list[tuple[EngineEndpoint, Pending[EngineReply]]],
        joiner: threading.Thread,
        box: dict[str, Any],
    ) -> None:
        timeout_s = self.settings.timeout_s
        deadline = time.monotonic() + timeout_s
        waiting = list(pending)
        while waiting or joiner.is_alive():
            for item in list(waiting):
                engine, call = item
                if call.done():
                    check_reply(engine.name, "init_weights_update_group", call.result(timeout_s))
                    waiting.remove(item)
            if not joiner.is_alive() and "error" in box:
                suspects = [e.name for e, _ in waiting] or [e.name for e in engines]
                raise EngineUnavailableError(
                    ", ".join(suspects),
                    "init_weights_update_group",
                    f"the group did not form: {box['error']}",
                )
            if time.monotonic() > deadline:
                suspects = [e.name for e, _ in waiting] or [e.name for e in engines]
                raise EngineTimeoutError(", ".join(suspects), "init_weights_update_group", timeout_s)
            time.sleep(0.01)

    # ------------------------------------------------------------ the one reset

    def reset(self) -> None:
        """After a broken update: drop this side's group without waiting on peers, close the transports,
        and remember the engines as stale, for the next join to clean up."""
        self._reset(self.group, self.group_engines, self.group_name)

    def _reset(self, group: WeightGroup | None, engines: Sequence[EngineEndpoint], name: str) -> None:
        self.group, self.engines, self.group_engines = None, [], []
        transports, self.transports, self.group_transport = self.transports, [], None
        for transport in transports:
            transport.close()
        if name:
            self.stale = [(e, name) for e in engines]
        if group is not None:
            group.destroy(abort=True)

    def drop_stale(self, engines: Sequence[EngineEndpoint]) -> None:
        """Ask engines that may hold a group from a connection that ended badly to drop it (best effort)."""
        wanted = {id(e) for e in engines}
        calls = []
        for engine, name in self.stale:
            if id(engine) in wanted:
                try:
                    calls.append(engine.destroy_weights_update_group(DestroyRequest(group_name=name)))
                except WeightSyncError:
                    continue
        for call in calls:
            try:
                call.result(min(self.settings.timeout_s, 30.0))
            except WeightSyncError as exc:
                log.info("dropping a stale group on an engine failed (it is replaced anyway): %s", exc)
        self.stale = []

    # ------------------------------------------------------------ teardown

    def teardown(self) -> None:
        """Engines destroy their side while this side destroys its group. Idempotent; never raises for a
        dead engine (its error goes to ``last_disconnect_errors`` and the log)."""
        group, name, grouped, engines = self.group, self.group_name, self.group_engines, self.engines
        transports, self.transports, self.group_transport = self.transports, [], None
        self.group, self.engines, self.group_engines = None, [], []
        for transport in transports:
            transport.close()
        if not transports:
            return
        errors: list[str] = []
        if group is not None:
            errors = self._destroy_group(group, name, grouped)
        if errors:
            self.stale = [(e, name) for e in engines]
            log.warning("disconnect: %s", "; ".join(errors))
        self.last_disconnect_errors = errors

    def _destroy_group(self, group: WeightGroup, name: str, engines: list[EngineEndpoint]) -> list[str]:
        timeout_s = self.settings.timeout_s
        errors: list[str] = []
        calls: list[tuple[EngineEndpoint, Pending[EngineReply]]] = []
        for engine in engines:
            try:
                calls.append((engine, engine.destroy_weights_update_group(DestroyRequest(group_name=name))))
            except WeightSyncError as exc:
                errors.append(str(exc))
        # Our side is destroyed while the engines destroy theirs, not after their answers: with NCCL the
        # destroy (ncclCommFinalize + ncclCommDestroy) waits for every rank of the node to destroy too,
        # so waiting for the engines' replies first would leave each side waiting for the other.
        destroyer = threading.Thread(target=_quietly(group.destroy), name=f"destroy-{name}", daemon=True)
        destroyer.start()
        for engine, call in calls:
            try:
                check_reply(engine.name, "destroy_weights_update_group", call.result(timeout_s))
            except WeightSyncError as exc:
                errors.append(str(exc))
        # An engine that failed to destroy its side may never do so: give ours a short grace, then abort.
        destroyer.join(min(timeout_s, 10.0) if errors else timeout_s)
        if destroyer.is_alive():
            group.abort_stuck()
            destroyer.join(min(timeout_s, 10.0))
            errors.append(
                f"destroying this sender's group {name!r} did not finish; its communicators were aborted"
            )
        return errors


def _quietly(fn: Any) -> Any:
    def run() -> None:
        try:
            fn()
        except Exception as exc:  # a side thread: log, do not crash the process's excepthook
            log.warning("destroying a weight group failed: %s", exc)

    return run
