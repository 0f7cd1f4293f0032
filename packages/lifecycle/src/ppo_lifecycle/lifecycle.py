"""The resident/asleep state machine of one worker."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from enum import StrEnum

from ppo_lifecycle.memory.protocol import MemoryBackend
from ppo_lifecycle.process_groups import ProcessGroupSet
from ppo_lifecycle.stats import TransferStats

log = logging.getLogger(__name__)

StepObserver = Callable[[str], None]


class State(StrEnum):
    RESIDENT = "resident"
    SLEEPING = "sleeping"  # a sleep() failed midway; sleep() again continues it
    ASLEEP = "asleep"
    WAKING = "waking"  # a wake_up() failed midway; wake_up() again continues it


class Lifecycle:
    """Sleep and wake one worker, idempotently and retry-safely.

    ``sleep()``: pre-sleep hooks (in registration order) -> destroy process groups -> release memory.
    ``wake_up()``: restore memory -> reload process groups -> post-wake hooks.

    * ``sleep()`` while asleep is a logged no-op; ``wake_up()`` while resident only makes sure
      the process groups exist.
    * A step that raises leaves the machine in ``SLEEPING``/``WAKING``; calling the same method
      again resumes at the failed step: hooks that completed are not run again, and the memory
      backend and process groups skip what they already did (nothing is released or restored
      twice). Calling the *other* method from a half-way state runs its whole sequence, which is
      safe because every step is idempotent (hooks should be too: a disconnect of something
      already disconnected is a no-op).
    * ``observer`` (optional) is called with the step's name before each step:
      ``sleep/hook:<name>``, ``sleep/destroy_groups``, ``sleep/release``, ``wake/restore``,
      ``wake/reload_groups``, ``wake/hook:<name>``. An observer that raises fails that step.
    * Thread-safe: one lock serializes every call.
    """

    def __init__(
        self,
        memory: MemoryBackend,
        process_groups: ProcessGroupSet | None = None,
        name: str = "",
        *,
        tags: Sequence[str] | None = None,
        observer: StepObserver | None = None,
    ) -> None:
        self._memory = memory
        self._groups = process_groups
        self.name = name
        self._tags = list(tags) if tags is not None else None
        self._observer = observer
        self._pre_sleep: dict[str, Callable[[], None]] = {}
        self._post_wake: dict[str, Callable[[], None]] = {}
        self._state = State.RESIDENT
        self._done: set[str] = set()  # steps finished in the transition in progress
        self._lock = threading.RLock()
        self._metrics: dict[str, float] = {}

    # -- hooks -----------------------------------------------------------------------------
    def add_pre_sleep_hook(self, name: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` first thing in ``sleep()`` (e.g. disconnect from rollout engines)."""
        self._add_hook(self._pre_sleep, "pre-sleep", name, fn)

    def add_post_wake_hook(self, name: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` last thing in ``wake_up()`` (e.g. reconnect)."""
        self._add_hook(self._post_wake, "post-wake", name, fn)

    def _add_hook(
        self, table: dict[str, Callable[[], None]], kind: str, name: str, fn: Callable[[], None]
    ) -> None:
        if not name:
            raise ValueError(f"{kind} hook name must be a non-empty string")
        if not callable(fn):
            raise ValueError(f"{kind} hook {name!r}: fn must be callable")
        with self._lock:
            if name in table:
                raise ValueError(f"a {kind} hook named {name!r} is already registered; pick another name")
            table[name] = fn

    # -- state -----------------------------------------------------------------------------
    @property
    def state(self) -> State:
        return self._state

    @property
    def is_asleep(self) -> bool:
        """True unless fully resident (a half-done transition is not usable either)."""
        return self._state is not State.RESIDENT

    # -- transitions -----------------------------------------------------------------------
    def sleep(self) -> None:
        with self._lock:
            if self._state is State.ASLEEP:
                log.info("%s: sleep() while asleep: nothing to do", self._label())
                return
            if self._state is not State.SLEEPING:
                self._done = set()
            start = time.perf_counter()
            stats = TransferStats()
            try:
                for hook_name, fn in self._pre_sleep.items():
                    self._step(f"sleep/hook:{hook_name}", fn)
                if self._groups is not None:
                    self._step("sleep/destroy_groups", self._groups.destroy)
                stats = self._run_memory("sleep/release", self._memory.release)
            finally:
                self._account("sleep", time.perf_counter() - start, stats)
            self._state = State.ASLEEP
            self._done = set()
            self._bump("sleep/count")

    def wake_up(self) -> None:
        with self._lock:
            if self._state is State.RESIDENT:
                if self._groups is not None and not self._groups.is_alive:
                    self._groups.reload()
                return
            if self._state is not State.WAKING:
                self._done = set()
            start = time.perf_counter()
            stats = TransferStats()
            try:
                stats = self._run_memory("wake/restore", self._memory.restore)
                if self._groups is not None:
                    self._step("wake/reload_groups", self._groups.reload)
                for hook_name, fn in self._post_wake.items():
                    self._step(f"wake/hook:{hook_name}", fn)
            finally:
                self._account("wake", time.perf_counter() - start, stats)
            self._state = State.RESIDENT
            self._done = set()
            self._bump("wake/count")

    def pop_metrics(self) -> dict[str, float]:
        """Seconds, bytes and GB/s of the transitions since the last call, then reset.

        Keys: ``sleep/seconds``, ``sleep/bytes``, ``sleep/gb_per_s``, ``sleep/count`` and the
        same for ``wake``; seconds of a retried transition add up over its attempts. Each step's own
        seconds too, under the observer's step name: ``sleep/hook:<name>/seconds``,
        ``sleep/destroy_groups/seconds``, ``sleep/release/seconds``, ``wake/restore/seconds``,
        ``wake/reload_groups/seconds``, ``wake/hook:<name>/seconds`` (the fixed costs around the copy).
        """
        with self._lock:
            out = dict(self._metrics)
            for kind in ("sleep", "wake"):
                seconds = out.get(f"{kind}/memory_seconds", 0.0)
                nbytes = out.get(f"{kind}/bytes", 0.0)
                if seconds > 0 and nbytes > 0:
                    out[f"{kind}/gb_per_s"] = nbytes / seconds / 1e9
            self._metrics = {}
            return out

    # -- internals -------------------------------------------------------------------------
    def _step(self, name: str, fn: Callable[[], None]) -> None:
        if name in self._done:
            return
        self._enter(name)
        start = time.perf_counter()
        try:
            fn()
        finally:
            self._bump(f"{name}/seconds", time.perf_counter() - start)
        self._done.add(name)

    def _run_memory(self, name: str, fn: Callable[[Sequence[str] | None], TransferStats]) -> TransferStats:
        self._enter(name)
        start = time.perf_counter()
        try:
            stats = fn(self._tags)
        finally:
            self._bump(f"{name}/seconds", time.perf_counter() - start)
        self._done.add(name)
        return stats

    def _enter(self, name: str) -> None:
        # From here on the transition is under way: a failure leaves the half-way state.
        if name.startswith("sleep/"):
            self._state = State.SLEEPING
        else:
            self._state = State.WAKING
        if self._observer is not None:
            self._observer(name)

    def _account(self, kind: str, seconds: float, stats: TransferStats) -> None:
        self._bump(f"{kind}/seconds", seconds)
        self._bump(f"{kind}/bytes", float(stats.bytes))
        self._bump(f"{kind}/memory_seconds", stats.seconds)

    def _bump(self, key: str, value: float = 1.0) -> None:
        self._metrics[key] = self._metrics.get(key, 0.0) + value

    def _label(self) -> str:
        return f"Lifecycle({self.name})" if self.name else "Lifecycle"
