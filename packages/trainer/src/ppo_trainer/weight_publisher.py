"""WeightPublisher: what one actor rank does to put its weights on the rollout engines.

Every actor rank has one (``TrainWorker`` builds it at setup). From the plan
(``ppo_weight_sync.SenderPlan``, from ``TrainerConfig.weight_sync_colocated`` and
``weight_sync_colocated_tp``) it knows what this rank sends: rank r sends to the engines on its own GPU
over CUDA IPC (for an engine of several GPUs, the rank on its TP rank 0's GPU posts and the ranks on its
other GPUs feed their TP ranks through an ``IpcExporter``, after an exchange over a gloo channel of
those ranks), and rank 0 also sends to every other engine over the weight group. It owns the
``WeightSender``, the ``IpcExporter``, those TP channels and the plan; the worker gathers the weights
and wakes and sleeps around an update.

``disconnect`` lets go of the engines (the worker's pre-sleep hook: no communicator or shared buffer may
outlive the process groups and memory it needs); the next ``update`` reconnects. While resident, the
connection is kept across updates.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch

from ppo_lifecycle.process_groups import GroupHandle, ReloadableProcessGroups
from ppo_trainer.addresses import peer_address
from ppo_trainer.config import TrainerConfig
from ppo_trainer.errors import NonFiniteWeightsError
from ppo_weight_sync import (
    ColocatedIpc,
    EngineEndpoint,
    GlooExchange,
    IpcExporter,
    NonFiniteTensorsError,
    RankSends,
    SenderPlan,
    TpLink,
    WeightSender,
)
from ppo_weight_sync.sglang_lora import SGLangAdapters
from ppo_weight_sync.transports import TransportFactory

__all__ = ["WeightPublisher"]

log = logging.getLogger(__name__)


class WeightPublisher:
    """One actor rank's weight updates: ``connect(engines)``, ``update(weights, version)``, ``disconnect()``,
    ``pop_metrics()``. ``tp_groups``: the gloo channel of each colocated TP engine this role has, by engine
    index (:meth:`open` makes them)."""

    def __init__(
        self,
        config: TrainerConfig,
        rank: int,
        world_size: int,
        tp_groups: Mapping[int, GroupHandle],
        timeout_s: float,
    ) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._tp_groups = dict(tp_groups)
        self._engines: list[EngineEndpoint] = []
        self._targets: list[EngineEndpoint] = []  # the engines this rank sends to
        self._sender: WeightSender | None = None
        self._exporter: IpcExporter | None = None  # feeds a TP rank of an engine another rank posts

    @classmethod
    def open(
        cls,
        config: TrainerConfig,
        rank: int,
        world_size: int,
        groups: ReloadableProcessGroups,
        timeout_s: float,
    ) -> WeightPublisher:
        """Collective over the role's ranks: one small gloo channel per colocated TP engine, among the
        ranks on its GPUs (every rank creates every one, in the same order; rebuilt with the role's groups
        when it wakes)."""
        timeout = timedelta(seconds=timeout_s)
        tp_groups = {
            entry[0]: groups.new_group(sorted(entry[1:]), backend="gloo", timeout=timeout)
            for entry in config.weight_sync_colocated_tp
        }
        return cls(config, rank, world_size, tp_groups, timeout_s)

    @property
    def has_engines(self) -> bool:
        return bool(self._engines)

    @property
    def sends_weights(self) -> bool:
        """Whether this rank sends (to its own engines, or feeding another rank's): it needs the weights."""
        return self._sender is not None or self._exporter is not None

    def plan(self) -> SenderPlan:
        return SenderPlan.from_ipc(
            self.config.weight_sync_colocated,
            len(self._engines),
            self.world_size,
            self.config.weight_sync_colocated_tp,
        )

    def rank_sends(self) -> RankSends:
        """What this rank sends: its CUDA IPC engines and, on rank 0, the group's, by engine index."""
        return self.plan().for_rank(self.rank)

    def connect(self, engines: Sequence[EngineEndpoint], *, resident: bool) -> None:
        """Remember the engines; when ``resident``, connect to this rank's own now (else at the next
        update): the engines on its GPU over CUDA IPC, and on rank 0 every other engine over the group."""
        if not engines:
            raise ValueError("connect_engines: engines is empty; pass the rollout engines' endpoints")
        self._engines = list(engines)
        try:
            plan = self.plan()
        except ValueError as exc:
            raise ValueError(f"weight_sync_colocated={self.config.weight_sync_colocated}: {exc}") from None
        mine = plan.for_rank(self.rank)
        if self.rank == 0:
            names = ", ".join(f"{i}={e.name}" for i, e in enumerate(self._engines))
            described = "; ".join(plan.describe(self.config.weight_sync_backend))
            log.info("weight updates (engines %s): %s", names, described or "none")
        self._targets = [self._engines[i] for i in (*mine.ipc, *mine.group)]
        if mine.exports and self._exporter is None:
            self._exporter = IpcExporter(self._tp_link(plan, mine.exports[0][0]), timeout_s=self.timeout_s)
        if self._exporter is not None and resident:
            self._exporter.connect()  # with the lead's connect (every rank runs this at once)
        if not self._targets:
            return
        if self._sender is None:
            self._sender = self._new_sender(plan, mine)
        if resident:
            self._sender.connect(self._targets)

    def _new_sender(self, plan: SenderPlan, mine: RankSends) -> WeightSender:
        colocated = [self._engines[i].name for i in mine.ipc]
        tp = {self._engines[i].name: self._tp_link(plan, i) for i in mine.ipc if plan.tp_engine(i)}
        factories: list[TransportFactory] = []
        lora = self.config.lora
        if self.config.lora_applies and lora is not None and lora.update == "adapters":
            # SGLang servers load the adapters as a LoRA adapter over HTTP, before any other transport
            # claims them (the built-in engines merge the adapters themselves, over the usual ones).
            factories.append(SGLangAdapters(lora.alpha))
        if colocated:
            factories.append(ColocatedIpc(colocated, tp=tp))
        return WeightSender(
            backend=self.config.weight_sync_backend,
            bucket_bytes=self.config.bucket_bytes,
            group_name=self.config.weight_sync_group,
            master_address=peer_address(),  # its store and gloo listen there only
            timeout_s=self.timeout_s,
            # Engines on this rank's GPU load over CUDA IPC (buckets sized from the model:
            # ColocatedIpc's auto_bucket_bytes); the others (rank 0's) join the group.
            transports=factories,
        )

    def _tp_link(self, plan: SenderPlan, engine: int) -> TpLink:
        """This rank's part in colocated TP engine ``engine``: its TP rank, and the channel to the others."""
        tp = plan.tp_engine(engine)
        if tp is None or self.rank not in tp.ranks:
            raise ValueError(f"rank {self.rank} has no part in a colocated TP engine {engine}")
        handle = self._tp_groups[engine]
        return TpLink(
            engine=self._engines[engine].name,
            tp_rank=tp.ranks.index(self.rank),
            tp_size=len(tp.ranks),
            exchange=GlooExchange(lambda: handle.group, self.timeout_s),  # the live group, after a wake too
        )

    def update(self, weights: Sequence[tuple[str, torch.Tensor]], version: str) -> dict[str, float]:
        """Send ``weights`` as ``version`` (reconnecting first when disconnected); this update's metrics.
        Non-finite weights are refused before any is sent (``NonFiniteWeightsError``)."""
        try:
            if self._exporter is not None:  # this rank feeds a TP rank of an engine another rank posts
                self._exporter.update(weights, version)  # connects (with the lead) when not connected
                return self._exporter.pop_metrics()
            if self._sender is None:
                return {}
            if not self._sender.is_connected:
                self._sender.connect(self._targets)
            self._sender.update(weights, version)
            return self._sender.pop_metrics()
        except NonFiniteTensorsError as exc:
            raise NonFiniteWeightsError(self.config.role, self.rank, exc.names, "send") from exc

    def disconnect(self) -> None:
        if self._sender is not None and self._sender.is_connected:
            self._sender.disconnect()
        if self._exporter is not None:
            self._exporter.disconnect()

    def close(self) -> None:
        """Disconnect on the way out: best effort, never raises."""
        if self._exporter is not None:
            self._exporter.disconnect()  # never raises
        if self._sender is not None and self._sender.is_connected:
            try:
                self._sender.disconnect()
            except Exception as exc:
                log.warning("%s rank %d: disconnect at shutdown failed: %s", self.config.role, self.rank, exc)

    def pop_metrics(self) -> dict[str, float]:
        """The sender's and the exporter's totals since the last call, the non-zero ones."""
        out: dict[str, float] = {}
        for part in (self._sender, self._exporter):
            if part is not None:
                out.update({k: v for k, v in part.pop_metrics().items() if v})
        return out
