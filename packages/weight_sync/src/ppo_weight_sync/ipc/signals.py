"""Per-bucket signals between a sender and an engine on the same host, without a message per bucket.

A colocated update in ``ppo_ipc_stream`` (see :mod:`.payload`) is one request per update; the buckets
then move through the two shared GPU buffers, and the two processes tell each other where they are by
three 64-bit counters in a small shared file (``/dev/shm`` where there is one), mapped by both:

- ``packed`` (sender): buckets ``0 .. packed-1`` are in their buffer, ready to be copied out;
- ``loaded`` (engine): buckets ``0 .. loaded-1`` are copied out; their buffer may be packed again;
- ``abort`` (sender): the sender gave up on this update; the engine stops waiting at once.

Every connection has its own file, and the sender zeroes the counters before it posts an update, after
the previous update's request answered, so no engine thread of an earlier update can still write them
(a failed update resets the connection, and with it the file).

Each counter has one writer; aligned 8-byte stores and loads are single instructions on the hosts we
run on (x86-64 and arm64), so a reader sees either the old value or the new one. Colocated processes
share a host by definition, so shared memory is always there. Every wait is bounded and polls
(20 us), checking a caller's condition (e.g. the engine's request failed) between polls.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import time
import uuid
from collections.abc import Callable

__all__ = ["BucketSignals"]

_FIELDS = ("packed", "loaded", "abort")
_SIZE = 8 * len(_FIELDS)
POLL_S = 0.00002


def _folder() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def new_shared_file(prefix: str, size: int) -> str:
    """A fresh zeroed file of ``size`` bytes in shared memory (``/dev/shm`` where there is one), only for
    this user, named ``<prefix>-<pid>-<random>``; the caller maps it and removes it."""
    path = os.path.join(_folder(), f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    return path


class BucketSignals:
    """The shared counters of one sender's colocated connection: :meth:`create` on the sender (it owns
    and removes the file), :meth:`attach` on the engine."""

    def __init__(self, path: str, owner: bool) -> None:
        self.path = path
        self.owner = owner
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _SIZE)
        self._view: memoryview | None = memoryview(self._map).cast("q")

    @classmethod
    def create(cls) -> BucketSignals:
        return cls(new_shared_file("ppo-ipc-signals", _SIZE), owner=True)

    @classmethod
    def attach(cls, path: str) -> BucketSignals:
        """Map the sender's counters; ValueError naming the path when there is no such file."""
        if not isinstance(path, str) or not os.path.isfile(path) or os.path.getsize(path) < _SIZE:
            raise ValueError(f"signals {path!r} is not a sender's signal file on this host")
        return cls(path, owner=False)

    def _v(self) -> memoryview:
        if self._view is None:
            raise RuntimeError(f"the signals {self.path!r} are closed")
        return self._view

    def get(self, field: str) -> int:
        return int(self._v()[_FIELDS.index(field)])

    def set(self, field: str, value: int) -> None:
        self._v()[_FIELDS.index(field)] = value

    def start(self) -> None:
        """The sender, before it posts an update: every counter back to zero."""
        self.set("abort", 0)
        self.set("packed", 0)
        self.set("loaded", 0)

    def wait_at_least(
        self,
        field: str,
        value: int,
        timeout_s: float,
        what: str,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Block until ``field >= value``; ``check()`` runs between polls (it raises to stop the wait);
        TimeoutError saying ``what`` waited after ``timeout_s``."""
        index = _FIELDS.index(field)
        view = self._v()
        if view[index] >= value:
            return
        deadline = time.monotonic() + timeout_s
        while view[index] < value:
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{what}: not done within {timeout_s:g} s ({field} {view[index]} < {value})"
                )
            time.sleep(POLL_S)

    def close(self) -> None:
        """Unmap (and, for the sender, remove the file). Idempotent."""
        view, self._view = self._view, None
        if view is None:
            return
        view.release()
        self._map.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
