"""UpdateLock: one weight update at a time across every sender that shares engines.

Two overlapping updates would interleave their broadcasts on the engines' groups. In one process a
:class:`ThreadUpdateLock` is enough (every sender in a process shares :data:`PROCESS_LOCK` by default);
senders in several processes share a :class:`RayUpdateLock`, a named Ray actor (the ``ray`` extra).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Protocol, runtime_checkable

__all__ = ["PROCESS_LOCK", "RayUpdateLock", "ThreadUpdateLock", "UpdateLock"]


@runtime_checkable
class UpdateLock(Protocol):
    def acquire(self, timeout_s: float) -> None:
        """Take the lock or raise ``TimeoutError`` after ``timeout_s`` seconds, saying who waited."""

    def release(self) -> None:
        """Give the lock back; releasing a lock not held is a no-op."""


class ThreadUpdateLock:
    """A process-local lock."""

    def __init__(self, name: str = "weight-update") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._owner: int | None = None

    def acquire(self, timeout_s: float) -> None:
        if not self._lock.acquire(timeout=timeout_s):
            raise TimeoutError(
                f"update lock {self.name!r}: another weight update held it for more than {timeout_s:g} s"
            )
        self._owner = threading.get_ident()

    def release(self) -> None:
        if self._owner is not None:
            self._owner = None
            self._lock.release()


PROCESS_LOCK = ThreadUpdateLock("process")


class _LockState:
    """Body of the Ray lock actor: an owner token with a lease, so a holder that died frees it in time."""

    def __init__(self) -> None:
        self.owner: str | None = None
        self.expires = 0.0

    def try_acquire(self, owner: str, lease_s: float) -> bool:
        now = time.monotonic()
        if self.owner is None or self.owner == owner or now >= self.expires:
            self.owner, self.expires = owner, now + lease_s
            return True
        return False

    def release(self, owner: str) -> bool:
        if self.owner == owner:
            self.owner = None
            return True
        return False

    def holder(self) -> str | None:
        return self.owner


class RayUpdateLock:
    """A lock shared by every process of a Ray cluster, held by a named actor (created on first use).

    ``lease_s`` bounds how long a holder may keep it: a sender that died while holding it stops blocking
    the others once the lease ends. Set it above the longest update.
    """

    def __init__(
        self, name: str = "ppo_weight_sync_update_lock", namespace: str | None = None, lease_s: float = 900.0
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.name, self.namespace, self.lease_s = name, namespace, lease_s
        self._token = uuid.uuid4().hex
        self._actor: Any = None

    def _handle(self) -> Any:
        if self._actor is None:
            import ray

            actor_cls = ray.remote(num_cpus=0, max_restarts=-1)(_LockState)
            self._actor = actor_cls.options(
                name=self.name, namespace=self.namespace, get_if_exists=True, lifetime="detached"
            ).remote()
        return self._actor

    def acquire(self, timeout_s: float) -> None:
        import ray

        deadline = time.monotonic() + timeout_s
        delay = 0.005
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"Ray update lock {self.name!r}: not free within {timeout_s:g} s")
            try:
                got = ray.get(self._handle().try_acquire.remote(self._token, self.lease_s), timeout=left)
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(
                    f"Ray update lock {self.name!r}: the lock actor did not answer within {timeout_s:g} s"
                ) from None
            if got:
                return
            time.sleep(min(delay, max(deadline - time.monotonic(), 0)))
            delay = min(delay * 2, 0.2)

    def release(self) -> None:
        import ray

        if self._actor is not None:
            ray.get(self._actor.release.remote(self._token), timeout=60)
