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
)
from ppo_weight_sync.errors import (
    EngineRejectedError,
    EngineTimeoutError,
    EngineUnavailableError,
    WeightSyncError,
)
from ppo_weight_sync.lock import PROCESS_LOCK, RayUpdateLock, ThreadUpdateLock, UpdateLock
from ppo_weight_sync.receiver import WeightReceiver
from ppo_weight_sync.sender import WeightSender

__version__ = "0.1.0"

__all__ = [
    "FLATTENED_BUCKET",
    "PROCESS_LOCK",
    "RECEIVER_LOAD_FORMATS",
    "STREAM_FORMAT_PREFIX",
    "EngineEndpoint",
    "EngineRejectedError",
    "EngineTimeoutError",
    "EngineUnavailableError",
    "HttpEngineEndpoint",
    "Pending",
    "RayEngineEndpoint",
    "RayUpdateLock",
    "ThreadUpdateLock",
    "UpdateLock",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "checksum",
    "plan_buckets",
]
