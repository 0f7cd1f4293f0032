"""The built-in engine and the SGLang client have exactly the engine operations of ppo_weight_sync
(the client: its memory half)."""

from __future__ import annotations

import inspect

import pytest

from ppo_rollout.engine.builtin import BuiltinEngine
from ppo_rollout.engine.sglang import SGLangClient
from ppo_weight_sync import EngineOps

OPS = [
    "init_weights_update_group",
    "update_weights_from_distributed",
    "destroy_weights_update_group",
    "get_weight_version",
    "pause_generation",
    "continue_generation",
    "flush_cache",
    "release_memory_occupation",
    "resume_memory_occupation",
]


MEMORY_OPS = ["release_memory_occupation", "resume_memory_occupation"]


# The SGLang client keeps the memory operations only: the weight and generation-control operations are
# its endpoint's (an HttpEngineEndpoint, the sender's way to the server).
@pytest.mark.parametrize(("impl", "ops"), [(BuiltinEngine, OPS), (SGLangClient, MEMORY_OPS)])
def test_operations_match_engine_ops(impl: type, ops: list[str]) -> None:
    for op in ops:
        # ray.remote(BuiltinEngine) adds a tracing parameter of its own to the class's methods
        theirs = [
            p for p in inspect.signature(getattr(impl, op)).parameters.values() if p.name != "_ray_trace_ctx"
        ]
        ours = inspect.signature(getattr(EngineOps, op)).parameters.values()
        assert [(p.name, p.kind) for p in theirs] == [(p.name, p.kind) for p in ours], f"{impl.__name__}.{op}"
        assert all(p.default is inspect.Parameter.empty for p in theirs), f"{impl.__name__}.{op} has defaults"
