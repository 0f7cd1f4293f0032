"""ReceivingEngine: the weight operations of an engine that receives through a :class:`WeightReceiver`.

An engine of ours (the built-in engine, the test ``TensorEngine``) answers SGLang's weight operations by
handing each, with the same keyword arguments, to its receiver. Declared once here, so that the engines
only set ``self.receiver`` and keep their own generation and memory operations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ppo_weight_sync.ops import EngineReply, TensorOps, WeightOps
from ppo_weight_sync.receiver import WeightReceiver

__all__ = ["ReceivingEngine"]


class ReceivingEngine:
    """A base class: ``init_weights_update_group``, ``update_weights_from_distributed``,
    ``update_weights_from_tensor``, ``destroy_weights_update_group`` and ``get_weight_version`` of
    :class:`~ppo_weight_sync.ops.WeightOps` / :class:`~ppo_weight_sync.ops.TensorOps`, answered by
    ``self.receiver`` (set it in ``__init__``)."""

    receiver: WeightReceiver

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> EngineReply:
        return self.receiver.init_weights_update_group(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )

    def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None,
        flush_cache: bool,
        load_format: str | None,
    ) -> EngineReply:
        return self.receiver.update_weights_from_distributed(
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            group_name=group_name,
            weight_version=weight_version,
            flush_cache=flush_cache,
            load_format=load_format,
        )

    def update_weights_from_tensor(
        self,
        *,
        serialized_named_tensors: list[str],
        load_format: str | None,
        flush_cache: bool,
        abort_all_requests: bool,
        weight_version: str | None,
    ) -> EngineReply:
        """One bucket of a colocated update (CUDA IPC from the trainer rank on this GPU; see
        :mod:`ppo_weight_sync.ipc`)."""
        return self.receiver.update_weights_from_tensor(
            serialized_named_tensors=serialized_named_tensors,
            load_format=load_format,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            weight_version=weight_version,
        )

    def destroy_weights_update_group(self, *, group_name: str) -> EngineReply:
        return self.receiver.destroy_weights_update_group(group_name=group_name)

    def get_weight_version(self) -> str | None:
        return self.receiver.get_weight_version()


if TYPE_CHECKING:  # mypy checks the exact signatures of the operations

    def _is_weight_ops(engine: ReceivingEngine) -> WeightOps:
        return engine

    def _is_tensor_ops(engine: ReceivingEngine) -> TensorOps:
        return engine
