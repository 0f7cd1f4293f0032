"""megatron-core's process groups, made through ``ppo_lifecycle.process_groups.ReloadableProcessGroups``.

``parallel_state.initialize_model_parallel`` creates every group through its ``create_group``; while
it runs, that function is replaced by one that asks ``ReloadableProcessGroups.new_group`` instead, so
the lifecycle destroys those groups on sleep and rebuilds them (same ranks, backend, timeout and
options, in creation order) on wake.

Groups over the same ranks (and backend and timeout) are one group (``new_group(share=True)``):
megatron asks for ~20 (TP, DP, DP-with-CP, MP, embedding, expert, ...), and without expert, pipeline
or context parallelism most of them cover the same ranks (every one of them on one GPU). Each
distinct group is a ``ProcessGroup`` to shut down at every sleep and make again at every wake, and
its NCCL communicator (once a collective used it) one to destroy and initialise again; one
communicator per rank set is all that megatron's collectives need, since every member issues them
in the same order.

A rebuilt group is a new object, and megatron keeps the old ones: in ``parallel_state``'s globals and
in the attributes of its layers, DDP buckets and optimizer (``tp_group``, ``pg_collection``, ...).
:meth:`MegatronGroups.rebind` walks those objects after a rebuild and swaps each destroyed group for
its rebuilt twin (matched by identity), the way ``sharding.rebind_process_groups`` does for FSDP.

Imports megatron lazily: the module itself loads without it.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ppo_lifecycle.process_groups import GroupHandle, ReloadableProcessGroups

_MAX_DEPTH = 16
# Never hold a process group inside: not walked.
_LEAVES = (
    torch.Tensor,
    str,
    bytes,
    int,
    float,
    bool,
    type,
    types.ModuleType,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
)


class MegatronGroups:
    """The megatron groups of one process, recorded as lifecycle handles."""

    def __init__(self, groups: ReloadableProcessGroups, *, share: bool = True) -> None:
        self.groups = groups
        self.share = share  # False: one group per megatron request, as megatron makes them itself
        self.handles: list[GroupHandle] = []
        self._bound: list[Any] = []  # the group objects megatron holds now, one per handle

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """While active, megatron's ``create_group`` makes reloadable groups."""
        from megatron.core import parallel_state

        original = parallel_state.create_group

        def create_group(
            ranks: list[int] | None = None,
            timeout: timedelta | None = None,
            backend: str | None = None,
            pg_options: Any = None,
            use_local_synchronization: bool = False,
            group_desc: str | None = None,
        ) -> Any:
            # use_local_synchronization and group_desc only tune torch's rendezvous and logging; the
            # lifecycle rebuilds every group with all ranks taking part, as new_group requires.
            del use_local_synchronization, group_desc
            handle = self.groups.new_group(
                ranks, backend=backend, timeout=timeout, pg_options=pg_options, share=self.share
            )
            self.handles.append(handle)
            group = handle.group
            self._bound.append(group)
            return group

        parallel_state.create_group = create_group
        try:
            yield
        finally:
            parallel_state.create_group = original

    def rebind(self, *roots: object) -> int:
        """Swap every destroyed group megatron holds (``parallel_state`` and ``roots``) for the live one.

        Returns how many references were swapped. Call after ``ReloadableProcessGroups.reload()``.
        """
        from megatron.core import parallel_state

        live = [h.group for h in self.handles]
        swap = {id(old): new for old, new in zip(self._bound, live, strict=True) if old is not new}
        self._bound = live
        if not swap:
            return 0
        return _Rebinder(swap).run([parallel_state, *roots])


class _Rebinder:
    def __init__(self, swap: dict[int, Any]) -> None:
        self.swap = swap
        self.seen: set[int] = set()
        self.count = 0

    def run(self, roots: list[object]) -> int:
        for root in roots:
            if isinstance(root, types.ModuleType):
                # Module globals: only megatron's own state (names like _TENSOR_MODEL_PARALLEL_GROUP).
                self._container(vars(root), 0)
            else:
                self._visit(root, 0)
        return self.count

    def _replacement(self, value: Any) -> Any:
        if isinstance(value, dist.ProcessGroup):
            return self.swap.get(id(value))
        return None

    def _container(self, container: dict[Any, Any] | list[Any], depth: int) -> None:
        keys = list(container.keys()) if isinstance(container, dict) else list(range(len(container)))
        for key in keys:
            value = container[key]
            new = self._replacement(value)
            if new is not None:
                container[key] = new
                self.count += 1
            else:
                self._visit(value, depth + 1)

    def _visit(self, obj: Any, depth: int) -> None:
        if depth > _MAX_DEPTH or obj is None or id(obj) in self.seen:
            return
        if isinstance(obj, _LEAVES):
            return
        if isinstance(obj, dist.ProcessGroup):
            return
        self.seen.add(id(obj))
        if isinstance(obj, (dict, list)):
            self._container(obj, depth)
        elif isinstance(obj, (tuple, set, frozenset)):
            for item in obj:
                if self._replacement(item) is not None:
                    raise RuntimeError(
                        f"a destroyed process group sits in an immutable {type(obj).__name__}; "
                        "it cannot be swapped for the rebuilt one"
                    )
                self._visit(item, depth + 1)
        else:
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                self._container(attrs, depth)
            for slot in getattr(type(obj), "__slots__", ()):
                if isinstance(slot, str) and hasattr(obj, slot):
                    value = getattr(obj, slot)
                    new = self._replacement(value)
                    if new is not None:
                        object.__setattr__(obj, slot, new)
                        self.count += 1
                    else:
                        self._visit(value, depth + 1)
