"""Colocated updates over CUDA IPC: sender (this process) and engine (a peer process) on the same GPU."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from ppo_weight_sync import EngineUnavailableError, checksum
from ppo_weight_sync.ipc import (
    BucketLayout,
    BucketPacker,
    encode_ipc_bucket,
    export_flattened_bucket,
    send_buckets,
)
from ppo_weight_sync.ipc.segments import allocator_settings, set_allocator_settings
from ppo_weight_sync.testing import llama_like_spec, make_weights
from ppo_weight_sync.testing.ipc_peer import IpcPeer

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

SPEC = llama_like_spec(layers=4, hidden=256, intermediate=512, vocab=1024, dtype="bfloat16")
BUCKET = 256 << 10
MiB = 1 << 20


@pytest.fixture
def peer() -> Iterator[IpcPeer]:
    torch.cuda.set_device(0)
    p = IpcPeer("cuda:0", name="colocated-engine", timeout_s=30)
    p.call("spec", SPEC, 1)
    yield p
    p.stop()


def _sender_mem() -> dict[str, float]:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "allocated_mib": torch.cuda.memory_allocated() / MiB,
        "reserved_mib": torch.cuda.memory_reserved() / MiB,
        "gpu_used_mib": (total - free) / MiB,
    }


def _ipc_post(
    peer: IpcPeer, packer: BucketPacker, session: str, answers: list[int]
) -> Callable[[int, BucketLayout, bool], Sequence[Callable[[float], None]]]:
    def post(slot: int, layout: BucketLayout, last: bool) -> Sequence[Callable[[float], None]]:
        wait = peer.post("ipc", encode_ipc_bucket(session, packer.handle(peer.name, slot), layout))
        return [lambda timeout_s: answers.append(wait(timeout_s))]

    return post


def test_ipc_updates_are_bit_identical_and_memory_returns(peer: IpcPeer) -> None:
    device = torch.device("cuda", 0)
    packer = BucketPacker(device, BUCKET, timeout_s=30)
    before = _sender_mem()
    engine_before = peer.call("mem")
    answers: list[int] = []
    for step in range(3):
        sent = [(n, t.to(device)) for n, t in make_weights(SPEC, seed=100 + step).items()]
        layouts = packer.plan(sent)
        stats = send_buckets(packer, sent, layouts, _ipc_post(peer, packer, "s1", answers), 30.0)
        assert peer.call("checksum") == checksum(sent)
        assert stats.buckets == len(layouts) > 2  # pipelined over several buckets
        weights_mib = sum(t.numel() * t.element_size() for _, t in sent) / MiB
        del sent
    # Handles are exported once and mapped once: the engine never holds more than the two buffers.
    assert max(answers, default=0) == 2
    during = _sender_mem()
    engine_during = peer.call("mem")
    # No full extra copy on the GPU: the sender's extra memory is its two bucket buffers.
    biggest = max(lay.nbytes for lay in layouts)
    assert packer.allocated_bytes == 2 * biggest
    assert during["allocated_mib"] - before["allocated_mib"] <= 2 * biggest / MiB + 0.01
    assert peer.call("release", "s1") == 2
    assert peer.call("release", "s1") == 0  # idempotent
    packer.forget(peer.name, released=True)
    packer.free()
    torch.cuda.empty_cache()
    after = _sender_mem()
    engine_after = peer.call("mem")
    print(
        f"\nmodel {weights_mib:.1f} MiB, buckets of {biggest / MiB:.2f} MiB; sender before {before}, "
        f"during {during}, after {after}; engine before {engine_before}, during {engine_during}, "
        f"after {engine_after}"
    )
    assert after["allocated_mib"] <= before["allocated_mib"] + 0.01
    assert after["reserved_mib"] <= before["reserved_mib"] + 0.01
    # What the GPU itself reports: the buffers' memory really went back (not parked by torch's IPC counts).
    assert after["gpu_used_mib"] <= before["gpu_used_mib"] + 4
    assert engine_after["allocated"] == engine_before["allocated"]


def _largest_free_block() -> int:
    """The largest free block in any segment the caching allocator holds (0 when none)."""
    sizes = [
        block["size"]
        for segment in torch.cuda.memory_snapshot()
        for block in segment["blocks"]
        if block["state"] == "inactive"
    ]
    return max(sizes, default=0)


def test_buffers_stay_in_ordinary_segments_under_expandable_segments(peer: IpcPeer) -> None:
    # A trainer's allocator may use expandable segments (ppo-lifecycle's sleep wants them); handles of
    # those need ptrace rights to open, so the packer keeps its buffers in ordinary segments.
    # torch 2.11 has no settings getter: the packer reads them from the allocator snapshot then
    torch.cuda.init()
    previous = allocator_settings()
    assert previous is not None, "this torch's allocator settings cannot be read"
    set_allocator_settings("max_split_size_mb:512,expandable_segments:True")
    # Earlier tests in this process leave ordinary segments behind (empty_cache frees only the wholly
    # free ones): a resident tensor that fits a free block of one would be carved from it. Larger
    # than every free block, it needs a new segment, which the settings make an expandable one.
    torch.cuda.empty_cache()
    try:
        device = torch.device("cuda", 0)
        resident_bytes = max(64 * MiB, _largest_free_block() + 2 * MiB)
        resident = torch.ones(resident_bytes, dtype=torch.uint8, device=device)  # in an expandable segment
        packer = BucketPacker(device, BUCKET, timeout_s=30)
        before = _sender_mem()
        sent = [(n, t.to(device)) for n, t in make_weights(SPEC, seed=7).items()]
        layouts = packer.plan(sent)
        answers: list[int] = []
        send_buckets(packer, sent, layouts, _ipc_post(peer, packer, "s1", answers), 30.0)
        assert peer.call("checksum") == checksum(sent)
        segments = torch.cuda.memory_snapshot()

        def expandable_at(ptr: int) -> bool:
            (seg,) = [s for s in segments if s["address"] <= ptr < s["address"] + s["total_size"]]
            return bool(seg["is_expandable"])

        assert expandable_at(resident.data_ptr())
        assert not expandable_at(packer.buffer(0).data_ptr())
        assert not expandable_at(packer.buffer(1).data_ptr())
        assert peer.call("release", "s1") == 2
        packer.forget(peer.name, released=True)
        packer.free()
        del sent
        torch.cuda.empty_cache()
        after = _sender_mem()
        assert after["reserved_mib"] <= before["reserved_mib"] + 0.01  # the private pool's segments too
        assert after["gpu_used_mib"] <= before["gpu_used_mib"] + 4
        del resident
        # the packer switched expandable segments off for its buffers only, the other setting kept
        assert allocator_settings() == "max_split_size_mb:512,expandable_segments:True"
    finally:
        set_allocator_settings(previous if "expandable_segments" in previous else "expandable_segments:False")


def test_sglang_flattened_bucket_payload_loads_bit_identical(peer: IpcPeer) -> None:
    """The peer reads SGLang's payload the way SGLang 0.5.x does (torch's rebuild, device by UUID,
    FlattenedTensorBucket views) and drops each mapping after the call, as SGLang's model runner does."""
    device = torch.device("cuda", 0)
    packer = BucketPacker(device, BUCKET, timeout_s=30)
    before = _sender_mem()
    answers: list[int] = []
    for step in range(2):
        sent = [(n, t.to(device)) for n, t in make_weights(SPEC, seed=300 + step).items()]

        def post(slot: int, layout: BucketLayout, last: bool) -> Sequence[Callable[[float], None]]:
            wait = peer.post("flat", export_flattened_bucket(packer.buffer(slot), layout))
            return [lambda timeout_s: answers.append(wait(timeout_s))]

        send_buckets(packer, sent, packer.plan(sent), post, 30.0)
        assert peer.call("checksum") == checksum(sent)
        del sent
    packer.free()
    torch.cuda.empty_cache()
    after = _sender_mem()
    assert after["allocated_mib"] <= before["allocated_mib"] + 0.01


