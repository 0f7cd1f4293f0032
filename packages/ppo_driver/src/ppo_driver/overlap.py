"""Whether a run overlaps its sleeps and wakes with other work (``offload.overlap``).

Overlapped (``PhaseTracker`` with ``overlap=True``), a role that the next phase does not need sleeps
in the background while that phase computes, and a role the phase after needs is woken ahead of it
(prefetch). Between the two, more is resident at once than in the sequential order: at worst every
role's state together (the start-up residency: "right after creation every role is resident") plus
the working memory of one phase (training activations, the engines' KV cache) and the optimizer
states the first step creates.

The rule (:func:`choose_overlap`):

* ``off``: sequential, as before overlap existed;
* ``on``: overlapped, memory not checked (the user vouches for it);
* ``auto``: overlapped only on ``cuda`` and only when, measured right after start-up with every role
  resident, every GPU the trainer roles sit on still has ``offload.overlap_headroom_gb`` free (null:
  half of that GPU's memory). The headroom must cover what start-up does not hold yet: the optimizer
  states (created in the first step), activations, the KV cache. Otherwise sequential. On ``cpu``
  auto is sequential: there is no shared GPU to measure, and CPU runs gain nothing from overlap.

Without offload nothing moves, so there is nothing to overlap. The loop prints the choice and why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

OverlapMode = Literal["auto", "on", "off"]
DEFAULT_HEADROOM_SHARE = 0.5  # of each GPU's memory, when offload.overlap_headroom_gb is null


@dataclass(frozen=True)
class OverlapChoice:
    overlap: bool
    reason: str

    def describe(self) -> str:
        return f"transitions: {'overlapped' if self.overlap else 'sequential'} ({self.reason})"


def choose_overlap(
    mode: OverlapMode,
    *,
    device: str,
    offload: bool,
    memory: Sequence[Mapping[str, float]],
    headroom_gb: float | None,
) -> OverlapChoice:
    """The rule in the module docstring. ``memory``: one reading per trainer rank (``memory_info()``:
    ``device_free`` and ``device_total`` in bytes), taken with every role resident."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"offload.overlap must be auto, on or off, got {mode!r}")
    if not offload:
        return OverlapChoice(False, "offload.enabled=false: every role stays resident, nothing moves")
    if mode == "off":
        return OverlapChoice(False, "offload.overlap=off")
    if mode == "on":
        return OverlapChoice(True, "offload.overlap=on; memory not checked")
    if device != "cuda":
        return OverlapChoice(
            False, f"offload.overlap=auto on placement.device={device}: no shared GPU to measure"
        )
    readings = [m for m in memory if "device_free" in m and "device_total" in m]
    if not readings or len(readings) != len(memory):
        return OverlapChoice(False, "offload.overlap=auto: a trainer rank reported no device memory")
    short = []
    for i, m in enumerate(readings):
        need = headroom_gb * 1e9 if headroom_gb is not None else DEFAULT_HEADROOM_SHARE * m["device_total"]
        if m["device_free"] < need:
            short.append(f"rank reading {i}: {m['device_free'] / 1e9:.1f} GB free < {need / 1e9:.1f} GB")
    if short:
        return OverlapChoice(
            False,
            "offload.overlap=auto: headroom short with every role resident ("
            + "; ".join(short)
            + "; offload.overlap_headroom_gb)",
        )
    least = min(m["device_free"] for m in readings)
    need_text = (
        f"{headroom_gb:.1f} GB" if headroom_gb is not None else f"{DEFAULT_HEADROOM_SHARE:.0%} of the GPU"
    )
    return OverlapChoice(
        True,
        f"offload.overlap=auto: every trainer GPU has >= {least / 1e9:.1f} GB free with every role "
        f"resident, headroom {need_text}",
    )
