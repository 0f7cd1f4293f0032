"""BFCL multi-turn as an environment: the Berkeley Function Calling Leaderboard's multi-turn questions
(bfcl-eval 2026.3.23, Apache-2.0), played against its simulated APIs and scored by its own checker.

- ``data``: the package's questions, gold answers and function docs; the held-out split by question.
- ``prompts``: the system prompt with the function docs (BFCL's template), the user turns.
- ``dataset``: rows as the rollout reads them, written as JSONL (``python -m
  ppo_rollout.environments.bfcl.dataset``).
- ``calls``: the model's function calls parsed (Python call syntax or BFCL's JSON), never evaluated.
- ``execution``: fresh simulated API instances per trajectory, each call time-bounded.
- ``checker``: BFCL's state and response checks against the gold calls run on instances of their own.
- ``environment``: ``BFCLMultiTurnEnvironment``, the ``bfcl_multi_turn`` environment.

Needs the ``bfcl`` extra of ppo-rollout (bfcl-eval without its declared requirements, and mpmath).
"""

from __future__ import annotations

__all__ = ["INSTALL_HINT"]

INSTALL_HINT = (
    "the bfcl_multi_turn environment needs bfcl-eval: `uv sync` in this workspace (ppo-rollout's bfcl "
    "extra, installed without bfcl-eval's declared requirements), or `pip install --no-deps "
    "bfcl-eval==2026.3.23 mpmath`"
)

try:  # every module of this package imports it: named with its fix where the environment is resolved
    import bfcl_eval  # noqa: F401
except ImportError as exc:
    raise ImportError(INSTALL_HINT) from exc
