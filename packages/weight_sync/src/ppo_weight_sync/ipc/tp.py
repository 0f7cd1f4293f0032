"""Colocated engines of several GPUs (tensor parallel) over CUDA IPC: one request, one entry per TP rank.

An engine of TP *T* reads entry *i* of ``serialized_named_tensors`` on its TP rank *i* (SGLang: 0.5.23
``tp_worker.deserialize_own_rank``), and TP rank *i* runs on GPU *g_i*, where trainer rank *r_i* holds the
full weights too (:mod:`ppo_weight_sync.plan`). So every *r_i* packs the weights into its own two GPU
buffers, and entry *i* names *r_i*'s buffer: each TP rank maps memory of its own GPU, and no byte crosses
GPUs. The lead *r_0* posts the engine's requests (pause, flush, one request per bucket, continue: its
:class:`~ppo_weight_sync.WeightSender`); ranks *r_1..* run an :class:`IpcExporter` and never call the
engine. As slime gathers handles per engine before its rank 0 posts, but cheaper:

- **once per connection**, over a small gloo channel (:mod:`.exchange`): the lead tells the others its
  session and wire format; each other rank tells the lead the path of its :class:`PeerBoard`;
- **per bucket**, through that board (a small file in ``/dev/shm``, mapped by both: colocated ranks share
  a host): the exporter packs bucket *k* into buffer ``k % 2``, puts the handle the engine's TP rank maps
  into the board's slot ``k % 2`` and raises ``packed``; the lead, once its own bucket *k* is packed,
  waits for every exporter's ``packed > k``, builds the entries and posts; once the engine answered
  bucket *k* (every TP rank copied it out), it raises every board's ``loaded``, and the exporter packs
  that buffer again. Our ``ppo_ipc_bucket`` format names the exporter's cached export (mapped once per
  connection by the TP rank); SGLang's ``flattened_bucket`` a fresh export per bucket (SGLang unmaps after
  every call, and torch counts one consumer per export).

Both sides count updates per connection (``epoch``): the lead reads a board only once the exporter has
started the same update, so nothing left in a board by the previous update is ever read. A failure on
either side raises ``abort`` in the board(s); the other side stops waiting at once and both reconnect
at the next update (an exporter that finds ``abort`` raised when its update starts reconnects first, and
a lead whose exporter reset finds its board gone and reconnects), so the once-per-connection exchange
always pairs up. At disconnect the lead raises ``released`` once the engine unmapped the session, and
the exporter frees its buffers after that (bounded), so its memory really returns.
The one-request format (``ppo_ipc_stream``) is not used for TP engines: they get a request per bucket.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ppo_weight_sync.buckets import FLATTENED_BUCKET
from ppo_weight_sync.errors import EngineUnavailableError, NonFiniteTensorsError, WeightSyncError
from ppo_weight_sync.finite import non_finite_names
from ppo_weight_sync.ipc.counters import SharedCounters
from ppo_weight_sync.ipc.exchange import ExchangeError, RankExchange
from ppo_weight_sync.ipc.handles import IpcHandle, export_buffer
from ppo_weight_sync.ipc.layout import BucketLayout
from ppo_weight_sync.ipc.packer import MAX_AUTO_BUCKET, BucketPacker, auto_bucket_bytes, split_tensors
from ppo_weight_sync.ipc.payload import PPO_IPC_FORMAT, encode_flattened_bucket, encode_ipc_bucket

__all__ = ["TP_FORMATS", "IpcExporter", "PeerBoard", "TpLead", "TpLink"]

log = logging.getLogger(__name__)

TP_FORMATS = (PPO_IPC_FORMAT, FLATTENED_BUCKET)

_SLOT = 4096  # 8 bytes of length, then the JSON of one handle (about 400 bytes)


class PeerBoard(SharedCounters):
    """The shared file between a lead and one exporting rank (see the module docstring): its counters,
    then two slots of one handle each. Each counter has one writer (``epoch``, ``packed``, the slots:
    the exporter; ``loaded``, ``released``: the lead; ``abort``: either)."""

    FIELDS = ("epoch", "packed", "loaded", "abort", "released")
    PREFIX = "ppo-ipc-tp"
    LABEL = "an exporting rank's board"
    EXTRA_BYTES = 2 * _SLOT

    def put(self, slot: int, text: str) -> None:
        data = text.encode()
        if len(data) > _SLOT - 8:
            raise ValueError(f"a board slot holds {_SLOT - 8} bytes, the entry has {len(data)}")
        # The text first, then its length: a reader that sees the new length sees the whole text.
        self.write(slot * _SLOT + 8, data)
        self.write(slot * _SLOT, len(data).to_bytes(8, "little"))

    def take(self, slot: int) -> str:
        n = int.from_bytes(self.read(slot * _SLOT, 8), "little")
        return self.read(slot * _SLOT + 8, min(n, _SLOT - 8)).decode()

    def wait(self, field: str, value: int, timeout_s: float, what: str, check: Callable[[], None]) -> None:
        """Block until ``field >= value`` (polling; ``check`` runs between polls and raises to stop);
        TimeoutError saying ``what`` after ``timeout_s``."""
        self.wait_at_least(field, value, timeout_s, what, check)


@dataclass(frozen=True)
class TpLink:
    """This rank's part in colocated engine ``engine`` (by name) of ``tp_size`` TP ranks: it feeds TP rank
    ``tp_rank`` (0: the lead, which posts), and ``exchange`` reaches the engine's other trainer ranks."""

    engine: str
    tp_rank: int
    tp_size: int
    exchange: RankExchange

    def __post_init__(self) -> None:
        if self.tp_size < 2:
            raise ValueError(f"TpLink({self.engine!r}): tp_size must be >= 2, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(
                f"TpLink({self.engine!r}): tp_rank {self.tp_rank} is not in 0..{self.tp_size - 1}"
            )


