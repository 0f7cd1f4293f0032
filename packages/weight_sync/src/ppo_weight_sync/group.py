"""The weight-update process group: built the way SGLang builds its side, never the default group.

SGLang's engine joins with ``init_custom_process_group`` (``sglang/srt/utils/common.py``, the same in
0.5.15.post1 and 0.5.23), called from its model runner's ``init_weights_update_group`` with
``init_method=f"tcp://{master_address}:{master_port}"``, ``rank = rank_offset + tp_rank``, no timeout
(torch's default) and no collective afterwards: torch's ``rendezvous`` gives a ``TCPStore`` client, which
is wrapped in ``PrefixStore(group_name, store)`` and handed to ``_new_process_group_helper``. The trainer
(rank 0) hosts that store and wraps it the same way, or the two sides look for each other's keys under
different prefixes and hang. Nothing is broadcast at join: SGLang's receiver sends no warm-up, so a
warm-up here would block until the timeout and then leave every later message off by one. gloo connects
its full mesh while the group is built, so a peer that never joins still fails the join. We never call
``init_process_group`` and never touch the default group, so a trainer's own groups are unaffected.

Listeners (no authentication exists on either, so they must not be reachable from other networks):
rank 0's ``TCPStore`` listens on a socket we bind to ``master_address`` ourselves (torch's own would
listen on every interface), and each member's gloo device is bound to the address its peers reach it
at: ``master_address`` on rank 0, on the others the local interface that routes to it (``127.0.0.1``
when the master is ``127.0.0.1``). torch cannot be told the gloo device through
``_new_process_group_helper``, so a bound gloo group is built as a ``ProcessGroupGloo`` of its own, on
the same store keys the helper would use (``PrefixStore(f"{group_name}/")`` then ``"cpu/"``), so an
SGLang engine that joins through the helper meets it. NCCL chooses its own bootstrap interface
(``NCCL_SOCKET_IFNAME``).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.rendezvous import rendezvous

from ppo_weight_sync.net import (  # free_port, node_address re-exported: older imports name this module
    free_port,
    listen_socket,
    local_address_toward,
    node_address,
)

if TYPE_CHECKING:
    from ppo_weight_sync.requests import InitRequest

__all__ = ["WeightGroup", "free_port", "node_address"]


def _host_for_url(address: str) -> str:
    """An address as a tcp:// URL's host (IPv6 in brackets, as SGLang's ``NetworkAddress.to_tcp``)."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


_BIND_LOCK = threading.Lock()


@contextlib.contextmanager
def _unbound_default_group(backend: str) -> Any:
    """Build the group as a communicator of its own, never a split of this process's default group.

    When the process's default group is bound to a device (``init_process_group(device_id=...)``, as a
    trainer does for eager NCCL init), torch creates every later NCCL group by ``ncclCommSplit`` of the
    default communicator (``_new_process_group_helper``'s ``split_from``). For this group that is wrong:
    its members are other processes (the engines), not the default group's ranks. The split would be a
    communicator of this process's own ranks only, rank 0 would never publish the NCCL unique id that
    the engines wait for in the store, and the engines would fail with a store timeout. Hiding the
    binding while the group is made leaves no split source, so the group rendezvouses through the store.
    """
    default = c10d._world.default_pg if backend == "nccl" and dist.is_initialized() else None
    bound = getattr(default, "bound_device_id", None) if default is not None else None
    if default is None or bound is None:
        yield
        return
    with _BIND_LOCK:
        default.bound_device_id = None
        try:
            yield
        finally:
            default.bound_device_id = bound


