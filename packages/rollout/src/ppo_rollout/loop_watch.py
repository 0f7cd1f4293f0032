"""User coroutines that block the rollout's event loop, caught and named.

``env_timeout_s`` bounds an ``async def step`` through ``asyncio.wait_for``, which only fires when the
coroutine yields to the loop: one that calls ``time.sleep`` (or computes for minutes) never yields, every
trajectory of the step waits on it, and the bound never fires. :class:`LoopWatch` notices: the loop
beats a few times a second; a thread watches the beats. While user code is marked as running
(:func:`user_code`, put around each environment coroutine and a user's rollout function), a loop that
has not beaten for ``bound_s`` gets :class:`EventLoopBlocked` raised in its thread, naming that code,
as soon as the code runs Python again; the line also goes to stderr at once, in case it never does.
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
import threading
import time
from typing import TypeVar

from .environment import EnvironmentStop
from .user_marks import current_marks, forget_marks, user_code

__all__ = ["EventLoopBlocked", "LoopWatch", "user_code"]  # user_code: from user_marks

T = TypeVar("T")


class EventLoopBlocked(EnvironmentStop):
    """User code held the event loop past the bound; raised in the loop's thread."""

    detail = "user code blocked the rollout's event loop"

    def __init__(self, *args: object) -> None:
        super().__init__(*(args or (self.detail,)))


class LoopWatch:
    """Watches the running loop from a daemon thread; use as ``async with LoopWatch(bound_s, what):``."""

    def __init__(self, bound_s: float, setting: str) -> None:
        self.bound_s = bound_s
        self.setting = setting
        self._interval = min(0.25, bound_s / 4)
        self._beat = time.monotonic()
        self._stop = threading.Event()
        self._handle: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> LoopWatch:
        self._loop = asyncio.get_running_loop()
        self._thread_id = threading.get_ident()
        self._marks = current_marks()
        self._beat_now()
        threading.Thread(target=self._watch, name="loop-watch", daemon=True).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()
        forget_marks(self._thread_id)

    def _beat_now(self) -> None:
        self._beat = time.monotonic()
        self._handle = self._loop.call_later(self._interval, self._beat_now)

    def _watch(self) -> None:
        reported = -1
        while not self._stop.wait(self._interval):
            stalled = time.monotonic() - self._beat
            stack, entry = list(self._marks.stack), self._marks.entries
            if stalled <= self.bound_s or not stack or entry == reported:
                continue
            reported = entry
            message = (
                f"{stack[-1]}: blocked the event loop for over {self.bound_s:g} s ({self.setting}); an "
                "async def must await (asyncio.sleep, not time.sleep) -- or write it as a plain def, "
                "which runs on a thread"
            )
            failure = type("EventLoopBlocked", (EventLoopBlocked,), {"detail": message})
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self._thread_id), ctypes.py_object(failure)
            )
            beat = self._beat
            # The failure is raised once the code runs Python again; if it stays in C (a sleep of
            # hours), the line is shown now rather than never.
            if not self._stop.wait(max(2.0, 8 * self._interval)) and self._beat == beat:
                print(f"error: {message}; the run stops when it returns", file=sys.stderr, flush=True)
