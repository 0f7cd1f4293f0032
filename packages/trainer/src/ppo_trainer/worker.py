"""TrainWorker: one rank of the actor or the critic, as a Ray actor.

The worker owns a ``Lifecycle`` (memory backend from the config, the role's reloadable process groups)
and never sleeps or wakes on its own: the driver tells it. The two exceptions follow slime's rule for
the weight update: ``update_weights`` and ``weights_checksum`` called while asleep wake the worker,
do their work, and put it back to sleep, so the caller finds it in the state it left it in.

Every actor rank that sends owns a ``WeightSender`` (``ppo_weight_sync.SenderPlan``, from
``TrainerConfig.weight_sync_colocated`` and ``weight_sync_colocated_tp``): rank r sends to the engines on
its own GPU over CUDA IPC (for an engine of several GPUs, the rank on its TP rank 0's GPU posts and the
ranks on its other GPUs feed their TP ranks through an ``IpcExporter``, after an exchange over a gloo
subgroup of those ranks), and rank 0 also sends to every other engine over the weight group. A pre-sleep
hook disconnects it from the engines (so no communicator or shared buffer outlives the process groups and
memory it needs); the next update reconnects. While resident, the connection is kept across updates.
"""

from __future__ import annotations

import logging
import os
import random
import time
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import torch
import torch.distributed as dist

from ppo_lifecycle.lifecycle import Lifecycle, State
from ppo_lifecycle.memory import (
    HostCopies,
    HostMemoryBackend,
    MemoryBackend,
    PinnedHostBackend,
    TorchMemorySaverBackend,
    default_backend,
    enable_expandable_segments,
)
from ppo_lifecycle.process_groups import GroupHandle, ReloadableProcessGroups
from ppo_lifecycle.startup import SetupTimer
from ppo_trainer import checkpoint, fault_injection, sharded_save
from ppo_trainer.addresses import peer_address
from ppo_trainer.backend import DataParallel, TorchTrainer
from ppo_trainer.backend_protocol import CheckpointIO, TrainerBackend, make_trainer
from ppo_trainer.background_save import BackgroundSave
from ppo_trainer.batch import Samples
from ppo_trainer.config import TrainerConfig
from ppo_trainer.errors import NonFiniteWeightsError
from ppo_trainer.models import count_parameters
from ppo_value_transport import Box, Pieces, pack, pack_fields, require_values, unpack_fields, unpack_pieces
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
    checksum,
    free_port,
)

log = logging.getLogger(__name__)

_SYNC_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_memory_backend(config: TrainerConfig, device: torch.device) -> MemoryBackend:
    """The lifecycle memory backend named by ``config.memory_backend``."""
    name = config.memory_backend
    if name == "auto":
        return default_backend(device)
    if name == "host":
        return HostMemoryBackend()
    if name == "pinned":
        return PinnedHostBackend(device)
    return TorchMemorySaverBackend(device=device)


