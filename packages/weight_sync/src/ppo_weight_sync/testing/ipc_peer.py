"""A process on the same GPU that loads colocated (CUDA IPC) buckets, for tests and benchmarks.

The peer holds a set of weights (a spec, like :class:`~ppo_weight_sync.testing.TensorEngine`) and
answers commands over a ``multiprocessing`` pipe, in order: our bucket messages (``ipc``), SGLang's
``flattened_bucket`` entries (``flat``, mapped anew per call exactly as SGLang does), releases, checksums,
memory figures, and a raw double-buffered copy loop (``raw_*``) that the benchmark compares against.
:class:`IpcPeer` is the caller's side; every wait is bounded and a dead peer is named at once.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ppo_weight_sync.buckets import checksum
from ppo_weight_sync.device_sync import wait_stream
from ppo_weight_sync.errors import EngineRejectedError, EngineTimeoutError, EngineUnavailableError
from ppo_weight_sync.ipc.handles import IpcHandle, device_index, open_handle
from ppo_weight_sync.ipc.mapping import IPC_POLL_S, IpcMappings, load_bucket
from ppo_weight_sync.ipc.payload import decode_flattened_bucket, decode_ipc_bucket
from ppo_weight_sync.testing.engine import Spec, make_weights

__all__ = ["IpcPeer", "gpu_fingerprint"]


def gpu_fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list[int]]:
    """Per tensor: the sum of its 16-bit words and a position-weighted sum, computed where the tensor is
    (compares many GB of weights across processes without a host copy; a moved or changed word shows)."""
    out: dict[str, list[int]] = {}
    chunk = 32 << 20
    for name, t in named:
        words = t.detach().reshape(-1).view(torch.int16)
        plain = weighted = 0
        for start in range(0, words.numel(), chunk):
            w = words[start : start + chunk].to(torch.int64)
            pos = torch.arange(start, start + w.numel(), device=w.device, dtype=torch.int64) % 65521 + 1
            plain += int(w.sum())
            weighted += int((w * pos).sum())
        out[name] = [plain, weighted]
    return out


class _Peer:
    def __init__(self, device: str, timeout_s: float) -> None:
        self.device = torch.device(device)
        torch.cuda.set_device(self.device)
        self.timeout_s = timeout_s
        self.weights: dict[str, torch.Tensor] = {}
        self.mappings = IpcMappings()
        self.load_delay_s = 0.0
        self.raw_slots: list[torch.Tensor] = []
        self.raw_dest: torch.Tensor | None = None

    def _load(self, named: Any) -> None:
        for name, tensor in named:
            self.weights[name].copy_(tensor, non_blocking=True)
        if self.load_delay_s:
            time.sleep(self.load_delay_s)

    def spec(self, spec: Spec, seed: int | None) -> int:
        self.weights = make_weights(spec, seed, device=self.device)
        return len(self.weights)

    def ipc(self, entry: str) -> int:
        bucket = decode_ipc_bucket(entry)
        missing = [n for n in bucket.layout.names if n not in self.weights]
        if missing:
            raise KeyError(f"not a weight of this engine: {missing}")
        load_bucket(
            self.mappings,
            bucket.session,
            bucket.handle,
            bucket.layout,
            self._load,
            self.device,
            self.timeout_s,
        )
        return self.mappings.count(bucket.session)

    def flat(self, entry: str) -> int:
        # As SGLang 0.5.x: rebuild the tensor from the entry (torch's rebuild_cuda_tensor, device by
        # UUID), load FlattenedTensorBucket views of it, and drop it (the mapping goes with the storage).
        decoded = decode_flattened_bucket(entry)
        buffer = decoded.open()
        self._load(decoded.layout.views(buffer))
        wait_stream(self.device, self.timeout_s, "loading a flattened bucket", poll_s=IPC_POLL_S)
        del buffer
        return len(decoded.layout.names)

    def release(self, session: str) -> int:
        return self.mappings.release(session)

    def checksum(self) -> str:
        return checksum(self.weights.items())

    def mem(self) -> dict[str, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return {"allocated": torch.cuda.memory_allocated(self.device), "used": total - free}

    def set_load_delay(self, seconds: float) -> None:
        self.load_delay_s = seconds

    def raw_setup(self, handles: list[dict[str, Any]], dest_bytes: int) -> int:
        self.raw_slots = [open_handle(IpcHandle.from_wire(h)) for h in handles]
        self.raw_dest = torch.empty(dest_bytes, dtype=torch.uint8, device=self.device)
        return len(self.raw_slots)

    def raw_copy(self, slot: int, offset: int, nbytes: int) -> int:
        assert self.raw_dest is not None
        self.raw_dest[offset : offset + nbytes].copy_(self.raw_slots[slot][:nbytes], non_blocking=True)
        wait_stream(self.device, self.timeout_s, "raw copy", poll_s=IPC_POLL_S)
        return nbytes

    def raw_release(self) -> int:
        n = len(self.raw_slots)
        self.raw_slots, self.raw_dest = [], None
        return n

    def fingerprint(self) -> dict[str, list[int]]:
        return gpu_fingerprint(self.weights.items())

    def drop_weights(self) -> int:
        self.weights = {}
        torch.cuda.empty_cache()
        return 0


def _main(conn: multiprocessing.connection.Connection, device: str, timeout_s: float) -> None:
    peer = _Peer(device, timeout_s)
    device_index(str(torch.cuda.get_device_properties(peer.device).uuid))  # this GPU is visible
    conn.send(("ok", "ready"))
    while True:
        try:
            op, args = conn.recv()
        except EOFError:
            return
        if op == "stop":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(peer, op)(*args)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))


class IpcPeer:
    """Starts the peer process on ``device`` (spawned) and calls it; ``name`` names it in errors."""

    def __init__(self, device: str, *, name: str = "ipc-peer", timeout_s: float = 60.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.name, self.timeout_s = name, timeout_s
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_main, args=(child, device, timeout_s), daemon=True)
        self.process.start()
        child.close()
        self._receive("start", 120.0)

    def post(self, op: str, *args: Any) -> Callable[[float], Any]:
        """Send one command now; the returned waiter gives its answer (call waiters in posting order)."""
        try:
            self._conn.send((op, args))
        except (BrokenPipeError, OSError) as exc:
            raise EngineUnavailableError(self.name, op, f"the peer process is gone ({exc})") from exc
        return lambda timeout_s: self._receive(op, timeout_s)

    def call(self, op: str, *args: Any) -> Any:
        return self.post(op, *args)(self.timeout_s)

    def _receive(self, op: str, timeout_s: float) -> Any:
        try:
            if not self._conn.poll(timeout_s):
                raise EngineTimeoutError(self.name, op, timeout_s)
            status, value = self._conn.recv()
        except (EOFError, ConnectionResetError, BrokenPipeError) as exc:
            code = self.process.exitcode
            raise EngineUnavailableError(self.name, op, f"the peer process died (exit code {code})") from exc
        if status != "ok":
            raise EngineRejectedError(self.name, op, str(value))
        return value

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(EngineUnavailableError):
                self.call("stop")
        self.process.join(10)
        if self.process.is_alive():
            self.kill()
