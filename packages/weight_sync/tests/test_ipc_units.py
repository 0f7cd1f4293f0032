"""CPU tests of the colocated (CUDA IPC) path: bucket layouts, wire formats, SGLang's payload, errors."""

from __future__ import annotations

import base64
import io
import json
import math
import pickle
import pickletools
import subprocess
import types

import pytest
import torch

from ppo_weight_sync import ColocatedIpc, EngineReply, HttpEngineEndpoint, WeightSender
from ppo_weight_sync.ipc import (
    ALIGN,
    PPO_IPC_FORMAT,
    BucketLayout,
    BucketPacker,
    IpcHandle,
    decode_flattened_bucket,
    decode_ipc_bucket,
    encode_flattened_bucket,
    encode_ipc_bucket,
    plan_layouts,
    tensor_request,
)
from ppo_weight_sync.ipc.receiving import IpcTensorReceiver, check_layout
from ppo_weight_sync.ipc.transport import IpcTransport
from ppo_weight_sync.requests import DestroyRequest, TensorRequest

HANDLE = IpcHandle(
    device_uuid="GPU-5c1b1f7e-0000-1111-2222-333344445555",
    handle=bytes(range(64)),
    storage_size_bytes=1 << 20,
    storage_offset_bytes=4096,
    ref_counter_handle=b"/torch_4242_1234567_0",
    ref_counter_offset=17,
    event_handle=bytes(reversed(range(64))),
    event_sync_required=True,
)

METAS = [
    ("embed", torch.bfloat16, (10, 7)),  # 140 bytes
    ("norm", torch.float32, (3,)),  # 12
    ("mask", torch.bool, (5,)),  # 5
    ("big", torch.float16, (300,)),  # 600
    ("ids", torch.int64, (2, 2)),  # 32
]


def test_plan_aligns_every_tensor_and_respects_the_bucket_size() -> None:
    layouts = plan_layouts(METAS, bucket_bytes=800)
    flat = [(n, o) for lay in layouts for n, o in zip(lay.names, lay.offsets, strict=True)]
    assert [n for n, _ in flat] == [m[0] for m in METAS]  # order kept, nothing dropped
    assert all(o % ALIGN == 0 for _, o in flat)
    assert [lay.names for lay in layouts] == [("embed", "norm", "mask"), ("big", "ids")]
    assert layouts[0].offsets == (0, 256, 512)
    assert layouts[0].nbytes == 512 + 5
    assert layouts[1].offsets == (0, 768)
    assert all(lay.nbytes <= 800 for lay in layouts)


def test_a_tensor_bigger_than_the_bucket_gets_its_own_bucket() -> None:
    layouts = plan_layouts(METAS, bucket_bytes=300)
    assert [lay.names for lay in layouts] == [("embed", "norm"), ("mask",), ("big",), ("ids",)]
    assert layouts[2].nbytes == 600
    assert plan_layouts([], bucket_bytes=100) == []


@pytest.mark.parametrize("bucket_bytes", [0, -5, 1.5])
def test_plan_rejects_a_bad_bucket_size(bucket_bytes: object) -> None:
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int"):
        plan_layouts(METAS, bucket_bytes=bucket_bytes)  # type: ignore[arg-type]


def test_views_round_trip_bytes_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        n: (torch.randn(s, generator=gen) * 100).to(d)
        if d != torch.bool
        else torch.rand(s, generator=gen) > 0.5
        for n, d, s in METAS
    }
    (layout,) = plan_layouts(METAS, bucket_bytes=1 << 20)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for tensor, offset in zip(tensors.values(), layout.offsets, strict=True):
        flat = tensor.reshape(-1).view(torch.uint8)
        buffer[offset : offset + flat.numel()].copy_(flat)
    views = dict(layout.views(buffer))
    for name, tensor in tensors.items():
        assert views[name].dtype == tensor.dtype
        assert views[name].shape == tensor.shape
        assert torch.equal(views[name], tensor)
    with pytest.raises(ValueError, match=f"buffer holds {layout.nbytes - 1} bytes"):
        layout.views(buffer[:-1])
    with pytest.raises(ValueError, match="1-D uint8"):
        layout.views(buffer.view(torch.int8))