class TrainWorker:
    """One rank. Construct, then ``setup(init_method)`` on every rank at once (it rendezvouses)."""

    def __init__(self, config: TrainerConfig, rank: int, world_size: int, timeout_s: float = 600.0) -> None:
        self._setup_timer = SetupTimer()  # the start-up the driver reports (its imports ended here)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        torch.set_num_threads(config.cpu_threads)
        self.config = config
        self.role = config.role
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        if config.device == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(
                    "device='cuda' but this worker sees no CUDA device; give it a GPU or use 'cpu'"
                )
            torch.cuda.set_device(0)  # Ray narrows CUDA_VISIBLE_DEVICES to this worker's GPU
            self.device = torch.device("cuda", 0)
        else:
            self.device = torch.device("cpu")
        self._trainer: TrainerBackend | None = None
        self._lifecycle: Lifecycle | None = None
        self._memory: MemoryBackend | None = None
        self._save: BackgroundSave | None = None  # a checkpoint shard being written from host copies
        self._save_group: sharded_save.SaveGroup | None = None  # a sharded role's writers' own group
        self._groups: ReloadableProcessGroups | None = None
        self._dp: GroupHandle | None = None
        self._sender: WeightSender | None = None
        self._exporter: IpcExporter | None = None  # feeds a TP rank of an engine another rank posts
        self._tp_groups: dict[int, GroupHandle] = {}  # per colocated TP engine: its ranks' gloo channel
        self._engines: list[EngineEndpoint] = []
        self._targets: list[EngineEndpoint] = []  # the engines this rank sends to
        self._last_step: int | None = None
        self._cache_release_s = 0.0  # seconds of release_device_cache since the last pop_metrics

    # ------------------------------------------------------------------ setup
    def rendezvous_address(self) -> str:
        """``tcp://host:port`` for the role's process group (called on rank 0); the store listens on
        ``host`` only: 127.0.0.1 on a one-node cluster, else this node's address."""
        host = peer_address()
        return f"tcp://{host}:{free_port(host)}"

    def setup(self, init_method: str) -> dict[str, Any]:
        """Process group, lifecycle, model and optimizer. Collective over the role's ranks."""
        seed = self.config.seed + self.rank
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        groups = ReloadableProcessGroups()
        timer = self._setup_timer
        # No device_id: a default group bound to a device makes torch build every later NCCL group of
        # this process by ncclCommSplit of the default communicator (``_new_process_group_helper``'s
        # split_from). The weight-update group would then be a split of this role's group, a
        # communicator without the engines: rank 0 would never publish the NCCL unique id the engines
        # wait for in the store. Unbound, the default group initialises on its first collective, on
        # the device set in __init__.
        with timer.part("process_group"):
            groups.init_default(
                backend,
                init_method,
                self.world_size,
                self.rank,
                timedelta(seconds=self.timeout_s),
            )
        self._groups = groups
        self._dp = groups.default
        memory = make_memory_backend(self.config, self.device)
        if isinstance(memory, PinnedHostBackend) and self.config.backend == "torch":
            # Before the model and optimizer exist: their segments expandable, a sleep frees each
            # landed group of storages while the rest still copies (ppo_lifecycle.memory.allocator).
            # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False in the workers' environment keeps
            # ordinary segments. The megatron backend keeps them (not measured with expandable ones).
            enable_expandable_segments()
        self._memory = memory
        self._lifecycle = Lifecycle(memory, groups, name=f"{self.role}-{self.rank}")
        shard = self.config.backend == "torch" and self._should_shard()
        dp = DataParallel(
            self.rank,
            self.world_size,
            self._all_reduce if self.world_size > 1 else None,
            shard_group=self._live_dp_group if shard else None,
        )
        # train.backend picks the trainer; megatron makes its model-parallel groups through `groups`.
        t0 = time.perf_counter()
        trainer = make_trainer(self.config, dp, memory.region, groups)
        if isinstance(trainer, TorchTrainer):
            for part, seconds in trainer.setup_seconds.items():
                timer.add(part, seconds)
        else:
            timer.add("model_and_optimizer", time.perf_counter() - t0)
        self._trainer = trainer
        if shard and isinstance(memory, HostCopies) and memory.keeps_host_copies:
            # Built now, while every rank is here: the writers of an asleep sharded role gather on it.
            host = urlparse(init_method).hostname or peer_address()
            self._save_group = sharded_save.SaveGroup(
                groups.store, self.rank, self.world_size, host, self.timeout_s
            )
        with timer.part("pinned_buffers"):  # a pinned backend allocates its host buffers as it tracks
            memory.track(trainer.WEIGHTS_TAG, trainer.weight_tensors)
            memory.track(trainer.OPTIMIZER_TAG, trainer.optimizer_tensors)
        # Before the groups go: nothing gathered (FSDP) may stay outside the tracked tensors. After
        # they are rebuilt: FSDP and megatron must run on the new groups, not the destroyed ones
        # they hold (both hooks are no-ops for a replicated torch trainer).
        self._lifecycle.add_pre_sleep_hook("release_gathered_params", trainer.release_gathered)
        self._lifecycle.add_post_wake_hook("rebind_process_groups", trainer.after_groups_rebuilt)
        if self.role == "actor":
            self._lifecycle.add_pre_sleep_hook("disconnect_engines", self._disconnect)
            # One small gloo channel per colocated TP engine, among the ranks on its GPUs (every rank
            # creates every one, in the same order; rebuilt with the role's groups when it wakes).
            for entry in self.config.weight_sync_colocated_tp:
                self._tp_groups[entry[0]] = groups.new_group(
                    sorted(entry[1:]), backend="gloo", timeout=timedelta(seconds=self.timeout_s)
                )
        return {
            "rank": self.rank,
            "device": str(self.device),
            "pid": os.getpid(),
            "data_parallel": trainer.layout,
            "saves_asleep": self.saves_asleep(),
            "startup": timer.report(),
        }

    def saves_asleep(self) -> bool:
        """Whether ``save_async`` can write this rank's checkpoint from the host copies of a sleep:
        a role of the torch backend on a memory backend that keeps them (a sharded one gathers its
        shards over its save group; the megatron backend converts to Hugging Face names while resident)."""
        memory = self._memory
        return (
            self.config.backend == "torch"
            and (not self.trainer.sharded or self._save_group is not None)
            and isinstance(memory, HostCopies)
            and memory.keeps_host_copies
        )

    def memory_state(self) -> dict[str, Any]:
        """What the memory backend holds: tracked bytes per tag now, and host memory pinned so far."""
        trainer = self.trainer
        tracked = {
            trainer.WEIGHTS_TAG: trainer.weight_tensors(),
            trainer.OPTIMIZER_TAG: trainer.optimizer_tensors(),
        }
        out: dict[str, Any] = {
            f"{tag}_bytes": sum(t.untyped_storage().nbytes() for t in tensors if t.device == self.device)
            for tag, tensors in tracked.items()
        }
        out["optimizer_state_entries"] = trainer.optimizer_state_entries()
        memory = self._memory
        out["pinned_bytes"] = (
            memory.pinned_bytes if isinstance(memory, PinnedHostBackend | TorchMemorySaverBackend) else None
        )
        return out

    def _should_shard(self) -> bool:
        share = 0.0
        if self.config.data_parallel == "auto" and self.device.type == "cuda" and self.world_size > 1:
            state_bytes = 16 * count_parameters(self.config.model_path)
            share = state_bytes / torch.cuda.get_device_properties(self.device).total_memory
            # Every rank must decide alike (FSDP's collectives): the largest share counts.
            share = float(self._all_reduce(torch.tensor([share]), dist.ReduceOp.MAX))
        return self.config.shards(self.world_size, share)

    def _live_dp_group(self) -> dist.ProcessGroup:
        assert self._dp is not None  # set in setup() before the trainer is built
        return self._dp.group

    def _all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        assert self._dp is not None
        on_device = tensor.to(self.device)
        dist.all_reduce(on_device, op=op, group=self._dp.group)
        return on_device.to(tensor.device)

    @property
    def trainer(self) -> TrainerBackend:
        if self._trainer is None:
            raise RuntimeError(f"{self.role} rank {self.rank}: setup() has not run")
        return self._trainer

    @property
    def lifecycle(self) -> Lifecycle:
        if self._lifecycle is None:
            raise RuntimeError(f"{self.role} rank {self.rank}: setup() has not run")
        return self._lifecycle

    def _require_awake(self, what: str) -> None:
        if self.lifecycle.is_asleep:
            raise RuntimeError(
                f"{self.role} rank {self.rank}: {what} while asleep; the driver must wake_up() it first"
            )

    # ------------------------------------------------------------------ training
    def train(
        self, step: int, batch_box: Box, external: Pieces | None = None
    ) -> tuple[dict[str, float], Box | None]:
        """One PPO update on this rank's batch (see ``_train``)."""
        result = self._train(step, batch_box, external)
        fault_injection.after_train(self.role, step, self.trainer.weight_tensors())
        return result

    def _train(
        self, step: int, batch_box: Box, external: Pieces | None = None
    ) -> tuple[dict[str, float], Box | None]:
        """One PPO update on this rank's batch.

        Critic: returns ``(metrics, Box)``, the Box holding per sample (``pack_fields``) its pre-update
        ``values`` and the step's ``token_rewards`` (KL-shaped when ``kl_coef > 0``). Actor with the
        ``ppo`` estimator: ``external`` is this rank's share of those payloads
        (``ppo_value_transport.pair_values``), in this rank's sample order.
        """
        self._require_awake("train()")
        samples = Samples.from_fields(unpack_fields(batch_box))
        trainer = self.trainer
        self._last_step = step
        lr = trainer.set_step(step)
        if self.role == "critic":
            if external is not None:
                raise ValueError(f"critic rank {self.rank} got values to train on; values go to the actor")
            metrics, values, rewards = trainer.train_critic(samples)
            # The handoff's first half (the driver's step budget): the values into the object store.
            t0 = time.perf_counter()
            box = pack_fields({"values": samples.unpad(values), "token_rewards": samples.unpad(rewards)})
            return {**metrics, "handoff_put_s": time.perf_counter() - t0, "lr": lr}, box
        if self.config.algorithm.estimator == "ppo":
            t0 = time.perf_counter()  # the handoff's second half: the critic's values out of the store
            values, rewards = self._critic_outputs(samples, external)
            get_s = time.perf_counter() - t0
            return {**trainer.train_actor(samples, values, rewards), "handoff_get_s": get_s, "lr": lr}, None
        if external is not None:
            raise ValueError(
                f"actor rank {self.rank} got critic values but estimator='grpo' does not use them; "
                "run GRPO without a critic"
            )
        return {**trainer.train_actor(samples, None), "lr": lr}, None

    def _critic_outputs(self, samples: Samples, external: Pieces | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The critic's values and token rewards for this rank's samples, padded ``[N, R_max]``."""
        pieces = require_values(self.rank, external, role=self.role)
        if not isinstance(pieces, Pieces):
            raise ValueError(
                f"actor rank {self.rank}: critic values must come as Pieces (ppo_value_transport.pair_values "
                f"maps the critic's payloads to the actor's samples), got {type(pieces).__name__}"
            )
        fields = unpack_pieces(pieces, timeout_s=self.timeout_s)
        missing = [f for f in ("values", "token_rewards") if f not in fields]
        if missing:
            raise ValueError(f"actor rank {self.rank}: the critic's payload lacks fields {missing}")
        what = f"actor rank {self.rank}: critic"
        return (
            samples.pad_values(fields["values"], what=f"{what} values"),
            samples.pad_values(fields["token_rewards"], what=f"{what} token rewards"),
        )

    def critic_outputs(self, batch_box: Box, external: Pieces | None) -> Box:
        """What ``train`` would train this actor rank on: ``pack_fields`` of the critic's values and
        token rewards per sample, in this rank's order (the same code path; for checks and tests)."""
        if self.role != "actor":
            raise RuntimeError("critic_outputs() is the actor's")
        samples = Samples.from_fields(unpack_fields(batch_box))
        values, rewards = self._critic_outputs(samples, external)
        return pack_fields({"values": samples.unpad(values), "token_rewards": samples.unpad(rewards)})

    def compute_values(self, batch_box: Box) -> Box:
        """Critic values for a batch without training (same layout as ``train``'s values)."""
        if self.role != "critic":
            raise RuntimeError("compute_values() is the critic's")
        self._require_awake("compute_values()")
        samples = Samples.from_fields(unpack_fields(batch_box))
        return pack(samples.unpad(self.trainer.compute_values(samples)))

    def compute_log_probs(self, batch_box: Box) -> Box:
        """The actor's log-probs of each response token (one ``[R_i]`` tensor per sample)."""
        if self.role != "actor":
            raise RuntimeError("compute_log_probs() is the actor's")
        self._require_awake("compute_log_probs()")
        samples = Samples.from_fields(unpack_fields(batch_box))
        return pack(samples.unpad(self.trainer.compute_log_probs(samples)))

    # ------------------------------------------------------------------ lifecycle
    def sleep(self) -> None:
        fault_injection.before_transition(self.role, "sleep")
        if self._save is not None and not isinstance(self._memory, HostMemoryBackend):
            # The next release writes the host buffers a background save may still be reading. The
            # host backend gives every release fresh buffers: its writer reads the previous ones on
            # (host memory holds both until the files are written) and the loop does not wait.
            self._save.wait_reading(self.timeout_s)
        self.lifecycle.sleep()
        if self.device.type == "cuda":
            start = time.perf_counter()
            release_device_cache()
            self._cache_release_s += time.perf_counter() - start

    def wake_up(self) -> None:
        fault_injection.before_transition(self.role, "wake")
        self.lifecycle.wake_up()

    def is_asleep(self) -> bool:
        return self.lifecycle.is_asleep

    def pop_metrics(self) -> dict[str, float]:
        out = self.lifecycle.pop_metrics()
        if self._cache_release_s:  # after the lifecycle's sleep: torch's cache back to the GPU
            out["sleep/empty_cache/seconds"], self._cache_release_s = self._cache_release_s, 0.0
        if self._sender is not None:
            out.update({k: v for k, v in self._sender.pop_metrics().items() if v})
        if self._exporter is not None:
            out.update({k: v for k, v in self._exporter.pop_metrics().items() if v})
        return out

    def memory_info(self) -> dict[str, float]:
        """Device memory now: allocated/reserved by torch and free on the device (CUDA), bytes."""
        if self.device.type != "cuda":
            return {}
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return {
            "allocated": float(torch.cuda.memory_allocated(self.device)),
            "reserved": float(torch.cuda.memory_reserved(self.device)),
            "device_free": float(free),
            "device_total": float(total),
        }

    # ------------------------------------------------------------------ weights to the engines
    def _sync_weights(self, keep: bool) -> list[tuple[str, torch.Tensor]]:
        """The weights as sent, on a rank that sends (``keep``). Sharded, every rank must call it: each
        tensor is gathered by a collective; a rank that does not keep them drops what it gathered."""
        dtype = _SYNC_DTYPES[self.config.weight_sync_dtype]
        if self.trainer.sharded:
            gathered = self.trainer.named_weights(dtype)  # fresh tensors, not the parameters' storage
            if keep:
                return list(gathered)
            for _ in gathered:
                pass
            return []
        if not keep:
            return []
        # On CPU, hand out copies: turning a tensor into numpy (checksum, gloo transfers) pins its storage
        # for good, and the memory backend could then no longer release the parameter behind it.
        copy = self.device.type == "cpu"
        return [(name, t.to(dtype, copy=copy)) for name, t in self.trainer.named_weights()]

    def _disconnect(self) -> None:
        if self._sender is not None and self._sender.is_connected:
            self._sender.disconnect()
        if self._exporter is not None:
            self._exporter.disconnect()

    def disconnect_engines(self) -> None:
        """What the pre-sleep hook does, on its own (the driver's, before a background sleep)."""
        self._disconnect()

    def sends(self) -> RankSends:
        """What this rank sends (after ``connect_engines``): its CUDA IPC engines and, on rank 0, the
        group's, by index in the engine list."""
        return self._plan().for_rank(self.rank)

    def _plan(self) -> SenderPlan:
        return SenderPlan.from_ipc(
            self.config.weight_sync_colocated,
            len(self._engines),
            self.world_size,
            self.config.weight_sync_colocated_tp,
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

    def connect_engines(self, engines: list[EngineEndpoint]) -> None:
        """Remember the engines; a rank that sends connects to its own now if resident (else at the next
        update): the engines on its GPU over CUDA IPC, and on rank 0 every other engine over the group."""
        if self.role != "actor":
            raise RuntimeError("connect_engines() is the actor's: the critic sends no weights")
        if not engines:
            raise ValueError("connect_engines: engines is empty; pass the rollout engines' endpoints")
        self._engines = list(engines)
        try:
            plan = self._plan()
        except ValueError as exc:
            raise ValueError(f"weight_sync_colocated={self.config.weight_sync_colocated}: {exc}") from None
        mine = plan.for_rank(self.rank)
        if self.rank == 0:
            names = ", ".join(f"{i}={e.name}" for i, e in enumerate(self._engines))
            log.info(
                "weight updates (engines %s): %s",
                names,
                "; ".join(plan.describe(self.config.weight_sync_backend)) or "none",
            )
        self._targets = [self._engines[i] for i in (*mine.ipc, *mine.group)]
        if mine.exports and self._exporter is None:
            self._exporter = IpcExporter(self._tp_link(plan, mine.exports[0][0]), timeout_s=self.timeout_s)
        if self._exporter is not None and not self.lifecycle.is_asleep:
            self._exporter.connect()  # with the lead's connect (every rank runs this at once)
        if not self._targets:
            return
        if self._sender is None:
            colocated = [self._engines[i].name for i in mine.ipc]
            tp = {self._engines[i].name: self._tp_link(plan, i) for i in mine.ipc if plan.tp_engine(i)}
            self._sender = WeightSender(
                backend=self.config.weight_sync_backend,
                bucket_bytes=self.config.bucket_bytes,
                group_name=self.config.weight_sync_group,
                master_address=peer_address(),  # its store and gloo listen there only
                timeout_s=self.timeout_s,
                # Engines on this rank's GPU load over CUDA IPC (buckets sized from the model:
                # ColocatedIpc's auto_bucket_bytes); the others (rank 0's) join the group.
                transports=[ColocatedIpc(colocated, tp=tp)] if colocated else [],
            )
        if not self.lifecycle.is_asleep:
            self._sender.connect(self._targets)

    def update_weights(self, version: str) -> dict[str, float]:
        """Send the weights to the engines. Asleep: wake, reconnect, send, sleep. Resident: keep the link.

        Collective: every rank wakes and sleeps with rank 0 (the process groups are rebuilt together).
        """
        if self.role != "actor":
            raise RuntimeError("update_weights() is the actor's")
        if not self._engines:
            raise RuntimeError("update_weights() before connect_engines(): no engines to send to")
        was_asleep = self.lifecycle.is_asleep
        if was_asleep:
            self.wake_up()
        weights: list[tuple[str, torch.Tensor]] = []
        try:
            # Sharded, every rank gathers before any rank talks to the engines: were a rank to fail to
            # connect while its peers waited in a gather, they would hang until the collective timeout.
            # After the gather no collective is left: each sending rank updates its own engines.
            sender, exporter = self._sender, self._exporter
            weights = self._sync_weights(keep=sender is not None or exporter is not None)
            if exporter is not None:  # this rank feeds a TP rank of an engine another rank posts
                try:
                    exporter.update(weights, version)  # connects (with the lead) when not connected
                except NonFiniteTensorsError as exc:
                    raise NonFiniteWeightsError(self.role, self.rank, exc.names, "send") from exc
                return exporter.pop_metrics() | {"reconnected": float(was_asleep)}
            if sender is None:
                return {}
            if not sender.is_connected:
                sender.connect(self._targets)
            try:
                sender.update(weights, version)  # refuses non-finite weights before sending any
            except NonFiniteTensorsError as exc:
                raise NonFiniteWeightsError(self.role, self.rank, exc.names, "send") from exc
            return sender.pop_metrics() | {"reconnected": float(was_asleep)}
        finally:
            weights = []  # the gathered copy must not outlive the cache release of the sleep below
            if was_asleep:
                # Through self.sleep(): the sender's staging buffers, freed at disconnect, and the dtype
                # copies of the weights sit in torch's cache and must go back to the device too.
                self.sleep()

    def weights_checksum(self) -> str:
        """``ppo_weight_sync.checksum`` of the weights as sent (rank 0; others return "").

        Collective like ``update_weights``: an asleep worker wakes for it and sleeps again.
        """
        was_asleep = self.lifecycle.is_asleep
        if was_asleep:
            self.wake_up()
        weights: list[tuple[str, torch.Tensor]] = []
        try:
            weights = self._sync_weights(keep=self.rank == 0)
            return checksum(weights) if self.rank == 0 else ""
        finally:
            weights = []  # the gathered copy must not outlive the cache release of the sleep below
            if was_asleep:
                self.sleep()

    # ------------------------------------------------------------------ checkpoints
    def save(self, staging: str) -> None:
        self._require_awake("save()")
        self._finish_save()
        self._checkpoint_module().save_shard(self.trainer, Path(staging), self._last_step)

    def save_async(self, staging: str) -> dict[str, float]:
        """Start writing this rank's checkpoint into ``staging`` from the host copies of the last
        sleep, in a thread; returns at once. The worker must be asleep and ``saves_asleep()``.

        The step's state is what the sleep copied; the worker may wake and train meanwhile (its next
        sleep waits until the writer no longer reads the copies). ``save_status``/``save_wait`` report.
        """
        if self.lifecycle.state is not State.ASLEEP:
            raise RuntimeError(
                f"{self.role} rank {self.rank}: save_async() needs the worker asleep (its host copies), "
                f"it is {self.lifecycle.state.value}; use save() while resident"
            )
        if not self.saves_asleep():
            raise RuntimeError(
                f"{self.role} rank {self.rank}: save_async() needs the torch backend on a memory backend "
                "that keeps host copies (host or pinned); use save() while resident"
            )
        self._finish_save()
        start = time.perf_counter()
        memory = self._memory
        assert isinstance(memory, HostCopies)  # saves_asleep() checked it
        state: checkpoint.ShardState | sharded_save.ShardedCapture
        if self._save_group is not None:  # sharded: the writers gather the shards on their own group
            assert isinstance(self.trainer, TorchTrainer)  # saves_asleep(): the torch backend
            state = sharded_save.capture_shards(self.trainer, self._last_step, memory, self._save_group)
        else:
            state = checkpoint.capture(self.trainer, self._last_step, host=memory)
        # The pinned backends reuse their buffers at the next sleep: the writer copies them first.
        reused = not isinstance(memory, HostMemoryBackend)
        self._save = BackgroundSave(state, Path(staging), name=f"{self.role}-{self.rank}", copy_first=reused)
        return {"capture_seconds": time.perf_counter() - start, "bytes": float(state.nbytes)}

    def save_status(self) -> bool:
        """Whether the background save is finished (True when there is none); raises its error."""
        if self._save is None:
            return True
        if not self._save.done:
            return False
        self._save.result(0.0)  # raises the writer's error
        return True

    def save_wait(self) -> float:
        """Wait (at most ``timeout_s``) until the background save is on disk; its writer's seconds."""
        if self._save is None:
            return 0.0
        save, self._save = self._save, None
        return save.result(self.timeout_s)

    def _finish_save(self) -> None:
        if self._save is not None:
            self.save_wait()

    def commit(self, staging: str, final: str) -> None:
        checkpoint.commit(Path(staging), Path(final))

    def load(self, folder: str) -> int | None:
        self._require_awake("load()")
        self._finish_save()
        step = self._checkpoint_module().load_shard(self.trainer, Path(folder))
        self._last_step = step
        return step

    def _checkpoint_module(self) -> CheckpointIO:
        """The torch backend's checkpoint code, or the megatron backend's (same files, HF names)."""
        if self.config.backend == "megatron":
            from ppo_trainer import megatron_checkpoint

            return megatron_checkpoint
        return checkpoint

    def shutdown(self) -> None:
        if self._save is not None and not self._save.done:
            # The driver waits for a save it will mark complete; one left here belongs to a run that
            # failed, and its folder is never marked complete: the daemon thread ends with the process.
            log.warning("%s rank %d: shutting down during a background save", self.role, self.rank)
        if self._exporter is not None:
            self._exporter.disconnect()  # never raises
        if self._sender is not None and self._sender.is_connected:
            try:
                self._sender.disconnect()
            except Exception as exc:  # best effort on the way out
                log.warning("%s rank %d: disconnect at shutdown failed: %s", self.role, self.rank, exc)
        if self._groups is not None and self._groups.is_alive:
            self._groups.destroy()


def release_device_cache() -> None:
    """Hand torch's cached device memory back to the driver, for the other role sharing this GPU.

    Activations and gradients of the last step sit in torch's cache outside the memory backend's
    regions. cuBLAS workspaces are live allocations that ``empty_cache`` cannot free, and they pin the
    segments they sit in (measured on an H200: 0.06 GiB allocated holding 0.28 GiB reserved after a
    step); torch re-creates them on the next matmul, so they are dropped first.
    """
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # private; absent in old torch
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()
