"""What stops a run, and how the stop is reported: one message naming the step, the phase, what
failed and the checkpoint a re-run resumes from.

- ``RunFailed``: a step failed (a role's process died, a non-finite loss, a full disk, ...).
- ``NonFiniteError``: a role reported a non-finite loss or gradient norm, or its worker refused to
  save or send non-finite weights; raised before the step's weights are saved or sent to the engines.
- ``Interrupted``: SIGINT or SIGTERM arrived; the loop stopped after saving at the end of a step.
- ``StopSignals``: turns the first SIGINT/SIGTERM into a request the loop checks between steps; a
  second one stops the run at once (``on_second``: the loop ends every process it started and exits).
"""

from __future__ import annotations

import math
import re
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from ray.exceptions import RayTaskError


class NonFiniteError(RuntimeError):
    """``names``: the non-finite metrics and their values; or ``weights``: the rank and tensor names a
    role's worker refused to save or send (``ppo_trainer.NonFiniteWeightsError``)."""

    def __init__(
        self,
        role: str,
        step: int,
        names: Mapping[str, Any],
        *,
        weights: tuple[int, Sequence[str]] | None = None,
    ) -> None:
        shown = ", ".join(f"{k}={v}" for k, v in names.items())
        if weights is not None:
            rank, tensors = weights
            listed = ", ".join(tensors[:5]) + (f" and {len(tensors) - 5} more" if len(tensors) > 5 else "")
            shown = f"weights of rank {rank}: {listed}"
        super().__init__(
            f"the {role} reported non-finite values at step {step} ({shown}); its weights of this step "
            "were neither saved nor sent to the engines. Look for rewards of huge magnitude, or lower "
            "train.actor_lr / train.critic_lr"
        )
        self.role = role
        self.step = step


# Metrics whose non-finite value means the role's weights are no longer usable.
_WATCHED = ("loss", "grad_norm")


def check_finite(role: str, step: int, metrics: Mapping[str, Any]) -> None:
    bad = {
        key: value
        for key, value in metrics.items()
        if any(w in key.rsplit("/", 1)[-1] for w in _WATCHED)
        and isinstance(value, int | float)
        and not math.isfinite(value)
    }
    if bad:
        raise NonFiniteError(role, step, bad)


def resume_hint(checkpoint: tuple[int, Path] | None) -> str:
    if checkpoint is None:
        return "no complete checkpoint exists yet: a re-run of the same command starts from step 0"
    step, folder = checkpoint
    return f"a re-run of the same command resumes from {folder} (step {step})"


# Terminal colour codes: Ray colours the worker's name in the text of its task errors.
_ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_TRACEBACK = "Traceback (most recent call last):"


def one_line(error: BaseException) -> str:
    """``error`` as one line, ``Type: message``. An error a Ray worker raised is reported as the
    worker's own exception (Ray's ``RayTaskError(X)`` wraps it with a header, the worker's traceback
    and colour codes); a message of several lines is joined, a traceback in it reduced to its last
    line (the exception)."""
    seen = error
    while isinstance(seen, RayTaskError) and seen.cause is not None and seen.cause is not seen:
        seen = seen.cause
    if isinstance(seen, OSError) and seen.strerror:  # not "[Errno 28] ...": the message alone
        text = seen.strerror + (f": {seen.filename}" if seen.filename else "")
    else:
        text = str(seen)
    text = _ESCAPES.sub("", text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if any(line.startswith(_TRACEBACK) for line in lines):
        lines = lines[-1:]
    name = type(seen).__name__
    if isinstance(seen, RayTaskError):  # no cause to unwrap: its class name holds Ray's decoration
        name = "RayTaskError"
    return f"{name}: {' '.join(lines)}" if not isinstance(seen, NonFiniteError) else " ".join(lines)


class RunFailed(RuntimeError):
    """A step failed; ``str()`` is the whole report, in one line; ``__cause__`` the original error."""

    def __init__(self, step: int, phase: str, error: BaseException, resume: str) -> None:
        super().__init__(
            f"the run stopped at step {step}, phase {phase}: {one_line(error)}; "
            f"every process the run started was ended; {resume}"
        )
        self.step = step
        self.phase = phase
        self.traceback_file: Path | None = None  # where the CLI wrote the traceback, once it has


class Interrupted(Exception):
    """SIGINT/SIGTERM stopped the run at a safe point (after step ``step``, saved)."""

    def __init__(self, signum: int, step: int, resume: str) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; {resume}")
        self.signum = signum
        self.step = step


def echo_first(signum: int) -> None:
    """Say that the first signal was heard: the run goes on to the end of its step, which can take
    minutes, and a user who sees nothing presses Ctrl-C again."""
    name = signal.Signals(signum).name
    again = "Ctrl-C" if signum == signal.SIGINT else name
    sys.stderr.write(f"{name}: stopping after this step (saved there); {again} again to stop now\n")
    sys.stderr.flush()


class StopSignals:
    """Within the block, the first SIGINT/SIGTERM sets ``requested``; a second one calls ``on_second``
    (which does not return: it ends the run's processes and exits), or without it raises
    ``KeyboardInterrupt`` as Python's default does.

    With ``on_second``, signals are counted by a thread reading the interpreter's wakeup fd, which
    gets one byte per signal delivered: Python runs a handler only when the main thread next runs
    bytecode, and two signals that arrive while it waits inside a C call (a long ``ray.get``) would
    run it once, so a second Ctrl-C would read as the first.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, on_second: Callable[[int], None] | None = None) -> None:
        self.requested: int | None = None
        self._on_second = on_second
        self._previous: dict[int, Any] = {}
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._previous_fd = -1

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._wakeup is not None:  # the counting thread decides
            self.requested = self.requested or signum
            return
        if self.requested is not None:  # asked twice: stop now
            self._restore()
            raise KeyboardInterrupt
        self.requested = signum
        echo_first(signum)

    def _count(self, reader: socket.socket) -> None:
        seen = 0
        while True:
            try:
                data = reader.recv(64)
            except OSError:  # closed on exit from the block
                return
            if not data:
                return
            for signum in data:
                if signum not in self.SIGNALS:
                    continue
                seen += 1
                self.requested = self.requested or signum
                if seen == 1:
                    echo_first(signum)
                if seen >= 2 and self._on_second is not None:
                    self._on_second(signum)

    def __enter__(self) -> StopSignals:
        try:
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: signals stay as they are
            self._previous.clear()
            return self
        if self._on_second is not None:
            reader, writer = socket.socketpair()
            writer.setblocking(False)  # the interpreter's C handler must never block
            self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            self._wakeup = (reader, writer)
            threading.Thread(target=self._count, args=(reader,), name="stop-signals", daemon=True).start()
        return self

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_fd)
            for end in reversed(self._wakeup):
                end.close()  # the writer first: the counting thread's recv sees the end
            self._wakeup = None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._restore()
