"""One run per run folder (and per checkpoint folder): an advisory lock held for the life of the process.

``fcntl.flock`` on ``<run_dir>/.lock``: the kernel releases it when the holder exits, however it
exits (SIGKILL included), so a stale lock file never blocks the next run. The file holds the
holder's pid, host and start time, which the refusal names.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import IO

LOCK_FILE = ".lock"


class RunLockError(RuntimeError):
    """The run's lock cannot be taken; ``str()`` is one line naming the folder and the fix."""


class RunFolderBusyError(RunLockError):
    """Another live process holds the run folder."""


class RunLock:
    """The run folder's lock (``RunLock(run_dir)``), or a checkpoint folder's (``checkpoints``)."""

    def __init__(self, run_dir: Path, *, lock_file: Path | None = None, run: Path | None = None) -> None:
        self.path = lock_file or run_dir / LOCK_FILE
        self.folder = run_dir
        self.run = run  # the run folder of the holder, recorded for a refusal's message
        self._file: IO[str] | None = None

    @classmethod
    def checkpoints(cls, ckpt_root: Path, run_dir: Path) -> RunLock:
        """A ``checkpoint.dir`` outside the run folder: its lock sits beside it (``.<name>.lock``), not
        in it, since ``checkpoint.resume=false`` renames the folder; where that parent cannot be
        written (a read-only mount, another user's folder), in it (``<checkpoint.dir>/.lock``): the
        folder cannot be renamed there either."""
        beside = ckpt_root.parent / f".{ckpt_root.name}.lock"
        read_only = ckpt_root.parent.is_dir() and not os.access(ckpt_root.parent, os.W_OK | os.X_OK)
        if read_only and ckpt_root.is_dir():
            return cls(ckpt_root, lock_file=ckpt_root / LOCK_FILE, run=run_dir)
        return cls(ckpt_root, lock_file=beside, run=run_dir)

    def __enter__(self) -> RunLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            f = self.path.open("a+")
        except OSError as exc:
            field = f"checkpoint.dir {self.folder}" if self.run is not None else f"run folder {self.folder}"
            raise RunLockError(
                f"{field}: its lock {self.path} cannot be written ({exc.strerror or type(exc).__name__}); "
                "pick a folder you can write to"
            ) from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "an unknown process"
            f.close()
            if self.run is not None:
                raise RunFolderBusyError(
                    f"checkpoint.dir {self.folder} is in use by {_describe(holder)}; give each run its own "
                    "checkpoint.dir (or none: <run folder>/checkpoints)"
                ) from None
            raise RunFolderBusyError(
                f"run folder {self.path.parent} is in use by {_describe(holder)}; wait for that run to "
                "end (or stop it), or pass another --run-dir"
            ) from None
        f.seek(0)
        f.truncate()
        holder_info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        if self.run is not None:
            holder_info["run_dir"] = str(self.run)
        f.write(json.dumps(holder_info))
        f.flush()
        self._file = f
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._file is not None:
            self._file.seek(0)
            self._file.truncate()
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def _describe(holder: str) -> str:
    try:
        info = json.loads(holder)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
        run = f", run folder {info['run_dir']}" if "run_dir" in info else ""
        return f"pid {info['pid']} on {info['host']} (since {since}{run})"
    except (ValueError, KeyError, TypeError):
        return holder
