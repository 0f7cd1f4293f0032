"""This process's child processes, read from ``/proc`` (Linux; elsewhere none are found), and ending
them: what a failed start of local Ray leaves behind (its GCS server keeps running otherwise, since
``ray.shutdown()`` knows nothing of a node that never finished starting)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["child_pids", "end_processes"]


def child_pids(parent: int | None = None) -> set[int]:
    """The live children of ``parent`` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Field 4 of /proc/PID/stat is the parent; the command name (field 2) may hold spaces.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            found.add(int(entry.name))
    return found


def end_processes(pids: Iterable[int], grace_s: float = 5.0) -> None:
    """SIGTERM each of ``pids``, then SIGKILL whatever still runs after ``grace_s``; reaps them."""
    pending = set(pids)
    for pid in pending:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pending and time.monotonic() < deadline:
        pending = {pid for pid in pending if not _reaped(pid)}
        time.sleep(0.05)
    for pid in pending:
        _signal(pid, signal.SIGKILL)
        _reaped(pid, block=True)


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # ended meanwhile
        os.kill(pid, sig)


def _reaped(pid: int, block: bool = False) -> bool:
    try:
        done, _ = os.waitpid(pid, 0 if block else os.WNOHANG)
    except ChildProcessError:  # not our child (or already reaped): alive while /proc has it
        return not Path(f"/proc/{pid}").exists()
    return done == pid
