"""The stand-in's prefix cache: how many prompt tokens SGLang's radix cache would serve from memory.

SGLang keeps every finished request's tokens in a radix tree (``mem_cache/radix_cache.py``, pages of one
token, ``--page-size 1``) keyed by the LoRA adapter too; a new request reuses its longest cached prefix, at
most ``len(prompt) - 1`` tokens (0.5.17 ``managers/schedule_batch.py`` ``_compute_max_prefix_len``: the
last one is computed again for its log-prob). Requests of one ``/generate`` call are prefilled in one
batch, so they look up the cache as it was when the call came. ``flush_cache`` and a release of the
``kv_cache`` tag empty it (``scheduler_components/weight_updater.py``). The count is what ``meta_info``
reports as ``cached_tokens`` and ``cached_tokens_details`` (``scheduler_components/output_streamer.py``
``get_cached_tokens_details``: ``None`` for none, else ``{"device": n, "host": 0}`` without a host cache).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

__all__ = ["PrefixCache", "cached_tokens_details"]


def cached_tokens_details(cached: int) -> dict[str, int] | None:
    return {"device": cached, "host": 0} if cached > 0 else None


class PrefixCache:
    """Token sequences by key (the adapter a request used), oldest dropped first past ``capacity``."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[Hashable, tuple[int, ...]], None] = OrderedDict()
        self._lock = threading.Lock()

    def match(self, key: Hashable, prompt: Sequence[int]) -> int:
        """The prompt tokens the cache serves: its longest cached prefix, at most ``len(prompt) - 1``."""
        limit = max(len(prompt) - 1, 0)
        prompt = tuple(prompt)
        best = 0
        with self._lock:
            for entry_key, tokens in self._entries:
                if entry_key != key:
                    continue
                n = 0
                for a, b in zip(tokens, prompt[:limit], strict=False):
                    if a != b:
                        break
                    n += 1
                best = max(best, n)
        return best

    def insert(self, key: Hashable, tokens: Sequence[int]) -> None:
        with self._lock:
            entry: tuple[Any, tuple[int, ...]] = (key, tuple(tokens))
            self._entries.pop(entry, None)
            self._entries[entry] = None
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
