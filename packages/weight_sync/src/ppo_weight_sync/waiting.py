"""The one bounded polling wait every cross-process and GPU wait of this package is built on.

A blocking wait (``event.synchronize()``, ``work.wait()`` on NCCL, a read of a peer's counter in a loop
without a clock) can hang forever when a peer died or a kernel waits on a peer that never sends. Every
wait here polls a condition instead, runs the caller's ``check`` between polls (a peer's failed call ends
the wait early), and after its deadline raises ``TimeoutError`` with a message that says what was awaited
and, made at that moment, how far it got.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_until"]


def wait_until(
    done: Callable[[], bool],
    timeout_s: float,
    timeout_message: Callable[[], str],
    *,
    poll_s: float,
    check: Callable[[], None] | None = None,
) -> None:
    """Return once ``done()`` is true; it is asked first, so a wait for something finished costs one call.

    Between polls (``poll_s`` apart) ``check()`` runs when given; it raises to end the wait. After
    ``timeout_s`` seconds: ``TimeoutError(timeout_message())`` (made then, so it can report progress).
    """
    if done():
        return
    deadline = time.monotonic() + timeout_s
    while not done():
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(timeout_message())
        time.sleep(poll_s)
