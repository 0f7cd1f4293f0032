"""What differs between the SGLang versions we support, read from the server's own version.

Supported: 0.5.15.post1 (slime's pin) to 0.5.23. The table below was read from the released source of
every version in that range (0.5.15.post1, 0.5.16 .. 0.5.22, 0.5.23: ``sglang/srt/entrypoints/
http_server.py``, ``managers/io_struct.py``, ``managers/scheduler.py``,
``managers/scheduler_components/weight_updater.py``, ``model_executor/`` and ``utils/common.py``); every
change we depend on happened at 0.5.21 (the LoRA payload below at 0.5.17), nothing we use changed
between 0.5.15.post1 and 0.5.20 or between 0.5.21 and 0.5.23.

=================================================  ====================  ===================
behaviour                                          0.5.15.post1..0.5.20  0.5.21..0.5.23
=================================================  ====================  ===================
``/begin_weight_update``, ``/end_weight_update``   no route (404)        required around
                                                                         every update
``GET /get_weight_version``                        404 "deprecated"      no route (404)
weight version                                     ``/model_info``       ``/model_info``
``flush_cache`` / ``release_memory_occupation``    ``is_fully_idle()``   ``is_fully_idle(
idle check while paused                            (waiting counts)      ignore_waiting=paused)``
pause mode we use                                  ``abort``             ``retract``
update on a group that does not exist              assert: server dies   ``success: false``
``/server_info`` (``version``, ``tp_size``,        yes                   yes
``dp_size``, ``pp_size``)
pause modes ``abort`` / ``retract`` / ``in_place``   all three             all three
=================================================  ====================  ===================

- LoRA adapters from tensors (``/load_lora_adapter_from_tensors``, :mod:`ppo_weight_sync.sglang_lora`):
  0.5.15.post1 and 0.5.16 take one base64 payload in ``serialized_tensors``; from 0.5.17
  ``serialized_named_tensors`` holds one per TP rank, each rank reading its own
  (``managers/io_struct.py`` ``LoadLoRAAdapterFromTensorsReqInput``, ``managers/tp_worker.py``).
- Weight-update session: from 0.5.21, ``update_weights_from_distributed`` answers ``success: false``
  unless it runs between ``POST /begin_weight_update`` and ``POST /end_weight_update``
  (``scheduler_components/weight_updater.py``).
- Pause mode: ``{}`` means ``mode: "abort"`` (in-flight requests come back with
  ``finish_reason.type == "abort"``). ``retract`` holds them in the waiting queue, to be recomputed with
  the new weights after ``continue_generation``; it is usable only where ``flush_cache`` ignores the
  waiting queue while paused (``Scheduler.flush_cache``: ``is_fully_idle(ignore_waiting=
  self._engine_paused)``, from 0.5.21). Before, a retracted request blocks every flush, so there we pause
  with ``abort`` and the client resubmits aborted requests (they wait in the tokenizer manager until
  ``continue_generation``), as slime does.
- Memory tags: ``kv_cache``, ``weights``, ``cuda_graph`` (``sglang/srt/constants.py``); neither release nor
  resume is idempotent: resume of a tag not released raises ``KeyError`` in the scheduler, and release
  asserts the scheduler is idle (the same idle check as ``flush_cache``); a failed assert in the
  scheduler process sends SIGQUIT to the server, which kills its whole process tree: the HTTP request
  gets no answer at all.
- Tensor parallelism: every TP rank joins the weight group at ``rank_offset + tp_rank``
  (``init_weights_update_group``), receives every tensor whole and loads its own shard;
  ``update_weights_from_tensor`` gives TP rank ``i`` entry ``i`` of ``serialized_named_tensors``. The
  server's ``tp_size`` is in ``/server_info``. A server with ``dp_size`` or ``pp_size`` above 1 is refused:
  its DP replicas (or pipeline stages) would join at the same ranks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_VERSION",
    "MIN_VERSION",
    "SGLANG_MEMORY_TAGS",
    "SGLangProtocol",
    "group_ranks_of",
    "parse_version",
]

MIN_VERSION = "0.5.15.post1"
MAX_VERSION = "0.5.23"
SGLANG_MEMORY_TAGS: tuple[str, ...] = ("kv_cache", "weights", "cuda_graph")

# The boundaries in the supported range (see the table above).
SESSION_VERSION = (0, 5, 21, 0)
LORA_PER_RANK_VERSION = (0, 5, 17, 0)  # LoRA adapters from tensors: one payload per TP rank

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
    # flush_cache and release_memory_occupation ignore the waiting queue while paused (>= 0.5.21)
    idle_ignores_waiting_when_paused: bool = False
    # an update naming a group that does not exist fails an assert in the scheduler (< 0.5.21): fatal
    missing_group_is_fatal: bool = True
    weight_version_route: str = "/model_info"
    server_info_route: str = "/server_info"
    memory_tags: tuple[str, ...] = SGLANG_MEMORY_TAGS
    # /load_lora_adapter_from_tensors takes ``serialized_named_tensors``, one entry per TP rank (>= 0.5.17)
    lora_payload_per_rank: bool = True

    @classmethod
    def for_version(cls, version: str) -> SGLangProtocol:
        """The protocol of ``version``; ValueError naming it when it is outside what we support."""
        v = parse_version(version)
        if not parse_version(MIN_VERSION) <= v <= (*parse_version(MAX_VERSION)[:3], 99):
            raise ValueError(
                f"SGLang {version} is not supported: this adapter follows SGLang {MIN_VERSION} to "
                f"{MAX_VERSION}; install one of those (e.g. pip install sglang=={MAX_VERSION})"
            )
        since_21 = v >= SESSION_VERSION
        return cls(
            version=version,
            weight_update_session=since_21,
            pause_mode="retract" if since_21 else "abort",
            idle_ignores_waiting_when_paused=since_21,
            missing_group_is_fatal=not since_21,
            lora_payload_per_rank=v >= LORA_PER_RANK_VERSION,
        )


def group_ranks_of(server_info: Mapping[str, Any], where: str) -> int:
    """How many ranks the server at ``where`` adds to a weight group: its ``tp_size`` from
    ``GET /server_info`` (every TP rank joins at ``rank_offset + tp_rank``). ValueError for a server whose
    data-parallel replicas or pipeline stages would join at the same ranks (``dp_size`` or ``pp_size``
    above 1): give each replica its own server instead."""
    tp = server_info.get("tp_size", 1)
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"SGLang server {where}: /server_info has tp_size {tp!r}, not an int >= 1")
    for field in ("dp_size", "pp_size"):
        size = server_info.get(field, 1)
        if size not in (None, 1):
            raise ValueError(
                f"SGLang server {where} runs with {field}={size}: its replicas would join the weight group "
                "at the same ranks (rank_offset + tp_rank); launch one server per replica "
                "(dp_size=1, pp_size=1)"
            )
    return tp
