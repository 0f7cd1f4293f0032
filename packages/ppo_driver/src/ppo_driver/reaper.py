"""A watchdog process that ends what a driver started once the driver is gone, however it went.

A driver killed with SIGKILL cannot clean up. Local Ray's GCS server and raylet share its fate, but
the raylet's dashboard and runtime-env agents, seeing their raylet die, first try to report it to the
GCS server that is gone too, for a fixed 60 s, and stay alive meanwhile. The reaper closes that gap:

- the driver starts it (``start``) with a pipe on its stdin and keeps the write end, which only the
  driver holds: the kernel closes it when the driver exits, whatever the cause;
- every ``interval_s`` the reaper records the driver's descendants (pid and start time, from
  ``/proc``), itself excepted;
- on end of file it sends SIGKILL to every recorded process still alive (the same pid with the same
  start time: never a process that reused the pid) and exits.

Linux only (``/proc``); elsewhere ``start`` returns None and nothing watches.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

__all__ = ["Reaper", "descendants", "start"]

INTERVAL_S = 0.5


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of ``pid``; None if it is gone or a zombie."""
    try:
        # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every live descendant of ``root``: pid -> start time."""
    children: dict[int, list[int]] = {}
    started: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _stat(int(entry.name))
        if stat is not None:
            children.setdefault(stat[0], []).append(int(entry.name))
            started[int(entry.name)] = stat[1]
    found: dict[int, int] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in found or pid not in started:
            continue
        found[pid] = started[pid]
        todo.extend(children.get(pid, []))
    return found


def kill_all(recorded: dict[int, int]) -> list[int]:
    """SIGKILL each recorded process that is still the one recorded; the pids signalled."""
    killed = []
    for pid, start_time in recorded.items():
        stat = _stat(pid)
        if stat is None or stat[1] != start_time:
            continue  # gone, or the pid now belongs to another process
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def watch(driver: int, spared: set[int], interval_s: float = INTERVAL_S) -> None:
    """The reaper's loop: record the driver's descendants (but ``spared``, its children from before
    the reaper started) until stdin closes, then kill them."""
    me = os.getpid()
    recorded: dict[int, int] = {}
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], interval_s)
        if readable and not os.read(sys.stdin.fileno(), 4096):
            break  # end of file: the driver exited
        # The union over time: a process that reparented itself away from the driver (to init, or a
        # subreaper) after its parent died is no longer a descendant, but still the run's.
        found = descendants(driver)
        recorded.update({pid: t for pid, t in found.items() if pid != me and pid not in spared})
    kill_all(recorded)


class Reaper:
    """The running reaper; ``stop`` ends it without killing anything (after a clean shutdown)."""

    def __init__(self, proc: subprocess.Popen[bytes], pipe: int) -> None:
        self.proc = proc
        self._pipe = pipe

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close the pipe; the reaper ends what is left of the run (after a clean shutdown: nothing)."""
        if self._pipe >= 0:
            os.close(self._pipe)
            self._pipe = -1
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start() -> Reaper | None:
    """Start a reaper of the processes this one starts from now on (its descendants from before,
    such as a test's, are spared); None where ``/proc`` is not there to read."""
    if not Path("/proc/self/stat").is_file():
        return None
    spared = sorted(descendants(os.getpid()))
    read_end, write_end = os.pipe()
    os.set_inheritable(write_end, False)  # the driver's alone: children must not keep it open
    proc = subprocess.Popen(
        [sys.executable, "-m", "ppo_driver.reaper", str(os.getpid()), *map(str, spared)],
        stdin=read_end,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C in the terminal reaches the driver, not the reaper
    )
    os.close(read_end)
    return Reaper(proc, write_end)


if __name__ == "__main__":
    watch(int(sys.argv[1]), {int(a) for a in sys.argv[2:]})
