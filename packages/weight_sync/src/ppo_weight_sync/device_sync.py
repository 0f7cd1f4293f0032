"""Bounded host-side waits for CUDA work, so that "done" on the host means the GPU finished.

``work.wait()`` of an NCCL collective only makes the *current stream* wait for the NCCL stream; the host
runs on. A reply sent right after it says nothing about whether the bytes arrived, and a later blocking
copy (``tensor.cpu()``) or ``torch.cuda.synchronize()`` then blocks without bound if a kernel waits on a
peer that never sends. These helpers wait by polling a CUDA event instead, with a deadline that names what
was waited for; CPU devices return at once (gloo's ``wait`` is already a host wait).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from ppo_weight_sync.waiting import wait_until

__all__ = ["on_device", "wait_stream"]

_POLL_S = 0.0005


def on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` current in this thread (server and pool threads start on cuda:0)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def wait_stream(
    device: torch.device,
    timeout_s: float,
    what: str,
    check: Callable[[], None] | None = None,
    poll_s: float = _POLL_S,
) -> None:
    """Wait on the host until every kernel queued so far on ``device``'s current stream has finished.

    Polls an event recorded now (never a blocking sync, so the wait stays bounded); ``check`` runs between
    polls (it may raise to end the wait early, e.g. when a peer's call failed). Raises ``TimeoutError``
    naming ``what`` after ``timeout_s``. ``poll_s``: the pause between polls (a colocated bucket's
    copy takes well under a millisecond, so its wait polls finer than a broadcast's).
    """
    if device.type != "cuda":
        return
    with torch.cuda.device(device):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        wait_until(
            event.query,
            timeout_s,
            lambda: (
                f"{what}: GPU work on {device} did not finish within {timeout_s:g} s (a kernel is "
                "waiting on a peer that did not send or receive)"
            ),
            poll_s=poll_s,
            check=check,
        )