def test_an_engine_killed_mid_update_is_named_within_the_timeout(peer: IpcPeer) -> None:
    device = torch.device("cuda", 0)
    gc.collect()  # what earlier tests of this process left for the collector is not this test's
    base = torch.cuda.memory_allocated()
    packer = BucketPacker(device, 64 << 10, timeout_s=20)
    sent = [(n, t.to(device)) for n, t in make_weights(SPEC, seed=5).items()]
    layouts = packer.plan(sent)
    assert len(layouts) > 10
    peer.call("set_load_delay", 0.3)
    killer = threading.Timer(1.0, peer.kill)
    killer.start()
    start = time.monotonic()
    with pytest.raises(EngineUnavailableError, match=r"colocated-engine.*died"):
        send_buckets(packer, sent, layouts, _ipc_post(peer, packer, "s2", []), 20.0)
    killer.join()
    assert time.monotonic() - start < 20
    # The dead peer never dropped its counts of the sender's buffers: the sender drops them on its behalf,
    # then its memory returns.
    packer.forget(peer.name, released=False)
    packer.free()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() - base == sum(t.numel() * t.element_size() for _, t in sent)


def test_an_sglang_engine_of_two_tp_ranks_gets_one_entry_per_rank() -> None:
    """SGLang's TP rank i reads serialized_named_tensors[i] only (0.5.23 tp_worker.deserialize_own_rank):
    the body carries one entry per rank, each its own export of the bucket's buffer."""
    from dataclasses import dataclass

    from ppo_weight_sync.ipc import IpcTransport, decode_flattened_bucket

    @dataclass
    class Wide:
        name: str = "tp2"
        num_gpus: int = 2
        load_formats: tuple[str, ...] = ("flattened_bucket",)

    device = torch.device("cuda", 0)
    weights = make_weights(SPEC, seed=3, device=device)
    transport = IpcTransport(device=device, bucket_bytes=BUCKET, timeout_s=30)
    layouts = transport.packer.plan(list(weights.items()))
    assert transport.packer.reserve(layouts)
    entries = transport._serialized(Wide(), "flattened_bucket", 0, 0, layouts[0])  # type: ignore[arg-type]
    assert len(entries) == 2
    decoded = [decode_flattened_bucket(e) for e in entries]
    assert decoded[0].layout == decoded[1].layout == layouts[0]
    transport.packer.free()
