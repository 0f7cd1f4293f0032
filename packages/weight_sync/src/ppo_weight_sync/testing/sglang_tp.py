"""The TP ranks of an SGLang stand-in server: one process per TP rank above 0, as SGLang runs them.

SGLang runs one scheduler process per TP rank; TP rank 0 takes every request from the tokenizer manager
and hands it to the other ranks (``broadcast_pyobj`` of the received requests, ``managers/scheduler.py``),
so each rank runs the same weight operation in its own process: each joins the weight group at
``rank_offset + tp_rank`` (0.5.15.post1 ``model_executor/model_runner.py`` ``init_weights_update_group``;
0.5.16 and later ``model_executor/model_runner_components/weight_updater.py``), each receives every tensor
whole and hands it to ``model.load_weights``, whose parallel layers keep their own shard (a column-parallel
weight narrows dim 0 to ``tp_rank``'s slice; a replicated one, e.g. a norm, keeps it whole). Only TP rank
0's reply goes back to the tokenizer manager, so only its reply reaches the HTTP client.

:class:`TPRanks` is that fan-out. Rank 0 is the stand-in's own :class:`~.sglang_like.SGLangReceiver`
(it holds whole tensors: it is the model that generates); ranks ``1..tp_size-1`` are
:class:`RemoteRank` processes (``multiprocessing`` spawn) that hold their shards (:func:`tp_shard`). A
rank process exits when its server process goes away (its pipe closes).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

from ppo_weight_sync.buckets import checksum, dtype_from_name
from ppo_weight_sync.ops import EngineReply, WeightOpsForwarder
from ppo_weight_sync.requests import WeightRequest
from ppo_weight_sync.testing.sglang_receiver import SchedulerCrash, SGLangReceiver

if TYPE_CHECKING:
    from ppo_weight_sync.ops import TensorOps, WeightOps

__all__ = ["RemoteRank", "SchedulerCrash", "TPRanks", "shard_checksum", "start_remote_ranks", "tp_shard"]

Spec = Mapping[str, tuple[str, Sequence[int]]]
_CHECKSUM = "checksum"  # a rank process's one message that is not an operation's request


def tp_shard(tensor: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s part of a whole tensor, as SGLang's loaders keep it: a matrix whose first
    dimension divides by ``tp_size`` is column-parallel (``ColumnParallelLinear.weight_loader`` narrows
    dim 0); anything else (norms, odd shapes) is replicated whole."""
    if tensor.dim() >= 2 and tensor.shape[0] % tp_size == 0:
        size = tensor.shape[0] // tp_size
        return tensor.narrow(0, tp_rank * size, size)
    return tensor


def shard_checksum(named: Iterable[tuple[str, torch.Tensor]], tp_rank: int, tp_size: int) -> str:
    """The checksum TP rank ``tp_rank`` reports after loading ``named`` (see :func:`tp_shard`)."""
    return checksum((n, tp_shard(t, tp_rank, tp_size)) for n, t in named)


class _ShardHolder:
    """A TP rank's model: the spec's tensors, its own shard of each; ``load`` raises as a model's
    ``load_weights`` does on a name it does not have or a shape that does not fit."""

    def __init__(self, spec: Spec, tp_rank: int, tp_size: int, device: torch.device) -> None:
        self.spec = {n: (dtype_from_name(d), tuple(int(x) for x in s)) for n, (d, s) in spec.items()}
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.held: dict[str, torch.Tensor] = {
            n: tp_shard(torch.zeros(s, dtype=d, device=device), tp_rank, tp_size).clone()
            for n, (d, s) in self.spec.items()
        }

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            if name not in self.spec:
                raise KeyError(f"{name} is not a parameter of the model")
            dtype, shape = self.spec[name]
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name}: shape {list(tensor.shape)} != {list(shape)}")
            self.held[name].copy_(tp_shard(tensor.to(dtype), self.tp_rank, self.tp_size))

    def checksum(self) -> str:
        return checksum(self.held.items())


def _rank_main(
    conn: Connection,
    spec: dict[str, Any],
    version: str,
    tp_rank: int,
    tp_size: int,
    device: str,
    timeout_s: float,
) -> None:
    """One TP rank's process: runs the weight operations it is handed, one at a time, as a scheduler."""

    torch.set_num_threads(1)
    holder = _ShardHolder(spec, tp_rank, tp_size, torch.device(device))
    receiver = SGLangReceiver(
        holder.load, torch.device(device), version=version, tp_rank=tp_rank, timeout_s=timeout_s
    )
    conn.send(("ready", tp_rank))
    while True:
        try:
            message: WeightRequest | str = conn.recv()
        except (EOFError, OSError):  # the server is gone: so is this rank, as SGLang's ranks die together
            return
        if isinstance(message, str):  # _CHECKSUM
            conn.send(("ok", holder.checksum()))
            continue
        try:
            reply = message.send_to(receiver)
        except (AssertionError, SchedulerCrash) as exc:  # raised in SGLang's scheduler: the server goes down
            conn.send(("crash", f"{type(exc).__name__}: {exc}"))
            return
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            continue
        conn.send(("ok", (reply.success, reply.message)))