def _bound_gloo(
    store: dist.Store, group_name: str, rank: int, world_size: int, timeout: timedelta, address: str
) -> Any:
    """A gloo group whose device listens on ``address`` only, on the keys ``_new_process_group_helper``
    uses for a gloo group named ``group_name`` (its group prefix, then the first device's, "cpu")."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in torch's stubs
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    keys = dist.PrefixStore("cpu/", dist.PrefixStore(f"{group_name}/", store))
    return dist.ProcessGroupGloo(keys, rank, world_size, options)


class WeightGroup:
    """One member's handle on a weight-update group (rank 0 is the trainer, hosting the store).

    ``bind`` (default) keeps every listener of this member on the address its peers use (see the
    module's docstring); ``bind=False`` leaves torch's defaults, exactly as SGLang's engines join.
    """

    def __init__(
        self,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
        bind: bool = True,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.rank = rank
        self.world_size = world_size
        self.group_name = group_name
        self.backend = backend
        self.timeout = timedelta(seconds=timeout_s)
        # The address this member's listeners bind to: the master's own, or ours toward it.
        self.bind_address: str | None = None
        if bind:
            self.bind_address = master_address if rank == 0 else local_address_toward(master_address)
        store: dist.Store
        if rank == 0:
            listen: dict[str, Any] = {}
            if bind:
                # TCPStore takes the socket over (closes it with the store): detach, never close here.
                listen["master_listen_fd"] = listen_socket(master_address, master_port).detach()
            store = dist.TCPStore(
                master_address,
                master_port,
                world_size,
                is_master=True,
                timeout=self.timeout,
                # The group's own rendezvous waits for every rank (bounded by the timeout); a store that
                # also waited here would block before the engines have even been asked to join.
                wait_for_workers=False,
                **listen,
            )
        else:
            # An engine's side, exactly as SGLang's init_custom_process_group gets its store: torch's
            # tcp:// rendezvous (a TCPStore client of rank 0's store).
            url = f"tcp://{_host_for_url(master_address)}:{master_port}"
            store, _, _ = next(rendezvous(url, rank, world_size, timeout=self.timeout))
            store.set_timeout(self.timeout)
        self._store: dist.Store | None = store
        prefixed = dist.PrefixStore(group_name, store)
        self._closing: Any = None  # the group being destroyed (abort_stuck() reaches it)
        self._pg: Any
        if backend == "gloo" and self.bind_address is not None:
            # A backend of its own, outside torch's group registry: destroy() just lets it go.
            self._pg = _bound_gloo(prefixed, group_name, rank, world_size, self.timeout, self.bind_address)
            return
        options_kw = (
            "backend_options"
            if "backend_options" in inspect.signature(c10d._new_process_group_helper).parameters
            else "pg_options"
        )
        kwargs: dict[str, Any] = {options_kw: None, "timeout": self.timeout, "group_name": group_name}
        with _unbound_default_group(backend):
            pg, _ = c10d._new_process_group_helper(world_size, rank, [], backend, prefixed, **kwargs)
        # Ranks in this group are their own global ranks for torch's bookkeeping (as SGLang does).
        c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        self._pg = pg

    @classmethod
    def join(cls, request: InitRequest, rank: int, timeout_s: float, *, bind: bool = True) -> WeightGroup:
        """An engine's member of the group ``request`` names, as ``rank`` (``rank_offset + tp_rank``)."""
        return cls(
            master_address=request.master_address,
            master_port=request.master_port,
            rank=rank,
            world_size=request.world_size,
            group_name=request.group_name,
            backend=request.backend,
            timeout_s=timeout_s,
            bind=bind,
        )

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start a broadcast from rank 0 of ``tensor`` (in place on receivers); returns the work handle."""
        if self._pg is None:
            raise RuntimeError(f"weight group {self.group_name!r} is destroyed")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = self.timeout
        return self._pg.broadcast([tensor], opts)

    @property
    def alive(self) -> bool:
        return self._pg is not None

    def destroy(self, abort: bool = False) -> None:
        """Leave the group; idempotent. ``abort`` tears NCCL communicators down without waiting for peers."""
        pg, self._pg = self._pg, None
        if pg is None:
            return
        if not isinstance(pg, dist.ProcessGroup):
            # A bound gloo backend (never registered with torch): dropping the last reference closes
            # its pairs and its listener; nothing to abort (gloo has no communicators to wait on).
            self._store = None
            return
        self._closing = pg
        if abort and self.backend == "nccl":
            aborter = getattr(c10d, "_abort_process_group", None)
            if aborter is not None:
                with contextlib.suppress(Exception):
                    aborter(pg)
        # Already unregistered (an abort above removes it): nothing left to free.
        with contextlib.suppress(ValueError, RuntimeError):
            dist.destroy_process_group(pg)
        self._store = None

    def abort_stuck(self) -> None:
        """Abort the NCCL communicators of a graceful ``destroy()`` that does not return (it runs
        ncclCommFinalize/ncclCommDestroy, which wait for every rank of the node to destroy its side too,
        so a peer that is gone or never destroys leaves it blocked). Best effort; no-op for gloo."""
        pg = self._closing if self._closing is not None else self._pg
        if pg is None or self.backend != "nccl":
            return
        aborter = getattr(c10d, "_abort_process_group", None)
        if aborter is not None:
            with contextlib.suppress(Exception):
                aborter(pg)

    def destroy_within(self, timeout_s: float) -> bool:
        """``destroy()`` on a side thread, bounded: aborts the communicators if it has not returned after
        ``timeout_s`` (a peer that never destroys its side). True when it finished without the abort."""

        def run() -> None:
            with contextlib.suppress(Exception):
                self.destroy()

        worker = threading.Thread(target=run, name=f"destroy-{self.group_name}", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if not worker.is_alive():
            return True
        self.abort_stuck()
        worker.join(min(timeout_s, 10.0))
        return False