def test_layout_wire_round_trip_and_validation() -> None:
    (layout,) = plan_layouts(METAS, bucket_bytes=1 << 20)
    wire = json.loads(json.dumps(layout.to_wire()))
    assert BucketLayout.from_wire(wire) == layout
    with pytest.raises(ValueError, match=r"missing field\(s\) \['offsets'\]"):
        BucketLayout.from_wire({k: v for k, v in wire.items() if k != "offsets"})
    with pytest.raises(ValueError, match="unknown dtype 'floaty'"):
        BucketLayout.from_wire({**wire, "dtypes": ["floaty", *wire["dtypes"][1:]]})
    with pytest.raises(ValueError, match=r"offsets\['norm'\]: 100 overlaps"):
        BucketLayout.from_wire({**wire, "offsets": [0, 100, 512, 768, 1536]})
    with pytest.raises(ValueError, match=r"offsets\['norm'\]: 258 is not a multiple of torch.float32"):
        BucketLayout.from_wire({**wire, "offsets": [0, 258, 512, 768, 1536]})
    with pytest.raises(ValueError, match="one entry per tensor"):
        BucketLayout.from_wire({**wire, "shapes": wire["shapes"][:2]})
    with pytest.raises(ValueError, match="at least one tensor"):
        BucketLayout(names=(), dtypes=(), shapes=(), offsets=())
    with pytest.raises(ValueError, match=r"shapes\['a'\]: negative dimension"):
        BucketLayout(names=("a",), dtypes=(torch.float32,), shapes=((2, -1),), offsets=(0,))


def test_handle_wire_round_trip_and_errors() -> None:
    wire = json.loads(json.dumps(HANDLE.to_wire()))
    assert IpcHandle.from_wire(wire) == HANDLE
    assert IpcHandle.from_wire(wire).key == (HANDLE.handle, 4096)
    with pytest.raises(ValueError, match=r"missing field\(s\) \['event_handle'\]"):
        IpcHandle.from_wire({k: v for k, v in wire.items() if k != "event_handle"})
    with pytest.raises(ValueError, match=r"IpcHandle\.handle: not base64"):
        IpcHandle.from_wire({**wire, "handle": "not base64!"})


def test_our_bucket_message_round_trip_and_errors() -> None:
    (layout,) = plan_layouts(METAS, bucket_bytes=1 << 20)
    entry = encode_ipc_bucket("ppo_weights-1234", HANDLE, layout)
    decoded = decode_ipc_bucket(entry)
    assert (decoded.session, decoded.handle, decoded.layout) == ("ppo_weights-1234", HANDLE, layout)
    assert len(entry) < 2000  # one small message per bucket
    with pytest.raises(ValueError, match=f"{PPO_IPC_FORMAT} entry: not JSON"):
        decode_ipc_bucket("{")
    with pytest.raises(ValueError, match="session, handle and layout"):
        decode_ipc_bucket(json.dumps({"session": "s"}))


# The globals SGLang 0.5.23's SafeUnpickler allows that this payload uses (srt/utils/common.py,
# SafeUnpickler.ALLOWED_GLOBALS), and the module prefixes 0.5.15.post1 allows (ALLOWED_MODULE_PREFIXES).
SGLANG_0_5_23_ALLOWED = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.storage", "TypedStorage"),
    ("torch", "uint8"),
    ("torch", "bfloat16"),
    ("torch", "float32"),
    ("torch", "float16"),
    ("torch", "bool"),
    ("torch", "int64"),
    ("types", "SimpleNamespace"),
}
SGLANG_0_5_15_PREFIXES = ("torch.", "types.")


def _globals_of(raw: bytes) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    strings: list[str] = []
    for op, arg, _ in pickletools.genops(raw):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(str(arg))
        elif op.name == "BINGET" or op.name == "LONG_BINGET" or op.name == "GET":
            strings.append("<memo>")
        if op.name == "STACK_GLOBAL":
            found.add((strings[-2], strings[-1]))
        if op.name == "GLOBAL":
            module, name = str(arg).split(" ")
            found.add((module, name))
    return found


