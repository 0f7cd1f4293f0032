"""Process groups that can be destroyed to free their buffers and rebuilt exactly as they were.

Rebuilding needs a rendezvous whose keys are fresh: the keys the previous default group wrote
in the store are still there, and a new group reading them would connect to dead peers. So the
store from ``init_method`` is created once and kept alive by this object, and each generation of
groups runs under its own ``PrefixStore("ppo_lifecycle/gen<N>", store)``. Every rank counts
generations the same way (one per ``destroy``), so the prefixes agree without talking.

The default group and every subgroup made through ``new_group`` are rebuilt with their recorded
backend, timeout and options, subgroups in creation order (collective over all ranks, as
``torch.distributed.new_group`` requires).

Every group costs at each sleep and wake: a ``ProcessGroup`` object (NCCL: its watchdog thread) to
shut down and create again, and, for each group a collective ran on, a communicator to destroy and to
initialise again at the next collective. Subgroups made with ``share=True`` and the same ranks,
backend and timeout are one group (see ``new_group``): megatron-core asks for ~20 groups, most of
them over the same ranks (all of them on one GPU), and that many communicators are fixed costs of
every transition that buy nothing.

For a ``tcp://host:port`` init method, rank 0 hosts the store on a socket bound to ``host`` alone (the
address every rank was given): torch's own tcp:// rendezvous would listen on every interface, and the
store has no authentication. A gloo group's own sockets listen on the interface of that address too
(``bind_gloo_to``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol
from urllib.parse import urlparse

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class ProcessGroupSet(Protocol):
    """What ``Lifecycle`` needs from the process groups: destroy, rebuild, and whether they exist."""

    def destroy(self) -> None: ...

    def reload(self) -> None: ...

    @property
    def is_alive(self) -> bool: ...


@dataclass(frozen=True)
class DefaultGroupSpec:
    backend: str
    init_method: str
    world_size: int
    rank: int
    timeout: timedelta
    pg_options: Any = None
    device_id: torch.device | None = None


@dataclass(frozen=True)
class SubgroupSpec:
    ranks: tuple[int, ...] | None
    backend: str | None
    timeout: timedelta | None
    pg_options: Any = None
    share: bool = False

    def share_key(self) -> tuple[tuple[int, ...] | None, str | None, timedelta | None] | None:
        """What makes two shareable subgroups the same group (None: never shared). Options objects
        are not comparable, so a subgroup with ``pg_options`` is never shared."""
        if not self.share or self.pg_options is not None:
            return None
        return (tuple(sorted(self.ranks)) if self.ranks is not None else None, self.backend, self.timeout)


class GroupHandle:
    """A stable reference to a group that is rebuilt on reload; ``.group`` is the live one."""

    def __init__(self, owner: ReloadableProcessGroups, index: int | None, spec: SubgroupSpec) -> None:
        self._owner = owner
        self._index = index  # None: the default group
        self.spec = spec

    @property
    def group(self) -> dist.ProcessGroup:
        """The live group (changes after each reload: never cache it)."""
        return self._owner._live_group(self._index)

    @property
    def timeout(self) -> timedelta | None:
        """The timeout it was created with (None: the default group's)."""
        return self.spec.timeout

    def __repr__(self) -> str:
        which = "default" if self._index is None else f"subgroup {self._index}"
        return f"GroupHandle({which}, ranks={self.spec.ranks}, backend={self.spec.backend})"


class ReloadableProcessGroups:
    """Owns the default process group and its subgroups; ``destroy()``/``reload()`` are idempotent."""

    def __init__(self) -> None:
        self._default: DefaultGroupSpec | None = None
        self._subgroups: list[SubgroupSpec] = []
        # _source[i]: the subgroup whose group subgroup i is (i itself unless shared with an earlier one).
        self._source: list[int] = []
        self._shared: dict[tuple[Any, ...], int] = {}
        self._live: list[dist.ProcessGroup] = []
        self._store: dist.Store | None = None
        self._generation = 0
        self._alive = False
        self._default_built = False
        self._lock = threading.RLock()

    # -- creation --------------------------------------------------------------------------
    def init_default(
        self,
        backend: str,
        init_method: str,
        world_size: int,
        rank: int,
        timeout: timedelta,
        *,
        pg_options: Any = None,
        device_id: torch.device | None = None,
    ) -> None:
        """Create the default group (like ``init_process_group``) and remember how."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
            raise ValueError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
        with self._lock:
            if self._default is not None:
                raise RuntimeError("init_default() was already called on this object")
            if dist.is_initialized():
                raise RuntimeError(
                    "torch.distributed is already initialized; ReloadableProcessGroups must create the "
                    "default group itself to be able to rebuild it"
                )
            self._store = _rendezvous_store(init_method, rank, world_size, timeout)
            self._default = DefaultGroupSpec(
                backend, init_method, world_size, rank, timeout, pg_options, device_id
            )
            self._build()

    def new_group(
        self,
        ranks: Sequence[int] | None = None,
        backend: str | None = None,
        timeout: timedelta | None = None,
        *,
        pg_options: Any = None,
        share: bool = False,
    ) -> GroupHandle:
        """Create a subgroup (collective: every rank calls it in the same order) and record it.

        ``share=True``: if an earlier subgroup made with ``share=True`` has the same ranks (in any
        order), backend and timeout, and neither has ``pg_options``, this handle is that group (the
        same ``ProcessGroup``, so one communicator and one object to destroy and rebuild); nothing is
        created. Every rank decides alike, because every rank passes the same arguments in the same
        order. Collectives on shared handles run in program order on one communicator: right for
        groups whose collectives every member issues in the same order (megatron's), but no
        overlap between them.
        """
        with self._lock:
            if not self._alive:
                raise RuntimeError("new_group(): the groups are not alive; call init_default() or reload()")
            spec = SubgroupSpec(
                tuple(ranks) if ranks is not None else None, backend, timeout, pg_options, share
            )
            index = len(self._subgroups)
            key = spec.share_key()
            source = self._shared.get(key, index) if key is not None else index
            group = self._live[source] if source != index else self._make_subgroup(spec)
            self._live.append(group)
            self._subgroups.append(spec)
            self._source.append(source)
            if key is not None and source == index:
                self._shared[key] = index
            return GroupHandle(self, index, spec)

    @property
    def store(self) -> dist.Store:
        """The rendezvous store, kept alive across every ``destroy``/``reload``: for a group of the
        caller's own that must outlive them (under a ``PrefixStore`` of its own; never ``ppo_lifecycle/``)."""
        with self._lock:
            self._require_default()
            assert self._store is not None  # set together with _default
            return self._store

    @property
    def default(self) -> GroupHandle:
        """Handle of the default group."""
        spec = self._require_default()
        return GroupHandle(self, None, SubgroupSpec(None, spec.backend, spec.timeout, spec.pg_options))

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._alive

    @property
    def generation(self) -> int:
        """How many times the groups were destroyed."""
        return self._generation

    @property
    def subgroup_count(self) -> tuple[int, int]:
        """(subgroups asked for, process groups that stand for them): what sharing saved."""
        return len(self._subgroups), len(set(self._source))

    def destroy(self) -> None:
        """Destroy every group (a no-op when already destroyed or never created)."""
        with self._lock:
            if not self._alive and not self._default_built:
                return
            if dist.is_initialized():
                dist.destroy_process_group()
            self._live = []
            self._alive = False
            self._default_built = False
            self._generation += 1

    def reload(self) -> None:
        """Rebuild the default group and every subgroup (a no-op when alive or never created)."""
        with self._lock:
            if self._alive:
                return
            if self._default is None:
                log.debug("reload(): init_default() was never called; nothing to rebuild")
                return
            self._build()

    # -- internals -------------------------------------------------------------------------
    def _build(self) -> None:
        spec = self._require_default()
        assert self._store is not None  # set together with _default
        if not self._default_built:
            if "gloo" in spec.backend:
                bind_gloo_to(spec.init_method)
            kwargs: dict[str, Any] = {}
            if spec.pg_options is not None:
                kwargs["pg_options"] = spec.pg_options
            if spec.device_id is not None:
                kwargs["device_id"] = spec.device_id
            dist.init_process_group(
                spec.backend,
                store=dist.PrefixStore(f"ppo_lifecycle/gen{self._generation}", self._store),
                world_size=spec.world_size,
                rank=spec.rank,
                timeout=spec.timeout,
                **kwargs,
            )
            self._default_built = True
        # A retried build keeps the subgroups made before the failure. A shared subgroup's source
        # comes before it, so it is live by then.
        for index in range(len(self._live), len(self._subgroups)):
            source = self._source[index]
            group = self._live[source] if source != index else self._make_subgroup(self._subgroups[index])
            self._live.append(group)
        self._alive = True
        log.debug("process groups built, generation %d, %d subgroups", self._generation, len(self._live))

    @staticmethod
    def _make_subgroup(spec: SubgroupSpec) -> dist.ProcessGroup:
        kwargs: dict[str, Any] = {}
        if spec.pg_options is not None:
            kwargs["pg_options"] = spec.pg_options
        group = dist.new_group(
            ranks=list(spec.ranks) if spec.ranks is not None else None,
            timeout=spec.timeout,
            backend=spec.backend,
            **kwargs,
        )
        return group  # type: ignore[return-value]  # -100 (not a member) is kept as is

    def _live_group(self, index: int | None) -> dist.ProcessGroup:
        with self._lock:
            if not self._alive:
                raise RuntimeError("the process groups are destroyed; wake up (reload()) before using them")
            if index is None:
                world = dist.group.WORLD
                assert world is not None
                return world
            return self._live[index]

    def _require_default(self) -> DefaultGroupSpec:
        if self._default is None:
            raise RuntimeError("init_default() was never called")
        return self._default


# Linux's ioctl that reads an interface's IPv4 address (<linux/sockios.h>).
_SIOCGIFADDR = 0x8915


def bind_gloo_to(init_method: str) -> None:
    """Make this process's gloo groups listen on the interface of the store's address (``tcp://HOST``
    with an IPv4 HOST): ``GLOO_SOCKET_IFNAME``, which gloo reads when it creates a group's device.
    Without it gloo binds to whatever the host name resolves to, a LAN address on many machines, so a
    one-machine run's unauthenticated group would listen beyond loopback. A name the user exported
    stays; an address on no interface here (another host's) changes nothing."""
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or "GLOO_SOCKET_IFNAME" in os.environ:
        return
    try:
        address = socket.gethostbyname(url.hostname)
    except OSError:
        return
    name = interface_of(address)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def interface_of(address: str) -> str | None:
    """The network interface that holds IPv4 ``address`` (``lo`` for 127.0.0.1), None if none does."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                info = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(info[20:24]) == address:
                return name
    return None


def _rendezvous_store(init_method: str, rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The store behind ``init_method``: torch's rendezvous, except that a plain ``tcp://host:port``
    store listens on ``host`` only (rank 0 binds the socket and hands it to the ``TCPStore``)."""
    url = urlparse(init_method)
    if url.scheme != "tcp" or url.query or not url.hostname or url.port is None:
        store, _, _ = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))
        return store
    if rank != 0:
        return dist.TCPStore(url.hostname, url.port, world_size, is_master=False, timeout=timeout)
    family, _, _, _, address = socket.getaddrinfo(url.hostname, url.port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise ValueError(
            f"init_method {init_method!r}: cannot listen on {url.hostname}:{url.port} "
            f"({exc.strerror or exc}); give an address of rank 0's host that the other ranks reach"
        ) from exc
    # The store owns the socket from here (it closes it): detach, so Python never closes it too.
    return dist.TCPStore(
        url.hostname,
        url.port,
        world_size,
        is_master=True,
        timeout=timeout,
        master_listen_fd=sock.detach(),
    )


def group_timeout(group: dist.ProcessGroup) -> timedelta:
    """The timeout a live group runs with, read from its backend's options.

    There is no public getter; this reads ``ProcessGroup._get_backend(device).options._timeout``
    (private, present for gloo and NCCL in torch 2.4 to 2.15).
    """
    backend = dist.get_backend(group)
    device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
    timeout = group._get_backend(device).options._timeout
    return timedelta(seconds=timeout.total_seconds()) if isinstance(timeout, timedelta) else timeout
