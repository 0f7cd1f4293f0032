"""Which user code runs on the rollout's event loop now: :func:`user_code` marks each step of a user's
coroutine, so that ``loop_watch`` can name the code that blocks the loop."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Coroutine, Generator
from typing import Any, TypeVar

__all__ = ["current_marks", "forget_marks", "user_code"]

T = TypeVar("T")


class _Marks:
    """What user code runs on the loop thread now (innermost last), for the watching thread."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.entries = 0  # counts entries, so that a watch reports one blocking once


_MARKS: dict[int, _Marks] = {}  # by loop thread id


def current_marks() -> _Marks:
    """The marks of the calling thread's loop."""
    return _MARKS.setdefault(threading.get_ident(), _Marks())


class _UserCode:
    """Awaits ``coro``, marking each of its steps on the loop as ``where``'s."""

    def __init__(self, coro: Awaitable[T], where: str) -> None:
        self._coro = coro
        self._where = where

    def __await__(self) -> Generator[Any, Any, Any]:
        marks = current_marks()
        inner = self._coro.__await__()
        value: Any = None
        error: BaseException | None = None
        while True:
            marks.stack.append(self._where)
            marks.entries += 1
            try:
                yielded = inner.throw(error) if error is not None else inner.send(value)
            except StopIteration as stop:
                return stop.value
            finally:
                marks.stack.pop()
            try:
                value, error = (yield yielded), None
            except BaseException as exc:  # cancellation and the like reach the user's coroutine
                value, error = None, exc


def user_code(coro: Coroutine[Any, Any, T], where: str) -> Coroutine[Any, Any, T]:
    """``coro`` marked as ``where``'s while it runs on the loop (see :class:`LoopWatch`)."""

    async def marked() -> T:
        result: T = await _UserCode(coro, where)
        return result

    return marked()


def forget_marks(thread_id: int) -> None:
    _MARKS.pop(thread_id, None)