def _gather(link: TpLink, mine: dict[str, object], what: str) -> dict[int, dict[str, object]]:
    """One exchange among the engine's trainer ranks; every rank's message by TP rank."""
    if link.exchange.size != link.tp_size:
        raise ValueError(
            f"engine {link.engine!r}: the exchange has {link.exchange.size} ranks, the engine {link.tp_size} "
            "TP ranks (one trainer rank per TP rank)"
        )
    texts = link.exchange.all_gather(
        json.dumps({"engine": link.engine, "tp_rank": link.tp_rank, **mine}), what
    )
    by_rank: dict[int, dict[str, object]] = {}
    for text in texts:
        msg = json.loads(text)
        if msg.get("engine") != link.engine:
            raise ExchangeError(
                f"engine {link.engine!r}: a trainer rank of the exchange feeds {msg.get('engine')!r}"
            )
        by_rank[int(msg["tp_rank"])] = msg
    if sorted(by_rank) != list(range(link.tp_size)):
        raise ExchangeError(
            f"engine {link.engine!r}: the exchange's ranks feed TP ranks {sorted(by_rank)}; each of "
            f"0..{link.tp_size - 1} needs exactly one"
        )
    return by_rank


class TpLead:
    """The lead's side of one colocated TP engine (inside :class:`~ppo_weight_sync.ipc.IpcTransport`):
    the exporters' boards, read per bucket for their entries."""

    def __init__(self, link: TpLink, session: str, fmt: str, timeout_s: float) -> None:
        if link.tp_rank != 0:
            raise ValueError(f"TpLead({link.engine!r}) is TP rank 0's, got tp_rank {link.tp_rank}")
        if fmt not in TP_FORMATS:
            raise ValueError(f"colocated TP engines take {list(TP_FORMATS)}, not {fmt!r}")
        self.link, self.session, self.format, self.timeout_s = link, session, fmt, timeout_s
        self.epoch = 0
        self.boards: list[PeerBoard] = []
        msgs = _gather(
            link,
            {"session": session, "format": fmt},
            f"the boards of the ranks feeding engine {link.engine!r}'s TP ranks 1..{link.tp_size - 1} "
            "(connect)",
        )
        try:
            for i in range(1, link.tp_size):
                self.boards.append(PeerBoard.attach(str(msgs[i]["board"])))
        except BaseException:
            self.close(released=False)
            raise

    def start(self) -> None:
        """An update begins: stale if an exporter reset since the connection (its board is gone)."""
        for i, board in enumerate(self.boards, start=1):
            if not board.exists:
                raise EngineUnavailableError(
                    self.link.engine,
                    "update_weights_from_tensor",
                    f"the trainer rank feeding TP rank {i} reset its connection; the next update reconnects",
                )
        self.epoch += 1

    def entries(self, k: int, slot: int, layout: BucketLayout, own: Callable[[], str]) -> list[str]:
        """Bucket ``k``'s entries, one per TP rank, once every exporter packed it; ``own()`` makes TP rank
        0's after the waits (a fresh export made before a wait that fails would never be consumed)."""
        out: list[str] = []
        for i, board in enumerate(self.boards, start=1):
            what = f"engine {self.link.engine!r}: the trainer rank feeding TP rank {i} to pack bucket {k}"

            def check(i: int = i, board: PeerBoard = board) -> None:
                if board.get("abort"):
                    raise EngineUnavailableError(
                        self.link.engine,
                        "update_weights_from_tensor",
                        f"the trainer rank feeding TP rank {i} gave up (bucket {k})",
                    )

            try:
                board.wait("epoch", self.epoch, self.timeout_s, what, check)
                board.wait("packed", k + 1, self.timeout_s, what, check)
            except TimeoutError as exc:
                raise EngineUnavailableError(
                    self.link.engine, "update_weights_from_tensor", str(exc)
                ) from None
            msg = json.loads(board.take(slot))
            if int(msg["k"]) != k:
                raise EngineUnavailableError(
                    self.link.engine,
                    "update_weights_from_tensor",
                    f"TP rank {i}'s board holds bucket {msg['k']} in slot {slot}, expected bucket {k}",
                )
            handle = IpcHandle.from_wire(msg["handle"])
            if self.format == PPO_IPC_FORMAT:
                out.append(encode_ipc_bucket(self.session, handle, layout))
            else:
                out.append(encode_flattened_bucket(handle, layout))
        return [own(), *out]

    def loaded(self, k: int) -> None:
        """The engine answered bucket ``k``: every exporter may pack that buffer again."""
        for board in self.boards:
            board.set("loaded", k + 1)

    def abort(self) -> None:
        for board in self.boards:
            with contextlib.suppress(Exception):
                board.set("abort", 1)

    def close(self, *, released: bool) -> None:
        """Detach; ``released``: the engine unmapped the session (the exporters may free), else abort."""
        for board in self.boards:
            with contextlib.suppress(Exception):
                board.set("released" if released else "abort", 1)
            board.close()
        self.boards = []


