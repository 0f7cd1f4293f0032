"""One TP rank of an SGLang server's weight updater, rebuilt from SGLang's source (0.5.15.post1
``model_executor/model_runner.py``; 0.5.23 ``model_executor/model_runner_components/weight_updater.py``):
the group is joined exactly as ``init_custom_process_group`` does (``ppo_weight_sync.group``, no warm-up
broadcast); nothing is checked before the data arrives; per-tensor receives are async broadcasts waited in
order, a ``flattened_bucket`` is one broadcast viewed in place (unaligned tensors refused, 0.5.23
``weight_sync/tensor_bucket.py``); the replies carry SGLang's messages.

Its own module, below both the server (``sglang_like``) and the TP fan-out (``sglang_tp``), which each
use it: neither imports the other's receiver through a circle.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from ppo_weight_sync.buckets import dtype_from_name
from ppo_weight_sync.device_sync import on_device, wait_stream
from ppo_weight_sync.group import WeightGroup
from ppo_weight_sync.ops import EngineReply, TensorOps, WeightOps
from ppo_weight_sync.requests import (
    DestroyRequest,
    InitRequest,
    TensorRequest,
    UpdateRequest,
)
from ppo_weight_sync.sglang import SGLangProtocol

__all__ = ["LoadWeights", "SGLangReceiver", "SchedulerCrash"]

log = logging.getLogger(__name__)

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], None]


class SchedulerCrash(Exception):
    """An exception SGLang raises in a scheduler process outside any ``try``: the scheduler sends SIGQUIT
    to the server, which kills its process tree (``run_scheduler_process``); no HTTP answer is sent."""


class SGLangReceiver:
    """One TP rank's weight updater, as SGLang's. ``load_weights`` raises on a tensor it cannot load."""

    def __init__(
        self,
        load_weights: LoadWeights,
        device: torch.device,
        *,
        version: str,
        tp_rank: int = 0,
        timeout_s: float = 1800.0,  # SGLang passes no timeout: torch's default_pg_timeout, 30 min
    ) -> None:
        self._load = load_weights
        self.device = torch.device(device)
        self.protocol = SGLangProtocol.for_version(version)
        # < 0.5.21: the update's assert on the group is fatal and its failures read "Failed to update
        # parameter online"; from 0.5.21 the scheduler catches both ("Failed to receive weights").
        self.legacy = self.protocol.missing_group_is_fatal
        self.tp_rank = tp_rank
        self.timeout_s = timeout_s
        self._groups: dict[str, WeightGroup] = {}
        self._lock = threading.Lock()
        # the tokenizer manager's copy in SGLang; ServerArgs.weight_version defaults to "default" (0.5.17
        # server_args.py; /model_info and /generate's meta_info answer it before any update names one)
        self.weight_version: str | None = "default"

    def init_weights_update_group(self, request: InitRequest) -> EngineReply:
        if not request.group_name:
            raise AssertionError("Group name cannot be empty")  # an assert in SGLang: a 500, not a reply
        rank = request.rank_offset + self.tp_rank
        try:
            with on_device(self.device):
                # SGLang's init_custom_process_group binds nothing (torch's defaults): joining as it does
                # also checks that our bound sender meets a group torch's helper built.
                group = WeightGroup.join(request, rank, self.timeout_s, bind=False)
        except Exception as exc:
            return EngineReply.refused(f"Failed to initialize custom process group: {exc}.")
        with self._lock:
            self._groups[request.group_name] = group
        return EngineReply.ok("Succeeded to initialize custom process group.")

    def destroy_weights_update_group(self, request: DestroyRequest) -> EngineReply:
        with self._lock:
            group = self._groups.pop(request.group_name, None)
        if group is None:
            return EngineReply.refused("The group to be destroyed does not exist.")
        try:
            group.destroy_within(min(self.timeout_s, 60.0))
        except Exception as exc:
            return EngineReply.refused(f"Failed to destroy custom process group: {exc}.")
        return EngineReply.ok("Succeeded to destroy custom process group.")

    def get_weight_version(self) -> str | None:
        return self.weight_version

    def update_weights_from_tensor(self, request: TensorRequest) -> EngineReply:
        """This TP rank's part of ``update_weights_from_tensor``: it reads entry ``tp_rank`` only (0.5.23
        ``tp_worker.deserialize_own_rank``; 0.5.15.post1 ``tp_worker.update_weights_from_tensor``). The
        read and the load run outside any ``try`` in SGLang: a list too short for this rank (IndexError),
        an entry that does not unpickle, or a load that raises takes the server down. The flush and the
        version are the server's (:class:`SGLangServerState`)."""
        from ppo_weight_sync.ipc.payload import decode_flattened_bucket

        serialized_named_tensors, load_format = request.serialized_named_tensors, request.load_format

        if self.tp_rank >= len(serialized_named_tensors):
            raise SchedulerCrash(
                f"IndexError: list index out of range (TP rank {self.tp_rank} reads "
                f"serialized_named_tensors[{self.tp_rank}] of {len(serialized_named_tensors)} entries: "
                "the list needs one entry per TP rank)"
            )
        if load_format != "flattened_bucket":
            raise SchedulerCrash(f"NotImplementedError: Unknown load_format={load_format}")
        try:
            decoded = decode_flattened_bucket(serialized_named_tensors[self.tp_rank])
        except ValueError as exc:
            raise SchedulerCrash(f"deserializing TP rank {self.tp_rank}'s entry failed: {exc}") from exc
        if self.device.type != "cuda":
            raise SchedulerCrash(f"a CUDA IPC tensor cannot be rebuilt on {self.device}")
        try:
            with on_device(self.device):
                buffer = decoded.open()
                self._load(decoded.layout.views(buffer))
                wait_stream(self.device, self.timeout_s, "loading weights")
        except Exception as exc:
            raise SchedulerCrash(f"loading TP rank {self.tp_rank}'s tensors failed: {exc}") from exc
        return EngineReply.ok("Success")

    def _receive(self, group: WeightGroup, request: UpdateRequest) -> list[tuple[str, torch.Tensor]]:
        names, dtypes, shapes = request.names, request.dtypes, request.shapes
        if request.load_format == "flattened_bucket":
            metas, offset = [], 0
            for name, dtype_text, shape in zip(names, dtypes, shapes, strict=True):
                dtype = dtype_from_name(dtype_text)
                if offset % dtype.itemsize:
                    raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
                size = int(torch.Size(shape).numel()) * dtype.itemsize
                metas.append((name, dtype, tuple(shape), offset, size))
                offset += size
            flat = torch.empty(offset, dtype=torch.uint8, device=self.device)
            group.broadcast(flat).wait()
            return [(n, flat[o : o + s].view(d).reshape(sh)) for n, d, sh, o, s in metas]
        weights, works = [], []
        for name, dtype_text, shape in zip(names, dtypes, shapes, strict=True):
            weight = torch.empty(shape, dtype=dtype_from_name(dtype_text), device=self.device)
            works.append(group.broadcast(weight))
            weights.append((name, weight))
        for work in works:
            work.wait()
        return weights

    def update_weights_from_distributed(self, request: UpdateRequest) -> EngineReply:
        group_name = request.group_name
        with self._lock:
            group = self._groups.get(group_name)
        missing = (
            f"Group {group_name} not in {list(self._groups)}. Please call `init_weights_update_group` first."
        )
        if group is None and self.legacy:
            # 0.5.15.post1: an assert outside the try, in the scheduler process: the server goes down.
            raise AssertionError(missing)
        try:
            if group is None:
                raise AssertionError(missing)
            with on_device(self.device):
                weights = self._receive(group, request)
                if not self.legacy:
                    wait_stream(self.device, self.timeout_s, "receiving weights")
        except Exception as exc:
            return self._failed(exc, "Failed to receive weights")
        try:
            with on_device(self.device):
                self._load(weights)
                wait_stream(self.device, self.timeout_s, "loading weights")
        except Exception as exc:
            return self._failed(exc, "Failed to update weights")
        if request.weight_version is not None:
            self.weight_version = request.weight_version
        return EngineReply.ok("Succeeded to update parameter online.")

    def _failed(self, exc: Exception, what: str) -> EngineReply:
        """A failed update's reply: ``what`` from 0.5.21 (the scheduler catches receive and load failures
        apart); before, one message for both."""
        if self.legacy:
            return EngineReply.refused(
                f"Failed to update parameter online: {exc}. The full weights of the ModelRunner are "
                "partially updated. Please discard the whole weights."
            )
        return EngineReply.refused(f"{what}: {exc}")


if TYPE_CHECKING:

    def _is_weight_ops(receiver: SGLangReceiver) -> WeightOps:
        return receiver

    def _is_tensor_ops(receiver: SGLangReceiver) -> TensorOps:
        return receiver