class RemoteRank:
    """TP rank ``tp_rank`` in a process of its own (``multiprocessing`` spawn, so no lock is inherited
    from the server's threads); its operations run one at a time, in the order they are called."""

    def __init__(
        self,
        spec: Spec,
        *,
        version: str,
        tp_rank: int,
        tp_size: int,
        device: str = "cpu",
        timeout_s: float = 60.0,
        start_timeout_s: float = 120.0,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        plain = {n: (str(d), [int(x) for x in s]) for n, (d, s) in spec.items()}
        self.tp_rank = tp_rank
        self.process = ctx.Process(
            target=_rank_main,
            args=(child, plain, version, tp_rank, tp_size, device, timeout_s),
            name=f"sglang-tp{tp_rank}",
            daemon=True,
        )
        self.process.start()
        child.close()
        self._lock = threading.Lock()
        if not self._conn.poll(start_timeout_s):
            self.process.kill()
            raise TimeoutError(f"TP rank {tp_rank}'s process did not start within {start_timeout_s:g} s")
        self._conn.recv()

    def run(self, request: WeightRequest, timeout_s: float) -> Any:
        """Run ``request``'s operation on this rank; its answer, or :class:`~.sglang_like.SchedulerCrash`
        where SGLang's scheduler raises (the rank's process has exited)."""
        return self._ask(request, request.OP, timeout_s)

    def checksum(self, timeout_s: float) -> str:
        """The checksum of this rank's shards."""
        return str(self._ask(_CHECKSUM, "checksum", timeout_s))

    def _ask(self, message: WeightRequest | str, op: str, timeout_s: float) -> Any:
        with self._lock:
            try:
                self._conn.send(message)
                if not self._conn.poll(timeout_s):
                    raise TimeoutError(f"TP rank {self.tp_rank} did not answer {op} within {timeout_s:g} s")
                kind, value = self._conn.recv()
            except (EOFError, OSError) as exc:
                # A scheduler process that dies takes SGLang's server down with it (its launcher kills
                # the process tree): so does a rank of the stand-in.
                raise SchedulerCrash(
                    f"TP rank {self.tp_rank}'s process is gone ({type(exc).__name__})"
                ) from None
        if kind == "crash":
            raise SchedulerCrash(f"TP rank {self.tp_rank}: {value}")
        if kind == "error":
            raise RuntimeError(f"TP rank {self.tp_rank}: {value}")
        return value

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.close()
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()


class TPRanks(WeightOpsForwarder[EngineReply]):
    """A server's TP ranks: rank 0 (``local``, in this process) and ``remotes``; each weight operation
    runs on all of them at once (a group join needs every rank) and answers with rank 0's reply."""

    def __init__(
        self, local: SGLangReceiver, remotes: Sequence[RemoteRank] = (), *, timeout_s: float = 1800.0
    ) -> None:
        self.local = local
        self.remotes = list(remotes)
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max(1, len(self.remotes)), thread_name_prefix="sglang-tp")

    @property
    def tp_size(self) -> int:
        return 1 + len(self.remotes)

    @property
    def weight_version(self) -> str | None:
        return self.local.weight_version

    @weight_version.setter
    def weight_version(self, value: str | None) -> None:
        self.local.weight_version = value

    def _forward(self, request: WeightRequest) -> EngineReply:
        """The operation on every rank at once (a group join needs every rank); rank 0's reply."""
        calls = [self._pool.submit(r.run, request, self.timeout_s) for r in self.remotes]
        fatal: Exception | None = None
        try:
            reply = request.send_to(self.local)
        except (AssertionError, SchedulerCrash) as exc:
            fatal = exc
        for call in calls:
            try:
                call.result()
            except SchedulerCrash as exc:
                fatal = fatal or exc
        if fatal is not None:
            raise fatal
        return reply

    def get_weight_version(self) -> str | None:
        return self.weight_version

    def remote_checksums(self) -> list[str]:
        """The checksums of ranks 1..tp_size-1 (their shards), in rank order."""
        return [r.checksum(self.timeout_s) for r in self.remotes]

    def close(self) -> None:
        for remote in self.remotes:
            remote.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def start_remote_ranks(
    spec: Spec,
    *,
    version: str,
    tp_size: int,
    device: str,
    timeout_s: float,
    start: Callable[..., RemoteRank] = RemoteRank,
    one_device: bool = False,
) -> list[RemoteRank]:
    """Ranks ``1..tp_size-1``, started side by side (each spends its start importing torch).
    ``one_device``: every rank on ``device`` itself (a TP engine on one GPU machine, whose ranks a test
    plans as if on GPUs of their own); else rank ``i`` on the ``i``-th GPU after it, as SGLang places them."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    devices = [device if one_device else _device_of(device, i) for i in range(tp_size)]
    with ThreadPoolExecutor(max(1, tp_size - 1)) as pool:
        return list(
            pool.map(
                lambda i: start(
                    spec, version=version, tp_rank=i, tp_size=tp_size, device=devices[i], timeout_s=timeout_s
                ),
                range(1, tp_size),
            )
        )


def _device_of(device: str, tp_rank: int) -> str:
    """TP rank ``tp_rank``'s device: the CPU, or the GPU ``tp_rank`` places after the server's
    (``--base-gpu-id`` + ``tp_rank``, as SGLang places its ranks)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return str(dev)
    return f"cuda:{(dev.index or 0) + tp_rank}"


if TYPE_CHECKING:  # mypy checks that the fan-out has the weight operations' exact signatures

    def _is_weight_ops(ranks: TPRanks) -> WeightOps:
        return ranks

    def _is_tensor_ops(ranks: TPRanks) -> TensorOps:
        return ranks
