"""What differs between the SGLang versions we support, read from the server's own version.

Supported: 0.5.15.post1 (slime's pin) to 0.5.23. Verified against the released source of 0.5.15.post1
and 0.5.23 (``sglang/srt/entrypoints/http_server.py``, ``managers/io_struct.py``,
``managers/tokenizer_manager.py``, ``managers/scheduler.py``, 0.5.23's
``managers/scheduler_components/weight_updater.py``); versions between take the nearer verified behaviour
(the session routes from 0.5.21, where SGLang introduced them).

- Weight-update session: from 0.5.21, ``update_weights_from_distributed`` answers ``success: false``
  unless it runs between ``POST /begin_weight_update`` and ``POST /end_weight_update`` (0.5.23
  ``scheduler_components/weight_updater.py``). Before, those routes do not exist.
- Weight version: ``GET /model_info`` (``weight_version``) in every version; ``/get_weight_version``
  answers 404 on 0.5.15.post1 and is gone on 0.5.23.
- Pause mode: ``{}`` means ``mode: "abort"`` (in-flight requests come back with
  ``finish_reason.type == "abort"``). ``retract`` holds them in the waiting queue, to be recomputed with
  the new weights after ``continue_generation``; it is usable only where ``flush_cache`` ignores the
  waiting queue while paused (0.5.23 ``Scheduler.flush_cache``: ``is_fully_idle(ignore_waiting=
  self._engine_paused)``). On 0.5.15.post1 a retracted request blocks every flush, so there we pause with
  ``abort`` and the client resubmits aborted requests (they wait in the tokenizer manager until
  ``continue_generation``, ``tokenizer_manager.py``), as slime does.
- Memory tags: ``kv_cache``, ``weights``, ``cuda_graph`` (``sglang/srt/constants.py``); neither release nor
  resume is idempotent (resume of a tag not released raises ``KeyError`` in the scheduler, release
  asserts the server is idle).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["MAX_VERSION", "MIN_VERSION", "SGLANG_MEMORY_TAGS", "SGLangProtocol", "parse_version"]

MIN_VERSION = "0.5.15.post1"
MAX_VERSION = "0.5.23"
SGLANG_MEMORY_TAGS: tuple[str, ...] = ("kv_cache", "weights", "cuda_graph")

_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.?post(\d+))?")


def parse_version(text: str) -> tuple[int, int, int, int]:
    """``"0.5.15.post1"`` -> ``(0, 5, 15, 1)``; local and dev suffixes are ignored."""
    match = _VERSION.match(text.strip().lstrip("v"))
    if match is None:
        raise ValueError(f"SGLang version {text!r} is not a version number like 0.5.23 or 0.5.15.post1")
    major, minor, patch, post = match.groups()
    return int(major), int(minor), int(patch), int(post or 0)


@dataclass(frozen=True)
class SGLangProtocol:
    """How to drive one SGLang server, from its version (``SGLangProtocol.for_version``)."""

    version: str
    weight_update_session: bool  # begin_weight_update / end_weight_update around every update
    pause_mode: str  # "abort" | "retract"
    weight_version_route: str = "/model_info"
    server_info_route: str = "/server_info"
    memory_tags: tuple[str, ...] = SGLANG_MEMORY_TAGS

    @classmethod
    def for_version(cls, version: str) -> SGLangProtocol:
        """The protocol of ``version``; ValueError naming it when it is outside what we support."""
        v = parse_version(version)
        if not parse_version(MIN_VERSION) <= v <= (*parse_version(MAX_VERSION)[:3], 99):
            raise ValueError(
                f"SGLang {version} is not supported: this adapter follows SGLang {MIN_VERSION} to "
                f"{MAX_VERSION}; install one of those (e.g. pip install sglang=={MAX_VERSION})"
            )
        return cls(
            version=version,
            weight_update_session=v >= (0, 5, 21, 0),
            pause_mode="retract" if v >= (0, 5, 23, 0) else "abort",
        )
