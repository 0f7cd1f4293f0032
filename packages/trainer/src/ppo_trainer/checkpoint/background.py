"""A checkpoint shard written by a thread from the host copies a sleep made, while the worker goes on.

The pinned memory backends reuse their host buffers at the next sleep, so the worker's ``sleep``
waits for ``wait_reading`` first. With ``private_copy`` (the pinned backends) the writer first copies
the host copies into memory of its own (memcpy speed, ~1 s for 10 GB) and releases them, then writes
and fsyncs at disk speed from its copy: the next sleep waits for the memcpy at most, never for the
disk. Without it (the host backend, which hands each sleep fresh buffers) the writer reads the host
copies until every file is written. Host cost of the private copy: the shard's bytes, until written.

A sharded role's capture (``sharded.ShardedCapture``) holds each rank's shards: after the private
copy the writer assembles them (a collective over the role's save group; rank 0 gets whole tensors)
and writes the same files as a replicated role's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from ppo_trainer.checkpoint.sharded import ShardedCapture
from ppo_trainer.checkpoint.torch_io import ShardState, private_copy, write_shard

log = logging.getLogger(__name__)


class BackgroundSave:
    """One rank's shard of one checkpoint, written into ``folder`` by a daemon thread."""

    def __init__(
        self, state: ShardState | ShardedCapture, folder: Path, *, name: str = "", copy_first: bool = False
    ) -> None:
        self.folder = folder
        self._copy_first = copy_first
        self.nbytes = state.nbytes
        self._state: ShardState | ShardedCapture | None = state
        self._reading = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.seconds = 0.0  # writing and fsync, once done
        self.reading_seconds = 0.0  # until the host copies were no longer needed
        # A daemon: a run that dies must not be kept alive by a write nobody will mark complete.
        self._thread = threading.Thread(target=self._run, name=f"save {name} {folder.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            state = self._state
            assert state is not None
            self._state = None  # only this frame holds the host copies now
            if self._copy_first:
                state = state.private_copy() if isinstance(state, ShardedCapture) else private_copy(state)
                self.reading_seconds = time.perf_counter() - start
                self._reading.set()
            whole = state.assemble() if isinstance(state, ShardedCapture) else state
            del state
            write_shard(whole, self.folder)
            rank, rng_only = whole.rank, whole.model is None
            del whole
            if not self._reading.is_set():
                self.reading_seconds = time.perf_counter() - start
                self._reading.set()
            if rng_only:
                # Only its own file: rank 0's writer may still be writing (and renaming) in this folder.
                fsync_paths([self.folder / f"rng_rank{rank}.safetensors", self.folder])
            else:
                fsync_tree(self.folder)
        except BaseException as exc:  # reported by result(); the thread must not die silently
            log.error("background save into %s failed: %s", self.folder, exc)
            self._error = exc
        finally:
            self._state = None
            self.seconds = time.perf_counter() - start
            self._reading.set()
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait_reading(self, timeout_s: float) -> None:
        """Until the writer no longer reads the host copies (the next sleep may overwrite them)."""
        if not self._reading.wait(timeout_s):
            raise TimeoutError(
                f"background save into {self.folder}: still reading the host copies after {timeout_s:.0f} s"
            )

    def result(self, timeout_s: float) -> float:
        """Wait until every file is written and fsynced; the writer's seconds. Raises its error."""
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"background save into {self.folder}: not finished after {timeout_s:.0f} s")
        if self._error is not None:
            raise RuntimeError(f"background save into {self.folder} failed: {self._error}") from self._error
        return self.seconds


def fsync_tree(folder: Path) -> None:
    """fsync every file and folder under ``folder``, deepest first. A file gone between listing and
    opening (another rank's writer renamed its temporary file) is that writer's to fsync."""
    for here, _dirs, files in os.walk(folder, topdown=False):
        fsync_paths([Path(here, name) for name in files], missing_ok=True)
        fsync_paths([Path(here)])


def fsync_paths(paths: list[Path], *, missing_ok: bool = False) -> None:
    """fsync each file or folder of ``paths``."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            if missing_ok:
                continue
            raise
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
