"""TrainWorker: one rank of the actor or the critic, as a Ray actor.

The worker owns a ``Lifecycle`` (memory backend from the config, the role's reloadable process groups)
and never sleeps or wakes on its own: the driver tells it. The two exceptions follow slime's rule for
the weight update: ``update_weights`` and ``weights_checksum`` called while asleep wake the worker,
do their work, and put it back to sleep, so the caller finds it in the state it left it in.

Every actor rank publishes its weights through a ``WeightPublisher`` (``ppo_trainer.weight_publisher``:
the sender, the exporter, the colocated TP channels and the plan of who sends what). A pre-sleep hook
disconnects it from the engines (so no communicator or shared buffer outlives the process groups and
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
from ppo_trainer import fault_injection, throughput
from ppo_trainer.addresses import peer_address
from ppo_trainer.backend import TorchTrainer
from ppo_trainer.backend_protocol import DataParallel, TrainerBackend
from ppo_trainer.backends import make_trainer
from ppo_trainer.batch import Samples
from ppo_trainer.checkpoint.saves import RankCheckpoints
from ppo_trainer.config import TrainerConfig
from ppo_trainer.models import count_parameters
from ppo_trainer.shared_base import SharedBase, SharedBaseHandle, mapping_report
from ppo_trainer.weight_publisher import WeightPublisher
from ppo_value_transport import Box, Pieces, pack, pack_fields, require_values, unpack_fields, unpack_pieces
from ppo_weight_sync import EngineEndpoint, RankSends, free_port
from ppo_weight_sync.sglang_weights import rows_checksum

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
            # No CUDA context before setup (torch.cuda.set_device makes one there): the driver may
            # start this process while the engines size their GPU memory.
            self.device = torch.device("cuda", 0)  # Ray narrows CUDA_VISIBLE_DEVICES to this worker's GPU
        else:
            self.device = torch.device("cpu")
        self._trainer: TrainerBackend | None = None
        self._lifecycle: Lifecycle | None = None
        self._memory: MemoryBackend | None = None
        self._checkpoints = RankCheckpoints(config, f"{self.role}-{rank}", timeout_s)
        self._groups: ReloadableProcessGroups | None = None
        self._dp: GroupHandle | None = None
        self._publisher: WeightPublisher | None = None  # the actor's, built at setup
        self._last_step: int | None = None
        self._cost: throughput.PhaseCost | None = None  # a train call's FLOPs a token, made at the first
        self._cache_release_s = 0.0  # seconds of release_device_cache since the last pop_metrics

    # ------------------------------------------------------------------ setup
    def rendezvous_address(self) -> str:
        """``tcp://host:port`` for the role's process group (called on rank 0); the store listens on
        ``host`` only: 127.0.0.1 on a one-node cluster, else this node's address."""
        host = peer_address()
        return f"tcp://{host}:{free_port(host)}"

    def setup(
        self, init_method: str, publish_base: bool = False, base: SharedBaseHandle | None = None
    ) -> dict[str, Any]:
        """Process group, lifecycle, model and optimizer. Collective over the role's ranks.

        ``train.lora.share_base``: the actor's ranks ``publish_base`` (``shared_base_handle``), the
        critic's rank r maps actor rank r's ``base`` (``ppo_trainer.shared_base``)."""
        self._pin_device_and_seed()
        groups = self._open_process_group(init_method)
        memory, lifecycle = self._open_lifecycle(groups)
        trainer = self._build_trainer(init_method, groups, memory, publish_base, base)
        self._track(trainer, memory, lifecycle, groups)
        return {
            "rank": self.rank,
            "device": str(self.device),
            "pid": os.getpid(),
            "data_parallel": trainer.layout,
            "saves_asleep": self.saves_asleep(),
            "startup": self._setup_timer.report(),
        }

    def _pin_device_and_seed(self) -> None:
        """This process's CUDA context (on the device set in ``__init__``) and its seeds, per rank."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # this process's CUDA context starts here
        seed = self.config.seed + self.rank
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)

    def _open_process_group(self, init_method: str) -> ReloadableProcessGroups:
        """The role's default group (NCCL on CUDA, else gloo), rendezvousing at ``init_method``."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        groups = ReloadableProcessGroups()
        # No device_id: a default group bound to a device makes torch build every later NCCL group of
        # this process by ncclCommSplit of the default communicator (``_new_process_group_helper``'s
        # split_from). The weight-update group would then be a split of this role's group, a
        # communicator without the engines: rank 0 would never publish the NCCL unique id the engines
        # wait for in the store. Unbound, the default group initialises on its first collective, on
        # the device set in __init__.
        with self._setup_timer.part("process_group"):
            groups.init_default(
                backend,
                init_method,
                self.world_size,
                self.rank,
                timedelta(seconds=self.timeout_s),
            )
        self._groups = groups
        self._dp = groups.default
        return groups

    def _open_lifecycle(self, groups: ReloadableProcessGroups) -> tuple[MemoryBackend, Lifecycle]:
        """The memory backend the config names and the ``Lifecycle`` over it and ``groups``."""
        memory = make_memory_backend(self.config, self.device)
        if isinstance(memory, PinnedHostBackend) and self.config.backend == "torch":
            # Before the model and optimizer exist: their segments expandable, a sleep frees each
            # landed group of storages while the rest still copies (ppo_lifecycle.memory.allocator).
            # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False in the workers' environment keeps
            # ordinary segments. The megatron backend keeps them (not measured with expandable ones).
            enable_expandable_segments()
        self._memory = memory
        self._lifecycle = Lifecycle(memory, groups, name=f"{self.role}-{self.rank}")
        return memory, self._lifecycle

    def _build_trainer(
        self,
        init_method: str,
        groups: ReloadableProcessGroups,
        memory: MemoryBackend,
        publish_base: bool,
        base: SharedBaseHandle | None,
    ) -> TrainerBackend:
        """The backend ``train.backend`` names (FSDP2 or replicas for the torch one), its start-up
        parts timed; an asleep sharded role's save group (collective)."""
        shard = self.config.backend == "torch" and self._should_shard()
        dp = DataParallel(
            self.rank,
            self.world_size,
            self._all_reduce if self.world_size > 1 else None,
            shard_group=self._live_dp_group if shard else None,
        )
        # train.backend picks the trainer; megatron makes its model-parallel groups through `groups`.
        if (publish_base or base is not None) and self.config.backend != "torch":
            raise ValueError("train.lora.share_base needs train.backend='torch' (train.lora's backend)")
        trainer = make_trainer(self.config, dp, memory.region, groups, publish_base=publish_base, base=base)
        for part, seconds in trainer.setup_seconds.items():
            self._setup_timer.add(part, seconds)
        self._trainer = trainer
        if shard and isinstance(memory, HostCopies) and memory.keeps_host_copies:
            # Built now, while every rank is here: the writers of an asleep sharded role gather on it.
            host = urlparse(init_method).hostname or peer_address()
            self._checkpoints.open_save_group(groups.store, self.rank, self.world_size, host)
        return trainer

    def _track(
        self,
        trainer: TrainerBackend,
        memory: MemoryBackend,
        lifecycle: Lifecycle,
        groups: ReloadableProcessGroups,
    ) -> None:
        """The memory backend tracks the trainer's tensors; the lifecycle's hooks; the actor's
        weight publisher (connected at the first update)."""
        with self._setup_timer.part("pinned_buffers"):  # a pinned backend allocates host buffers now
            memory.track(trainer.WEIGHTS_TAG, trainer.weight_tensors)
            memory.track(trainer.OPTIMIZER_TAG, trainer.optimizer_tensors)
        # Before the groups go: nothing gathered (FSDP) may stay outside the tracked tensors. After
        # they are rebuilt: FSDP and megatron must run on the new groups, not the destroyed ones
        # they hold (both hooks are no-ops for a replicated torch trainer).
        lifecycle.add_pre_sleep_hook("release_gathered_params", trainer.release_gathered)
        lifecycle.add_post_wake_hook("rebind_process_groups", trainer.after_groups_rebuilt)
        if self.role == "actor":
            self._publisher = WeightPublisher.open(
                self.config, self.rank, self.world_size, groups, self.timeout_s
            )
            lifecycle.add_pre_sleep_hook("disconnect_engines", self._publisher.disconnect)

    def saves_asleep(self) -> bool:
        """Whether ``save_async`` can write this rank's checkpoint from the host copies of a sleep:
        a role of the torch backend on a memory backend that keeps them (a sharded one gathers its
        shards over its save group; the megatron backend converts to Hugging Face names while resident)."""
        return self._checkpoints.saves_asleep(self.trainer, self._memory)

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

    def _shared_base(self) -> SharedBase:
        shared = self.trainer.shared_base if isinstance(self.trainer, TorchTrainer) else None
        if shared is None:
            raise RuntimeError(f"{self.role} rank {self.rank}: no shared base (train.lora.share_base off)")
        return shared

    def shared_base_handle(self) -> SharedBaseHandle:
        """What the critic rank of this bundle maps (the actor's, after ``setup(publish_base=True)``)."""
        return self._shared_base().handle

    def base_mapped(self) -> None:
        """The critic mapped the base: remove its shared-memory file (CPU; the mappings stay), so no
        file is left behind however the processes end."""
        self._shared_base().unlink()

    def shared_base_state(self) -> dict[str, Any]:
        """The shared base as this process sees it: its bytes' SHA-256 (``digest``), ``nbytes``, and on
        CPU the mapped file's ``inode`` and this process's resident/proportional memory
        (``ppo_trainer.shared_base.mapping_report``)."""
        shared = self._shared_base()
        return {"nbytes": shared.handle.nbytes, "digest": shared.digest(), **mapping_report(shared.handle)}

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

    @property
    def publisher(self) -> WeightPublisher:
        if self._publisher is None:
            why = "setup() has not run" if self.role == "actor" else "the critic sends no weights"
            raise RuntimeError(f"{self.role} rank {self.rank}: {why}")
        return self._publisher

    def _require_awake(self, what: str) -> None:
        if self.lifecycle.is_asleep:
            raise RuntimeError(
                f"{self.role} rank {self.rank}: {what} while asleep; the driver must wake_up() it first"
            )

    # ------------------------------------------------------------------ training
    def train(
        self, step: int, batch_box: Box, external: Pieces | None = None
    ) -> tuple[dict[str, float], Box | None]:
        """One PPO update on this rank's batch (see ``_train``); its metrics add the phase's
        ``tflops``, ``tokens_per_s`` and, on CUDA, ``peak_memory_gb`` (``throughput``)."""
        self._require_awake("train()")
        samples = Samples.from_fields(unpack_fields(batch_box))
        meter = throughput.PhaseMeter(self.device)
        metrics, box = self._train(step, samples, external)
        if self._cost is None:
            self._cost = throughput.PhaseCost.for_config(self.config)
        tokens = sum(t.numel() for t in samples.tokens)
        handoff_s = metrics.get("handoff_put_s", 0.0) + metrics.get("handoff_get_s", 0.0)
        metrics = metrics | meter.metrics(self._cost.flops(tokens), tokens, excluded_s=handoff_s)
        fault_injection.after_train(self.role, step, self.trainer.weight_tensors())
        return metrics, box

    def _train(
        self, step: int, samples: Samples, external: Pieces | None = None
    ) -> tuple[dict[str, float], Box | None]:
        """One PPO update on this rank's batch.

        Critic: returns ``(metrics, Box)``, the Box holding per sample (``pack_fields``) its pre-update
        ``values`` and the step's ``token_rewards`` (KL-shaped when ``kl_coef > 0``); with
        ``off_policy_returns: vtrace``, ``external`` is this rank's share of the actor's
        ``policy_log_probs`` payloads. Actor with an estimator that ``uses_critic``: ``external`` is this
        rank's share of the critic's payloads (``ppo_value_transport.pair_values``), in this rank's
        sample order.
        """
        trainer = self.trainer
        self._last_step = step
        lr = trainer.set_step(step)
        if self.role == "critic":
            policy = self._policy_log_probs(samples, external)
            metrics, values, rewards = trainer.train_critic(samples, policy)
            # The handoff's first half (the driver's step budget): the values into the object store.
            t0 = time.perf_counter()
            box = pack_fields({"values": samples.unpad(values), "token_rewards": samples.unpad(rewards)})
            return {**metrics, "handoff_put_s": time.perf_counter() - t0, "lr": lr}, box
        alg = self.config.algorithm
        if alg.estimator_info.uses_critic:
            t0 = time.perf_counter()  # the handoff's second half: the critic's values out of the store
            values, rewards = self._critic_outputs(samples, external)
            get_s = time.perf_counter() - t0
            return {**trainer.train_actor(samples, values, rewards), "handoff_get_s": get_s, "lr": lr}, None
        if external is not None:
            raise ValueError(
                f"actor rank {self.rank} got critic values but estimator={alg.estimator!r} does not use "
                "them; run it without a critic"
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

    def _policy_log_probs(self, samples: Samples, external: Pieces | None) -> torch.Tensor | None:
        """The critic's V-trace target policy: the actor's log-probs of this rank's samples, padded
        ``[N, R_max]`` (``off_policy_returns: vtrace``; None otherwise, and nothing may come)."""
        if self.config.algorithm.off_policy_returns != "vtrace":
            if external is not None:
                raise ValueError(f"critic rank {self.rank} got values to train on; values go to the actor")
            return None
        if not isinstance(external, Pieces):
            raise ValueError(
                f"critic rank {self.rank}: algorithm.off_policy_returns=vtrace needs the actor's log-probs "
                "as Pieces (ppo_value_transport.pair_values of the actor's policy_log_probs payloads), "
                f"got {type(external).__name__}"
            )
        fields = unpack_pieces(external, timeout_s=self.timeout_s)
        if "policy_log_probs" not in fields:
            raise ValueError(f"critic rank {self.rank}: the actor's payload lacks field 'policy_log_probs'")
        what = f"critic rank {self.rank}: the actor's log-probs"
        return samples.pad_values(fields["policy_log_probs"], what=what)

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

    def policy_log_probs(self, batch_box: Box) -> Box:
        """``compute_log_probs`` as ``pack_fields({"policy_log_probs": ...})``: what a critic with
        ``off_policy_returns: vtrace`` takes (through ``ppo_value_transport.pair_values``)."""
        if self.role != "actor":
            raise RuntimeError("policy_log_probs() is the actor's")
        self._require_awake("policy_log_probs()")
        samples = Samples.from_fields(unpack_fields(batch_box))
        return pack_fields({"policy_log_probs": samples.unpad(self.trainer.compute_log_probs(samples))})

    def warm_up(self, samples: int, prompt_tokens: int, response_tokens: int) -> dict[str, float]:
        """The role's train phase once on a dummy batch of ``samples`` samples of ``prompt_tokens`` +
        ``response_tokens`` tokens, undone bit for bit (``ppo_trainer.warm_up``): the first step's
        kernels load now. Collective over the role's ranks. ``{"warm_up_s": seconds}`` (0: not warmed)."""
        from ppo_trainer.warm_up import dummy_samples, warm_up

        self._require_awake("warm_up()")
        uses_critic = self.role == "actor" and self.config.algorithm.estimator_info.uses_critic
        batch = dummy_samples(samples, prompt_tokens, response_tokens)
        seconds = warm_up(self.trainer, batch, uses_critic=uses_critic)
        return {"warm_up_s": seconds or 0.0}

    # ------------------------------------------------------------------ lifecycle
    def sleep(self) -> None:
        fault_injection.before_transition(self.role, "sleep")
        self._checkpoints.before_sleep(self._memory)
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
        if self._publisher is not None:
            out.update(self._publisher.pop_metrics())
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
    @property
    def sends_adapters(self) -> bool:
        """Whether a weight update sends the adapters alone (``train.lora.update='adapters'``)."""
        lora = self.config.lora
        return self.config.lora_applies and lora is not None and lora.update == "adapters"

    def _sync_weights(self, keep: bool, *, update: bool = False) -> list[tuple[str, torch.Tensor]]:
        """The weights as sent, on a rank that sends (``keep``). Sharded, every rank must call it: each
        tensor is gathered by a collective; a rank that does not keep them drops what it gathered.
        ``update`` with adapter-only updates: the trainable tensors alone (the engine merges them; its
        merged weights are what the other calls return, the checksum's)."""
        dtype = _SYNC_DTYPES[self.config.weight_sync_dtype]
        if update and self.sends_adapters:
            return self.trainer.trainable_weights(dtype) if keep else []
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
        if self.config.lora_applies:
            # Merged from base and adapters cast to the sync dtype first: what an engine given the adapters
            # alone computes, so merged updates, adapter-only updates and the checksum agree bit for bit.
            return [(name, t.to(dtype, copy=copy)) for name, t in self.trainer.named_weights(dtype)]
        return [(name, t.to(dtype, copy=copy)) for name, t in self.trainer.named_weights()]

    def disconnect_engines(self) -> None:
        """What the pre-sleep hook does, on its own (the driver's, before a background sleep)."""
        if self._publisher is not None:
            self._publisher.disconnect()

    def sends(self) -> RankSends:
        """What this rank sends (after ``connect_engines``): its CUDA IPC engines and, on rank 0, the
        group's, by index in the engine list."""
        return self.publisher.rank_sends()

    def connect_engines(self, engines: list[EngineEndpoint]) -> None:
        """Remember the engines; a rank that sends connects to its own now if resident (else at the next
        update): the engines on its GPU over CUDA IPC, and on rank 0 every other engine over the group."""
        if self.role != "actor":
            raise RuntimeError("connect_engines() is the actor's: the critic sends no weights")
        self.publisher.connect(engines, resident=not self.lifecycle.is_asleep)

    def update_weights(self, version: str) -> dict[str, float]:
        """Send the weights to the engines. Asleep: wake, reconnect, send, sleep. Resident: keep the link.

        Collective: every rank wakes and sleeps with rank 0 (the process groups are rebuilt together).
        """
        if self.role != "actor":
            raise RuntimeError("update_weights() is the actor's")
        publisher = self.publisher
        if not publisher.has_engines:
            raise RuntimeError("update_weights() before connect_engines(): no engines to send to")
        was_asleep = self.lifecycle.is_asleep
        if was_asleep:
            self.wake_up()
        weights: list[tuple[str, torch.Tensor]] = []
        try:
            # Sharded, every rank gathers before any rank talks to the engines: were a rank to fail to
            # connect while its peers waited in a gather, they would hang until the collective timeout.
            # After the gather no collective is left: each sending rank updates its own engines.
            weights = self._sync_weights(keep=publisher.sends_weights, update=True)
            if not publisher.sends_weights:
                return {}
            return publisher.update(weights, version) | {"reconnected": float(was_asleep)}
        finally:
            weights = []  # the gathered copy must not outlive the cache release of the sleep below
            if was_asleep:
                # Through self.sleep(): the sender's staging buffers, freed at disconnect, and the dtype
                # copies of the weights sit in torch's cache and must go back to the device too.
                self.sleep()

    def weights_checksum(self, rows: int | None = None) -> str:
        """``ppo_weight_sync.checksum`` of the weights as sent (rank 0; others return ""); ``rows``: of
        each tensor's first rows (``rollout.sglang.check_rows``, ``ppo_weight_sync.sglang_weights``).

        Collective like ``update_weights``: an asleep worker wakes for it and sleeps again.
        """
        was_asleep = self.lifecycle.is_asleep
        if was_asleep:
            self.wake_up()
        weights: list[tuple[str, torch.Tensor]] = []
        try:
            weights = self._sync_weights(keep=self.rank == 0)
            return rows_checksum(weights, rows) if self.rank == 0 else ""
        finally:
            weights = []  # the gathered copy must not outlive the cache release of the sleep below
            if was_asleep:
                self.sleep()

    # ------------------------------------------------------------------ checkpoints
    def save(self, staging: str) -> None:
        self._require_awake("save()")
        self._checkpoints.save(self.trainer, Path(staging), self._last_step)

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
        memory = self._memory
        assert isinstance(memory, HostCopies)  # saves_asleep() checked it
        return self._checkpoints.save_async(self.trainer, memory, Path(staging), self._last_step)

    def save_status(self) -> bool:
        """Whether the background save is finished (True when there is none); raises its error."""
        return self._checkpoints.done()

    def save_wait(self) -> float:
        """Wait (at most ``timeout_s``) until the background save is on disk; its writer's seconds."""
        return self._checkpoints.wait()

    def commit(self, staging: str, final: str) -> None:
        self._checkpoints.commit(Path(staging), Path(final))

    def load(self, folder: str) -> int | None:
        self._require_awake("load()")
        step = self._checkpoints.load(self.trainer, Path(folder))
        self._last_step = step
        return step

    def shutdown(self) -> None:
        if self._checkpoints.pending:
            # The driver waits for a save it will mark complete; one left here belongs to a run that
            # failed, and its folder is never marked complete: the daemon thread ends with the process.
            log.warning("%s rank %d: shutting down during a background save", self.role, self.rank)
        if self._publisher is not None:
            self._publisher.close()  # best effort on the way out
        if isinstance(self._trainer, TorchTrainer) and self._trainer.shared_base is not None:
            shared = self._trainer.shared_base
            shared.unlink()  # the owner's file, if no critic mapped it (a failed start-up)
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