def test_flattened_bucket_payload_has_sglangs_shape_and_only_allowed_globals() -> None:
    (layout,) = plan_layouts(METAS, bucket_bytes=1 << 20)
    entry = encode_flattened_bucket(HANDLE, layout)
    raw = base64.b64decode(entry, validate=True)
    assert raw[0] == 0x80  # a pickle, as SGLang's normalize_serialized_named_tensor_payload expects
    # Resolve memoised module names: record globals with a permissive unpickler that builds nothing.
    seen: list[tuple[str, str]] = []

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> object:
            seen.append((module, name))
            if name == "rebuild_cuda_tensor":
                return lambda *args: ("rebuilt", args)
            return super().find_class(module, name)

    obj = Recorder(io.BytesIO(raw)).load()
    assert set(seen) <= SGLANG_0_5_23_ALLOWED, set(seen) - SGLANG_0_5_23_ALLOWED
    assert all((m + ".").startswith(SGLANG_0_5_15_PREFIXES) for m, _ in seen)
    assert set(obj) == {"flattened_tensor", "metadata"}
    tag, args = obj["flattened_tensor"]
    assert tag == "rebuilt"
    assert len(args) == 15
    assert args[6] == HANDLE.device_uuid  # SGLang's patch: the UUID at argument 6
    assert args[7] == HANDLE.handle
    assert args[13] == HANDLE.event_handle
    assert args[14] is True
    assert args[1] == torch.Size([layout.nbytes])
    assert args[5] == torch.uint8
    # The metadata, read the way model_runner._update_weights_from_flattened_bucket reads it, gives
    # FlattenedTensorBucket.reconstruct_tensors' slices: [start_idx:end_idx].view(dtype).reshape(shape).
    metas = obj["metadata"]
    assert all(isinstance(m, types.SimpleNamespace) for m in metas)
    assert [m.name for m in metas] == [m[0] for m in METAS]
    for m, (_, dtype, shape), offset in zip(metas, METAS, layout.offsets, strict=True):
        assert m.dtype == dtype
        assert m.shape == torch.Size(shape)
        assert isinstance(m.shape, torch.Size)
        assert m.start_idx == offset
        assert m.end_idx - m.start_idx == m.numel == math.prod(shape) * dtype.itemsize


def test_flattened_bucket_decodes_back_without_mapping() -> None:
    layouts = plan_layouts(METAS, bucket_bytes=700)
    for layout in layouts:
        decoded = decode_flattened_bucket(encode_flattened_bucket(HANDLE, layout))
        assert decoded.handle == HANDLE
        assert decoded.layout == layout
        assert decoded.nbytes == layout.nbytes


def test_flattened_bucket_decoder_refuses_foreign_globals_and_garbage() -> None:
    evil = base64.b64encode(pickle.dumps({"flattened_tensor": subprocess.Popen, "metadata": []})).decode()
    with pytest.raises(ValueError, match=r"global subprocess\.Popen is not allowed"):
        decode_flattened_bucket(evil)
    with pytest.raises(ValueError, match="not base64"):
        decode_flattened_bucket("%%%")
    with pytest.raises(ValueError, match="not a valid payload"):
        decode_flattened_bucket(base64.b64encode(b"\x80\x05garbage").decode())
    not_shared = base64.b64encode(pickle.dumps({"flattened_tensor": [1], "metadata": []})).decode()
    with pytest.raises(ValueError, match="not a shared CUDA tensor"):
        decode_flattened_bucket(not_shared)


def test_tensor_request_has_sglangs_fields() -> None:
    body = tensor_request(
        ["a", "b"], load_format="flattened_bucket", flush_cache=False, weight_version="v3"
    ).to_json()
    # UpdateWeightsFromTensorReqInput (io_struct.py, 0.5.15.post1 and 0.5.23): these names, these defaults.
    assert body == {
        "serialized_named_tensors": ["a", "b"],
        "load_format": "flattened_bucket",
        "flush_cache": False,
        "abort_all_requests": False,
        "weight_version": "v3",
    }
    with pytest.raises(ValueError, match="one entry per TP rank"):
        tensor_request([], load_format="flattened_bucket", flush_cache=True, weight_version=None)


