"""Trainer-to-inference-engine weight updates over a dedicated process group, compatible with SGLang's
HTTP API. Depends on torch alone; ``RayEngineEndpoint`` and ``RayUpdateLock`` need the ``ray`` extra
(imported only when used)."""

from ppo_weight_sync.buckets import FLATTENED_BUCKET, STREAM_FORMAT_PREFIX, checksum, plan_buckets
from ppo_weight_sync.endpoints import (
    RECEIVER_LOAD_FORMATS,
    EngineEndpoint,
    HttpEngineEndpoint,
    Pending,
    RayEngineEndpoint,
    reply_from_http,
)
from ppo_weight_sync.errors import (
    EngineRejectedError,
    EngineTimeoutError,
    EngineUnavailableError,
    NonFiniteTensorsError,
    WeightSyncError,
    check_reply,
)
from ppo_weight_sync.finite import non_finite_names
from ppo_weight_sync.ipc.exchange import ExchangeError, GlooExchange, RankExchange
from ppo_weight_sync.ipc.tp import IpcExporter, TpLink
from ppo_weight_sync.ipc.transport import ColocatedIpc
from ppo_weight_sync.lock import PROCESS_LOCK, RayUpdateLock, ThreadUpdateLock, UpdateLock
from ppo_weight_sync.net import free_port, node_address
from ppo_weight_sync.ops import EngineOps, EngineReply, TensorOps, WeightOps
from ppo_weight_sync.plan import RankSends, SenderPlan, TpIpc, plan_senders
from ppo_weight_sync.receiver import WeightReceiver
from ppo_weight_sync.receiving_engine import ReceivingEngine
from ppo_weight_sync.requests import DestroyRequest, InitRequest, TensorRequest, UpdateRequest, WeightRequest
from ppo_weight_sync.sender import WeightSender
from ppo_weight_sync.transports import Sent, Transport, TransportFactory

__version__ = "0.4.3"

__all__ = [
    "FLATTENED_BUCKET",
    "PROCESS_LOCK",
    "RECEIVER_LOAD_FORMATS",
    "STREAM_FORMAT_PREFIX",
    "ColocatedIpc",
    "DestroyRequest",
    "EngineEndpoint",
    "EngineOps",
    "EngineRejectedError",
    "EngineReply",
    "EngineTimeoutError",
    "EngineUnavailableError",
    "ExchangeError",
    "GlooExchange",
    "HttpEngineEndpoint",
    "InitRequest",
    "IpcExporter",
    "NonFiniteTensorsError",
    "Pending",
    "RankExchange",
    "RankSends",
    "RayEngineEndpoint",
    "RayUpdateLock",
    "ReceivingEngine",
    "SenderPlan",
    "Sent",
    "TensorOps",
    "TensorRequest",
    "ThreadUpdateLock",
    "TpIpc",
    "TpLink",
    "Transport",
    "TransportFactory",
    "UpdateLock",
    "UpdateRequest",
    "WeightOps",
    "WeightReceiver",
    "WeightRequest",
    "WeightSender",
    "WeightSyncError",
    "check_reply",
    "checksum",
    "free_port",
    "node_address",
    "non_finite_names",
    "plan_buckets",
    "plan_senders",
    "reply_from_http",
]
