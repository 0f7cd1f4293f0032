"""One worker rank's checkpoints: the three kinds of save, the load, and the commit.

- resident (``save``): the backend's ``CheckpointIO`` writes this rank's part now (``torch_io`` or
  ``megatron_io``; collectives on sharded layouts);
- asleep, replicated (``save_async``): ``torch_io.capture`` reads the host copies the sleep made and a
  ``BackgroundSave`` thread writes them while the worker goes on;
- asleep, FSDP2-sharded (``save_async``): ``sharded.capture_shards`` notes each rank's host copies and
  the thread gathers them to rank 0 over the role's ``SaveGroup``.

One save at a time: a new save or a load first waits for the previous background one, and a sleep
waits until its writer no longer reads the host buffers the sleep is about to overwrite.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from ppo_lifecycle.memory.host import HostMemoryBackend
from ppo_lifecycle.memory.protocol import HostCopies, MemoryBackend
from ppo_trainer.backend_protocol import TrainerBackend
from ppo_trainer.checkpoint import format as fmt
from ppo_trainer.checkpoint import megatron_io, sharded, torch_io
from ppo_trainer.checkpoint.background import BackgroundSave
from ppo_trainer.checkpoint.protocol import TorchCheckpointable
from ppo_trainer.config import TrainerConfig


class RankCheckpoints:
    """The checkpoints of one rank of a role (``name``, for logs and thread names)."""

    def __init__(self, config: TrainerConfig, name: str, timeout_s: float) -> None:
        self.config = config
        self.name = name
        self.timeout_s = timeout_s
        # The torch backend's checkpoint code, or the megatron backend's (same files, HF names).
        self._io: fmt.CheckpointIO = megatron_io if config.backend == "megatron" else torch_io
        self._pending: BackgroundSave | None = None  # a checkpoint shard being written from host copies
        self._group: sharded.SaveGroup | None = None  # a sharded role's writers' own group

    def open_save_group(self, store: dist.Store, rank: int, world_size: int, master: str) -> None:
        """Build the gloo group the writers of an asleep sharded role gather on (collective: every rank
        of the role calls it at setup, while its groups are up)."""
        self._group = sharded.SaveGroup(store, rank, world_size, master, self.timeout_s)

    def saves_asleep(self, trainer: TrainerBackend, memory: MemoryBackend | None) -> bool:
        """Whether ``save_async`` can write from the host copies of a sleep: the torch backend on a
        memory backend that keeps them (a sharded role gathers its shards over its save group; the
        megatron backend converts to Hugging Face names while resident)."""
        return (
            self.config.backend == "torch"
            and (not trainer.sharded or self._group is not None)
            and isinstance(memory, HostCopies)
            and memory.keeps_host_copies
        )

    @property
    def save_group(self) -> sharded.SaveGroup | None:
        """The gloo group an asleep sharded role's writers gather on (None: not opened)."""
        return self._group

    @property
    def background(self) -> BackgroundSave | None:
        """The background save not yet waited for (its timings), if any."""
        return self._pending

    @property
    def pending(self) -> bool:
        """Whether a background save is still writing."""
        return self._pending is not None and not self._pending.done

    # ------------------------------------------------------------------ saving
    def save(self, trainer: TrainerBackend, staging: Path, step: int | None) -> None:
        """This rank's part, resident, now (after any background save)."""
        self.wait()
        self._io.save_shard(trainer, staging, step)

    def save_async(
        self, trainer: TrainerBackend, memory: HostCopies, staging: Path, step: int | None
    ) -> dict[str, float]:
        """Start writing this rank's part from the host copies of the last sleep, in a thread; returns
        the capture's seconds and the bytes it writes. The caller checked ``saves_asleep``."""
        self.wait()
        start = time.perf_counter()
        if not isinstance(trainer, TorchCheckpointable):
            raise TypeError(f"{self.name}: saves from host copies are the torch backend's")
        state: torch_io.ShardState | sharded.ShardedCapture
        if self._group is not None:  # sharded: the writers gather the shards on their own group
            state = sharded.capture_shards(trainer, step, memory, self._group)
        else:
            state = torch_io.capture(trainer, step, host=memory)
        # The pinned backends reuse their buffers at the next sleep: the writer copies them first.
        reused = not isinstance(memory, HostMemoryBackend)
        self._pending = BackgroundSave(state, staging, name=self.name, copy_first=reused)
        return {"capture_seconds": time.perf_counter() - start, "bytes": float(state.nbytes)}

    def done(self) -> bool:
        """Whether the background save is finished (True when there is none); raises its error."""
        if self._pending is None:
            return True
        if not self._pending.done:
            return False
        self._pending.result(0.0)  # raises the writer's error
        return True

    def wait(self) -> float:
        """Wait (at most ``timeout_s``) until the background save is on disk; its writer's seconds."""
        if self._pending is None:
            return 0.0
        pending, self._pending = self._pending, None
        return pending.result(self.timeout_s)

    def before_sleep(self, memory: MemoryBackend | None) -> None:
        """The next release writes the host buffers a background save may still be reading: wait for
        its reading. The host backend gives every release fresh buffers: its writer reads the previous
        ones on (host memory holds both until the files are written) and the loop does not wait."""
        if self._pending is not None and not isinstance(memory, HostMemoryBackend):
            self._pending.wait_reading(self.timeout_s)

    # ------------------------------------------------------------------ loading and committing
    def load(self, trainer: TrainerBackend, folder: Path) -> int | None:
        """Restore a ``<role>/`` folder (after any background save); the step it was saved at."""
        self.wait()
        return self._io.load_shard(trainer, folder)

    @staticmethod
    def commit(staging: Path, final: Path) -> None:
        fmt.commit(staging, final)
