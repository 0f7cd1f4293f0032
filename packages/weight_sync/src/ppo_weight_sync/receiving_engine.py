"""ReceivingEngine: the weight operations of an engine that receives through a :class:`WeightReceiver`.

An engine of ours (the built-in engine, the test ``TensorEngine``) answers SGLang's weight operations by
handing each request value to its receiver. Declared once here, so that the engines only set
``self.receiver`` and keep their own generation and memory operations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ppo_weight_sync.ops import EngineReply, TensorOps, WeightOps, WeightOpsForwarder
from ppo_weight_sync.receiver import WeightReceiver
from ppo_weight_sync.requests import WeightRequest

__all__ = ["ReceivingEngine"]


class ReceivingEngine(WeightOpsForwarder[EngineReply]):
    """A base class: ``init_weights_update_group``, ``update_weights_from_distributed``,
    ``update_weights_from_tensor``, ``destroy_weights_update_group`` and ``get_weight_version`` of
    :class:`~ppo_weight_sync.ops.WeightOps` / :class:`~ppo_weight_sync.ops.TensorOps`, answered by
    ``self.receiver`` (set it in ``__init__``)."""

    receiver: WeightReceiver

    def _forward(self, request: WeightRequest) -> EngineReply:
        return request.send_to(self.receiver)

    def get_weight_version(self) -> str | None:
        return self.receiver.get_weight_version()


if TYPE_CHECKING:  # mypy checks the exact signatures of the operations

    def _is_weight_ops(engine: ReceivingEngine) -> WeightOps:
        return engine

    def _is_tensor_ops(engine: ReceivingEngine) -> TensorOps:
        return engine
