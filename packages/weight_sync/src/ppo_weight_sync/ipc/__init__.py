"""Colocated weight updates over CUDA IPC: the sender packs buckets into two reusable GPU buffers that
an engine process on the same GPU maps once and copies from (see :mod:`.packer`, :mod:`.mapping`,
:mod:`.payload` for SGLang's ``update_weights_from_tensor`` body). Importing this needs torch only;
the functions that touch handles need CUDA."""

from ppo_weight_sync.ipc.handles import IpcHandle, device_index, device_uuid, export_buffer, open_handle
from ppo_weight_sync.ipc.layout import ALIGN, BucketLayout, plan_layouts
from ppo_weight_sync.ipc.mapping import IpcMappings, load_bucket
from ppo_weight_sync.ipc.packer import (
    BucketPacker,
    PipelineStats,
    auto_bucket_bytes,
    pack_first,
    send_buckets,
)
from ppo_weight_sync.ipc.payload import (
    PPO_IPC_FORMAT,
    PPO_IPC_STREAM,
    FlattenedBucket,
    IpcBucket,
    IpcStream,
    decode_flattened_bucket,
    decode_ipc_bucket,
    decode_ipc_stream,
    encode_flattened_bucket,
    encode_ipc_bucket,
    encode_ipc_stream,
    export_flattened_bucket,
    tensor_request,
)
from ppo_weight_sync.ipc.signals import BucketSignals
from ppo_weight_sync.ipc.transport import ColocatedIpc, IpcTransport

__all__ = [
    "ALIGN",
    "PPO_IPC_FORMAT",
    "PPO_IPC_STREAM",
    "BucketLayout",
    "BucketPacker",
    "BucketSignals",
    "ColocatedIpc",
    "FlattenedBucket",
    "IpcBucket",
    "IpcHandle",
    "IpcMappings",
    "IpcStream",
    "IpcTransport",
    "PipelineStats",
    "auto_bucket_bytes",
    "decode_flattened_bucket",
    "decode_ipc_bucket",
    "decode_ipc_stream",
    "device_index",
    "device_uuid",
    "encode_flattened_bucket",
    "encode_ipc_bucket",
    "encode_ipc_stream",
    "export_buffer",
    "export_flattened_bucket",
    "load_bucket",
    "open_handle",
    "pack_first",
    "plan_layouts",
    "send_buckets",
    "tensor_request",
]
