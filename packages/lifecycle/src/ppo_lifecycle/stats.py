"""What one memory transfer cost: bytes moved and seconds spent."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransferStats:
    """Bytes moved between device and host (or freed/restored on the device) and the time it took.

    ``tensors`` counts storages moved; a backend that cannot see individual storages
    (torch_memory_saver without tracked tensors) reports the device bytes it freed and 0 storages.
    """

    bytes: int = 0
    seconds: float = 0.0
    tensors: int = 0

    def __add__(self, other: TransferStats) -> TransferStats:
        return TransferStats(
            bytes=self.bytes + other.bytes,
            seconds=self.seconds + other.seconds,
            tensors=self.tensors + other.tensors,
        )

    @property
    def gb_per_s(self) -> float:
        """Throughput in GB/s (10^9 bytes per second); 0 when nothing moved."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 and self.bytes > 0 else 0.0
