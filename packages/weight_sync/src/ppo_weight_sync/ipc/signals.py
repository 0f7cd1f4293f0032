"""Per-bucket signals between a sender and an engine on the same host, without a message per bucket.

A colocated update in ``ppo_ipc_stream`` (see :mod:`.payload`) is one request per update; the buckets
then move through the two shared GPU buffers, and the two processes tell each other where they are by
three 64-bit counters in a small shared file (``/dev/shm`` where there is one), mapped by both:

- ``packed`` (sender): buckets ``0 .. packed-1`` are in their buffer, ready to be copied out;
- ``loaded`` (engine): buckets ``0 .. loaded-1`` are copied out; their buffer may be packed again;
- ``abort`` (sender): the sender gave up on this update; the engine stops waiting at once.

Every connection has its own file, and the sender zeroes the counters before it posts an update, after
the previous update's request answered, so no engine thread of an earlier update can still write them
(a failed update resets the connection, and with it the file).

The file and its bounded waits are a :class:`~.counters.SharedCounters`; colocated processes share a
host by definition, so shared memory is always there.
"""

from __future__ import annotations

from ppo_weight_sync.ipc.counters import SharedCounters

__all__ = ["BucketSignals"]


class BucketSignals(SharedCounters):
    """The shared counters of one sender's colocated connection: :meth:`create` on the sender (it owns
    and removes the file), :meth:`attach` on the engine (ValueError naming the path when there is no
    such file); :meth:`wait_at_least` is bounded and says what it waited for."""

    FIELDS = ("packed", "loaded", "abort")
    PREFIX = "ppo-ipc-signals"
    LABEL = "a sender's signal file"

    def start(self) -> None:
        """The sender, before it posts an update: every counter back to zero."""
        self.set("abort", 0)
        self.set("packed", 0)
        self.set("loaded", 0)