class IpcExporter:
    """A trainer rank feeding TP rank ``link.tp_rank`` (>= 1) of a colocated engine that another rank (the
    lead) posts: ``connect()`` -> ``update(named_tensors, version)``... -> ``disconnect()``, in step with
    the lead's sender (the trainer calls both sides together). It never calls the engine.

    ``bucket_bytes`` must be the lead's (None: both size buckets from the update, ``auto_bucket_bytes``):
    the lead sends its own bucket layouts for every TP rank, and this rank packs the same buckets.
    ``check_finite`` must be the lead's too: both refuse the same non-finite weights
    (:class:`~ppo_weight_sync.errors.NonFiniteTensorsError`) before the update starts, and stay connected."""

    def __init__(
        self,
        link: TpLink,
        *,
        device: torch.device | None = None,
        bucket_bytes: int | None = None,
        timeout_s: float = 300.0,
        check_finite: bool = True,
    ) -> None:
        if link.tp_rank < 1:
            raise ValueError(
                f"IpcExporter feeds TP ranks >= 1; TP rank 0's rank posts (engine {link.engine!r})"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if bucket_bytes is not None and bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive int or None (auto), got {bucket_bytes!r}")
        self.link = link
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.check_finite = check_finite
        self._packer: BucketPacker | None = None
        self._board: PeerBoard | None = None
        self.format = ""
        self.session = ""
        self._epoch = 0
        self._consumer = f"{link.engine}/tp{link.tp_rank}"
        self._metrics = {"ipc_bytes": 0.0, "ipc_seconds": 0.0, "ipc_buckets": 0.0, "updates": 0.0}
        self._plan_key: tuple[object, ...] = ()
        self._layouts: list[BucketLayout] = []

    @property
    def is_connected(self) -> bool:
        return self._board is not None

    def connect(self) -> None:
        """Create this rank's board and exchange with the engine's other trainer ranks (the lead connects
        at the same time). A connected exporter reconnects."""
        self.disconnect()
        if not torch.cuda.is_available():
            raise ValueError("IpcExporter needs CUDA (CUDA IPC)")
        device = self.device or torch.device("cuda", torch.cuda.current_device())
        board = PeerBoard.create()
        try:
            msgs = _gather(
                self.link,
                {"board": board.path},
                f"engine {self.link.engine!r}'s lead (the rank on its TP rank 0 GPU) and the other feeding "
                "ranks (connect)",
            )
        except BaseException:
            board.close()
            raise
        fmt = str(msgs[0].get("format"))
        if fmt not in TP_FORMATS:
            board.close()
            raise ValueError(
                f"engine {self.link.engine!r}: the lead chose {fmt!r}; TP engines take {list(TP_FORMATS)}"
            )
        self.format, self.session = fmt, str(msgs[0]["session"])
        self._packer = BucketPacker(device, self.bucket_bytes or MAX_AUTO_BUCKET, self.timeout_s)
        self._board, self._epoch, self._plan_key = board, 0, ()

    def update(self, named_tensors: Sequence[tuple[str, torch.Tensor]], version: str) -> None:
        """Feed one update (the lead posts it with ``version``); returns once the engine's TP rank copied
        every bucket out. Raises :class:`~ppo_weight_sync.errors.EngineUnavailableError` naming the engine
        and TP rank when the lead gave up or the TP rank did not copy in time (then disconnected)."""
        items = list(named_tensors)
        if not items:
            raise ValueError("named_tensors is empty: there is nothing to send")
        bad = non_finite_names(items) if self.check_finite else []
        if bad:  # the lead refuses the same tensors before it pauses the engine
            raise NonFiniteTensorsError(bad)
        if self._board is not None and (self._board.get("abort") or self._board.get("released")):
            # The lead gave up on the previous update after this rank finished it, or disconnected: it
            # reconnects now, so must this rank (the connection's exchange pairs up).
            self.disconnect()
        if self._board is None:
            self.connect()
        board, packer = self._board, self._packer
        if board is None or packer is None:
            raise RuntimeError("IpcExporter.connect() left no board")  # connect raises instead
        start = time.perf_counter()
        try:
            layouts = self._plan(items, packer)
            packer.reserve(layouts)
            per_bucket = split_tensors(items, layouts)
            for field in ("packed", "loaded", "abort"):
                board.set(field, 0)
            self._epoch += 1
            board.set("epoch", self._epoch)
            self._run(board, packer, layouts, per_bucket)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                board.set("abort", 1)
            self._reset()
            if isinstance(exc, WeightSyncError):
                raise
            raise EngineUnavailableError(
                self.link.engine, f"feeding TP rank {self.link.tp_rank} (version {version})", str(exc)
            ) from None
        m = self._metrics
        m["ipc_bytes"] += sum(layout.nbytes for layout in layouts)
        m["ipc_seconds"] += time.perf_counter() - start
        m["ipc_buckets"] += len(layouts)
        m["updates"] += 1

    def _plan(self, items: Sequence[tuple[str, torch.Tensor]], packer: BucketPacker) -> list[BucketLayout]:
        key = tuple((n, t.dtype, tuple(t.shape)) for n, t in items)
        if key != self._plan_key:
            total = sum(t.numel() * t.element_size() for _, t in items)
            self._layouts = packer.plan(items, self.bucket_bytes or auto_bucket_bytes(total))
            self._plan_key = key
        return self._layouts

    def _run(
        self,
        board: PeerBoard,
        packer: BucketPacker,
        layouts: list[BucketLayout],
        per_bucket: list[list[torch.Tensor]],
    ) -> None:
        engine, tp_rank = self.link.engine, self.link.tp_rank

        def check() -> None:
            if board.get("abort"):
                raise EngineUnavailableError(
                    engine,
                    f"feeding TP rank {tp_rank}",
                    "the lead (TP rank 0's trainer rank) gave up on this update",
                )

        n = len(layouts)
        for k, layout in enumerate(layouts):
            slot = k % 2
            if k >= 2:  # buffer `slot` held bucket k - 2: the engine must have answered it
                board.wait(
                    "loaded", k - 1, self.timeout_s, f"engine {engine!r} to load bucket {k - 2}", check
                )
            packer.pack(slot, layout, per_bucket[k])
            packer.wait_packed(slot, check)
            with torch.cuda.device(packer.device):
                handle = (
                    packer.handle(self._consumer, slot)
                    if self.format == PPO_IPC_FORMAT
                    else export_buffer(packer.buffer(slot))  # SGLang unmaps after each call: a fresh export
                )
            board.put(slot, json.dumps({"k": k, "handle": handle.to_wire()}))
            board.set("packed", k + 1)
        board.wait(
            "loaded", n, self.timeout_s, f"engine {engine!r} TP rank {tp_rank} to load the last bucket", check
        )

    def pop_metrics(self) -> dict[str, float]:
        """``weight_sync/ipc_{bytes,seconds,buckets}`` and ``weight_sync/updates`` since the last call."""
        m, self._metrics = self._metrics, dict.fromkeys(self._metrics, 0.0)
        return {f"weight_sync/{k}": v for k, v in m.items()}

    def disconnect(self) -> None:
        """Wait (bounded) until the lead says the engine unmapped this rank's buffers, then free them.
        Idempotent; never raises."""
        board = self._board
        if board is None:
            return
        released = False
        if self.format == PPO_IPC_FORMAT and self._packer is not None and self._packer.allocated_bytes:
            try:
                board.wait(
                    "released",
                    1,
                    min(self.timeout_s, 30.0),
                    "the engine to unmap this rank's buffers",
                    _abort_ends(board),
                )
                released = True
            except (TimeoutError, _LeadAborted) as exc:
                log.warning("engine %s TP rank %d: %s", self.link.engine, self.link.tp_rank, exc)
        else:
            released = True
        if released and self._packer is not None:
            self._packer.forget(self._consumer, released=True)
        self._reset()

    def _reset(self) -> None:
        board, self._board = self._board, None
        packer, self._packer = self._packer, None
        if packer is not None:
            with contextlib.suppress(Exception):
                packer.free()
        if board is not None:
            board.close()
        self._plan_key = ()


class _LeadAborted(Exception):
    pass


def _abort_ends(board: PeerBoard) -> Callable[[], None]:
    def check() -> None:
        if board.get("abort"):
            raise _LeadAborted("the lead gave up before the engine unmapped this rank's buffers")

    return check
