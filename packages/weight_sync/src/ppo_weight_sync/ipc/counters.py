"""Named counters in a small shared-memory file, mapped by two processes of one host.

Colocated processes (a sender and its engine, a TP lead and an exporting rank) tell each other where
they are without a message per step: a file in ``/dev/shm`` (the temp folder where there is none)
starts with signed 64-bit counters, by field name, and may carry bytes of the subclass's own after them
(``EXTRA_BYTES``, e.g. the TP board's handle slots). A subclass of :class:`SharedCounters` names its
counters; ``create()`` makes a fresh zeroed file (the owner removes it at ``close()``), ``attach(path)``
maps one that another process made.

Each counter must have one writer at a time; aligned 8-byte stores and loads are single instructions
on the hosts we run on (x86-64 and arm64), so a reader sees either the old value or the new one.
Every wait is bounded and polls (20 us: a bucket's copies take 0.1-0.5 ms), checking a caller's
condition between polls.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import uuid
from collections.abc import Callable
from typing import ClassVar, Self

from ppo_weight_sync.waiting import wait_until

__all__ = ["POLL_S", "SharedCounters", "new_shared_file"]

POLL_S = 0.00002
_WORD = 8


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


class SharedCounters:
    """Signed 64-bit counters :attr:`FIELDS` (8 bytes each, in that order) at the start of the shared
    file :attr:`path`, then :attr:`EXTRA_BYTES` bytes for the subclass (:meth:`read` / :meth:`write`).

    A subclass names its file: the counters, the file name's ``PREFIX``, and a ``LABEL`` that errors
    use ("a sender's signal file"). ``owner``: this side made the file and removes it at :meth:`close`."""

    FIELDS: ClassVar[tuple[str, ...]]
    PREFIX: ClassVar[str]
    LABEL: ClassVar[str]
    EXTRA_BYTES: ClassVar[int] = 0

    def __init__(self, path: str, owner: bool) -> None:
        self.path = path
        self.owner = owner
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), self.size())
        self._view: memoryview | None = memoryview(self._map)[: self._head()].cast("q")

    @classmethod
    def _head(cls) -> int:
        return _WORD * len(cls.FIELDS)

    @classmethod
    def size(cls) -> int:
        """The file's bytes: the counters, then the extra bytes."""
        return cls._head() + cls.EXTRA_BYTES

    @classmethod
    def create(cls) -> Self:
        """A fresh file (every counter 0) named ``<PREFIX>-<pid>-<random>``, owned by this side."""
        return cls(new_shared_file(cls.PREFIX, cls.size()), owner=True)

    @classmethod
    def attach(cls, path: str) -> Self:
        """Map the file another process created; ValueError naming ``path`` and what it should be when
        there is no such file on this host or it is too small for these counters."""
        if not isinstance(path, str) or not os.path.isfile(path) or os.path.getsize(path) < cls.size():
            raise ValueError(f"{path!r} is not {cls.LABEL} on this host")
        return cls(path, owner=False)

    @property
    def exists(self) -> bool:
        """Whether the file is still there (its owner removes it when it closes)."""
        return os.path.exists(self.path)

    def _v(self) -> memoryview:
        if self._view is None:
            raise RuntimeError(f"{self.LABEL} {self.path!r} is closed")
        return self._view

    def get(self, field: str) -> int:
        return int(self._v()[self.FIELDS.index(field)])

    def set(self, field: str, value: int) -> None:
        self._v()[self.FIELDS.index(field)] = value

    def _extra(self, offset: int, n: int) -> int:
        """Where ``n`` bytes at ``offset`` of the extra bytes start in the file, once checked."""
        self._v()
        if offset < 0 or n < 0 or offset + n > self.EXTRA_BYTES:
            raise ValueError(
                f"{self.LABEL}: {n} bytes at offset {offset} do not fit its {self.EXTRA_BYTES} extra bytes"
            )
        return self._head() + offset

    def write(self, offset: int, data: bytes) -> None:
        """Store ``data`` at ``offset`` of the bytes after the counters."""
        start = self._extra(offset, len(data))
        self._map[start : start + len(data)] = data

    def read(self, offset: int, n: int) -> bytes:
        """``n`` bytes at ``offset`` of the bytes after the counters."""
        start = self._extra(offset, n)
        return self._map[start : start + n]

    def wait_at_least(
        self,
        field: str,
        value: int,
        timeout_s: float,
        what: str,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Block until ``field >= value``, polling; ``check()`` runs between polls (it raises to stop the
        wait). After ``timeout_s``: TimeoutError ``"<what>: not done within <timeout_s> s (<field>
        <current> < <value>)"``, so the message says what was awaited and how far it got."""
        index = self.FIELDS.index(field)
        view = self._v()
        wait_until(
            lambda: view[index] >= value,
            timeout_s,
            lambda: f"{what}: not done within {timeout_s:g} s ({field} {view[index]} < {value})",
            poll_s=POLL_S,
            check=check,
        )

    def close(self) -> None:
        """Unmap (and, for the owner, remove the file). Idempotent."""
        view, self._view = self._view, None
        if view is None:
            return
        view.release()
        self._map.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