def test_packer_refuses_a_cpu_device_and_bad_sizes() -> None:
    with pytest.raises(ValueError, match="must be a CUDA device"):
        BucketPacker(torch.device("cpu"), 1 << 20, 10.0)
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int"):
        BucketPacker(torch.device("cuda", 0), 0, 10.0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        BucketPacker(torch.device("cuda", 0), 1 << 20, 0)


def _held() -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {n: (d, tuple(s)) for n, d, s in METAS}


def test_check_layout_names_the_tensor_at_fault() -> None:
    (layout,) = plan_layouts(METAS, bucket_bytes=1 << 20)
    assert check_layout(layout, _held()) is None
    assert check_layout(layout, {**_held(), "norm": (torch.float16, (3,))}) == (
        "tensor 'norm': dtype torch.float32 does not match the engine's torch.float16"
    )
    assert check_layout(layout, {**_held(), "ids": (torch.int64, (4,))}) == (
        "tensor 'ids': shape [2, 2] does not match the engine's [4]"
    )
    held = _held()
    del held["mask"]
    assert check_layout(layout, held) == "tensor 'mask' is not a weight of this engine"


def _bucket(entries: list[str], load_format: str) -> TensorRequest:
    return tensor_request(entries, load_format=load_format, flush_cache=True, weight_version=None)


def test_receiver_refuses_bad_requests_before_touching_the_gpu() -> None:
    (layout,) = plan_layouts(METAS, bucket_bytes=1 << 20)
    loaded: list[str] = []
    cpu = IpcTensorReceiver(lambda named: loaded.extend(n for n, _ in named), _held, torch.device("cpu"))
    entry = encode_ipc_bucket("s", HANDLE, layout)
    reply = cpu.update_weights_from_tensor(_bucket([entry], PPO_IPC_FORMAT))
    assert reply == EngineReply.refused("update_weights_from_tensor needs an engine on a GPU, not cpu.")
    gpu = IpcTensorReceiver(lambda named: None, _held, torch.device("cuda", 0), tp_rank=1)
    reply = gpu.update_weights_from_tensor(_bucket([entry], PPO_IPC_FORMAT))
    assert reply.success is False
    assert reply.group_lost is False
    assert "has 1 entries; TP rank 1 reads entry 1" in reply.message
    reply = gpu.update_weights_from_tensor(_bucket([entry, entry], "direct"))
    assert reply.success is False
    assert "Unsupported load_format 'direct'" in reply.message
    reply = gpu.update_weights_from_tensor(_bucket(["x", "{"], PPO_IPC_FORMAT))
    assert reply == EngineReply.refused(
        "Bad update request: ppo_ipc_bucket entry: not JSON "
        "(Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"
    )
    assert loaded == []


class _Endpoint:
    def __init__(self, name: str, num_gpus: int) -> None:
        self.name, self.num_gpus, self.load_formats = name, num_gpus, (PPO_IPC_FORMAT,)


def test_transport_refuses_colocated_engines_of_several_gpus() -> None:
    transport = IpcTransport(device=torch.device("cuda", 0), bucket_bytes=1 << 20, timeout_s=10)
    with pytest.raises(ValueError, match=r"colocated engines \['tp2 \(2 GPUs\)'\]: .*group transport"):
        transport.connect([_Endpoint("one", 1), _Endpoint("tp2", 2)], "s")  # type: ignore[list-item]
    transport.connect([_Endpoint("one", 1)], "s")  # type: ignore[list-item]
    assert transport.format_of(transport.engines[0]) == PPO_IPC_FORMAT
    assert transport.load_format == PPO_IPC_FORMAT


def test_the_factory_claims_the_named_engines_only() -> None:
    factory = ColocatedIpc(["a"], bucket_bytes=1 << 20)
    assert factory.serves(_Endpoint("a", 1))  # type: ignore[arg-type]
    assert not factory.serves(_Endpoint("b", 1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a collection of engine names, got the string 'a'"):
        ColocatedIpc("a")
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int"):
        ColocatedIpc(["a"], bucket_bytes=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="colocated engines need CUDA"):
            factory.open([_Endpoint("a", 1)], 5.0)  # type: ignore[list-item]


def test_a_sender_with_colocated_engines_needs_cuda_and_stays_disconnected() -> None:
    engines = [
        HttpEngineEndpoint("http://127.0.0.1:9", name="a"),
        HttpEngineEndpoint("http://127.0.0.1:9", name="b"),
    ]
    sender = WeightSender(timeout_s=5, transports=[ColocatedIpc(["a", "b"])])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="colocated engines need CUDA"):
            sender.connect(engines)
    assert not sender.is_connected


def test_the_http_route_carries_sglangs_request_and_the_engines_reply() -> None:
    """A real HTTP engine process (CPU): the endpoint posts SGLang's body, the route validates it, and
    the receiver's refusal comes back as an EngineReply (a CPU engine cannot map CUDA memory)."""
    from ppo_weight_sync.testing.http_engine import start_process

    spec = {n: (str(d).removeprefix("torch."), list(s)) for n, d, s in METAS}
    proc, url = start_process(spec, seed=0)
    try:
        ep = HttpEngineEndpoint(url, name="cpu-engine", timeout_s=30)
        (layout,) = plan_layouts(METAS, bucket_bytes=1 << 20)
        reply = ep.update_weights_from_tensor(
            TensorRequest(
                serialized_named_tensors=[encode_ipc_bucket("s", HANDLE, layout)],
                load_format=PPO_IPC_FORMAT,
                flush_cache=True,
                abort_all_requests=False,
                weight_version="v1",
            )
        ).result(30)
        assert reply == EngineReply.refused("update_weights_from_tensor needs an engine on a GPU, not cpu.")
        bad = ep.request("POST", "/update_weights_from_tensor", {"serialized_named_tensors": [1]})
        assert bad["object"] == "error"
        assert "serialized_named_tensors" in bad["message"]
        assert ep.request("GET", "/state")["weight_version"] is None  # nothing recorded on a refusal
        assert ep.request("GET", "/state")["ipc_mappings"] == 0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    ("total", "bucket"),
    [
        (0, 64 << 20),
        (100 << 20, 64 << 20),  # small models: the floor
        (990_000_000, 128 << 20),  # 1 GB: an eighth is 124 MB, nearest power of two 128 MiB
        (1_640_000_000, 256 << 20),  # the driver's 0.82B bf16 model
        (4_010_000_000, 512 << 20),  # 4 GB: 501 MB -> 512 MiB
        (16_060_000_000, 1 << 30),  # 16 GB: 2 GB, capped at 1 GiB
    ],
)
def test_auto_bucket_bytes_follows_the_total(total: int, bucket: int) -> None:
    from ppo_weight_sync.ipc import auto_bucket_bytes

    assert auto_bucket_bytes(total) == bucket
    if total >= 512 << 20:
        # The two buffers stay well below a copy of the model (at most about a third of it).
        assert 2 * auto_bucket_bytes(total) <= 0.36 * total


def _bump(path: str, field: str, up_to: int) -> None:
    """Another process: raise ``field`` of the signals at ``path`` one step at a time."""
    from ppo_weight_sync.ipc import BucketSignals

    signals = BucketSignals.attach(path)
    for value in range(1, up_to + 1):
        signals.set(field, value)
    signals.close()


def test_bucket_signals_cross_processes_and_every_wait_is_bounded() -> None:
    import multiprocessing
    import os

    from ppo_weight_sync.ipc import BucketSignals

    signals = BucketSignals.create()
    try:
        signals.set("packed", 3)
        signals.start()
        assert [signals.get(f) for f in ("packed", "loaded", "abort")] == [0, 0, 0]
        child = multiprocessing.get_context("spawn").Process(target=_bump, args=(signals.path, "loaded", 5))
        child.start()
        signals.wait_at_least("loaded", 5, 60.0, "the child's counter")  # written by the other process
        child.join(30)
        assert child.exitcode == 0
        assert signals.get("loaded") == 5
        with pytest.raises(TimeoutError, match=r"bucket 7 copied: not done within 0.05 s \(packed 0 < 1\)"):
            signals.wait_at_least("packed", 1, 0.05, "bucket 7 copied")

        def stop() -> None:
            raise RuntimeError("the engine answered")

        with pytest.raises(RuntimeError, match="the engine answered"):
            signals.wait_at_least("packed", 1, 60.0, "bucket 0", stop)
        with pytest.raises(ValueError, match="is not a sender's signal file"):
            BucketSignals.attach(signals.path + "-missing")
    finally:
        signals.close()
    assert not os.path.exists(signals.path)  # the sender's file is removed with it
    signals.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        signals.get("packed")


def test_one_request_per_update_message_round_trip_and_errors() -> None:
    from ppo_weight_sync.ipc import decode_ipc_stream, encode_ipc_stream

    layouts = plan_layouts(METAS, bucket_bytes=256)
    assert len(layouts) > 1
    entry = encode_ipc_stream("sess", [HANDLE, HANDLE], layouts, "/dev/shm/x")
    got = decode_ipc_stream(entry)
    assert (got.session, got.handles, got.layouts, got.signals) == (
        "sess",
        (HANDLE, HANDLE),
        tuple(layouts),
        "/dev/shm/x",
    )
    with pytest.raises(ValueError, match="two buffers' handles, got 1"):
        encode_ipc_stream("sess", [HANDLE], layouts, "p")
    with pytest.raises(ValueError, match="handles must list the two buffers"):
        decode_ipc_stream(json.dumps({"session": "s", "handles": [], "layouts": [], "signals": "p"}))
    with pytest.raises(ValueError, match="layouts must list at least one bucket"):
        decode_ipc_stream(entry.replace(json.dumps([lay.to_wire() for lay in layouts]), "[]"))
    with pytest.raises(ValueError, match="expected an object with session, handles, layouts and signals"):
        decode_ipc_stream("[]")


def test_a_one_request_update_is_refused_whole_before_any_mapping() -> None:
    from ppo_weight_sync.ipc import PPO_IPC_STREAM, encode_ipc_stream

    layouts = plan_layouts([*METAS, ("stranger", torch.float32, (4,))], bucket_bytes=256)
    loaded: list[str] = []
    gpu = IpcTensorReceiver(lambda named: loaded.extend(n for n, _ in named), _held, torch.device("cuda", 0))
    entry = encode_ipc_stream("s", [HANDLE, HANDLE], layouts, "/nonexistent")
    reply = gpu.update_weights_from_tensor(_bucket([entry], PPO_IPC_STREAM))
    assert reply == EngineReply.refused(
        f"Rejected update, nothing loaded: bucket {len(layouts) - 1}: "
        "tensor 'stranger' is not a weight of this engine"
    )
    assert loaded == []
    assert gpu.mappings.count() == 0


class _StreamEndpoint(_Endpoint):
    def __init__(self, name: str, formats: tuple[str, ...]) -> None:
        super().__init__(name, 1)
        self.load_formats = formats

    def destroy_weights_update_group(self, request: DestroyRequest) -> object:
        from ppo_weight_sync.endpoints import Done

        return Done(EngineReply.ok(f"released {request.group_name}"))


def test_the_transport_streams_only_when_every_engine_takes_it() -> None:
    import os

    from ppo_weight_sync.ipc import PPO_IPC_STREAM

    both = (PPO_IPC_FORMAT, PPO_IPC_STREAM)
    transport = IpcTransport(device=torch.device("cuda", 0), bucket_bytes=1 << 20, timeout_s=10)
    transport.connect([_StreamEndpoint("a", both), _StreamEndpoint("b", both)], "s")  # type: ignore[list-item]
    assert transport.load_format == PPO_IPC_STREAM
    paths = [s.path for s in transport._signals.values()]
    assert len(paths) == 2  # one signal file per engine
    assert all(os.path.exists(p) for p in paths)
    assert transport.release(5.0) == []
    assert not any(os.path.exists(p) for p in paths)  # removed at close
    mixed = IpcTransport(device=torch.device("cuda", 0), bucket_bytes=1 << 20, timeout_s=10)
    mixed.connect([_StreamEndpoint("a", both), _StreamEndpoint("b", (PPO_IPC_FORMAT,))], "s")  # type: ignore[list-item]
    assert mixed.load_format == PPO_IPC_FORMAT  # one engine without it: a request per bucket for both
    assert mixed._signals == {}
    off = IpcTransport(device=torch.device("cuda", 0), bucket_bytes=1 << 20, timeout_s=10, stream=False)
    off.connect([_StreamEndpoint("a", both)], "s")  # type: ignore[list-item]
    assert off.load_format == PPO_IPC_FORMAT


def test_ordinary_segments_are_left_alone_without_expandable_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    from ppo_weight_sync.ipc.segments import ordinary_segments

    getter = lambda: "max_split_size_mb:128"  # noqa: E731
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", getter, raising=False)
    with ordinary_segments(torch.device("cuda", 0)) as pool:  # no CUDA call: nothing to switch
        assert pool is None


def test_allocator_settings_come_from_the_snapshot_where_torch_has_no_getter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch 2.11 (the GPU machine's) has the setter only; its allocator snapshot carries the string
    # (read there by tests/test_ipc_gpu.py). Here the snapshot stands in: this machine has no GPU.
    from ppo_weight_sync.ipc import segments

    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings", raising=False)
    assert segments.allocator_settings() is None  # CUDA not initialised: it is not started for this
    settings = "max_split_size_mb:64,expandable_segments:True"
    snapshot = {"allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": settings}}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: snapshot)
    assert segments.allocator_settings() == settings
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: {"segments": []})
    assert segments.allocator_settings() is None  # a torch whose snapshot lacks them: cannot say
