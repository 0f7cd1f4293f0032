"""The rollout manager: the one object the driver holds for generation, a facade over the parts.

Each job lives in a module of its own; this class makes them and hands each call on:

- ``engine_pool.py``: the engines, launched on their slots and waited for together, their warm-up;
- ``generation.py``: one step's batch (prompts, the rollout function over the engines, rewards from
  ``scoring.py``, a packed Box per rank) and ``RolloutBatch``; ``evaluation.py``: held-out eval;
- ``rollout_parts.py``: the rollout function and what its context is given (``rollout_fns.py``);
- ``weight_versions.py``: the engines' weight versions, held still through a rollout, and checksums;
- ``engine_memory.py``: offload and onload in colocated runs, and what they moved.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ppo_weight_sync import EngineEndpoint

from .config import RolloutConfig
from .data import PromptRenderer, PromptSource, open_prompts
from .engine.handles import EngineHandle
from .engine_memory import EngineMemory
from .engine_pool import EnginePool, check_bundles
from .evaluation import CORRECT_REWARD as CORRECT_REWARD
from .evaluation import evaluate
from .generation import Generation, RolloutBatch, check_dp_sizes
from .partial_step import PartialRollout, dp_multiple, sample_limits
from .rollout_parts import rollout_parts
from .scoring import Scorer, reward_spec
from .slots import EngineSlots
from .weight_versions import weights_checksums

__all__ = ["RolloutBatch", "RolloutManager"]


class RolloutManager:
    """Owns ``config.num_engines`` engines on ``slots`` (``None``: anywhere on the local Ray instance)."""

    def __init__(
        self,
        config: RolloutConfig,
        slots: EngineSlots | None,
        *,
        dp_size: int,
        critic_dp_size: int | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        check_dp_sizes(config, dp_size, critic_dp_size)
        check_bundles(config, slots)
        self.config = config
        self.dp_size = dp_size
        self.critic_dp_size = dp_size if critic_dp_size is None else critic_dp_size
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.source: PromptSource = open_prompts(config, config.seed)
        self.renderer = PromptRenderer(
            self.tokenizer,
            self.source.prompt_field,
            chat_template=config.chat_template,
            system_prompt=config.system_prompt,
        )
        # The reward before the rollout function, and both before any engine starts.
        self.scorer = Scorer(
            reward_spec(config),
            self.tokenizer,
            timeout_s=config.reward_timeout_s,
            score_unfinished=config.resolved_rollout_function == "single_turn"
            or config.multi_turn.score_unfinished,
            stop_token_ids=config.sampling.stop_token_ids,
        )
        self.parts = rollout_parts(config, self.tokenizer)
        try:
            partial = self._partial(config)  # a rollout function that cannot pause: before any engine
            self.pool = EnginePool(config, slots)
        except BaseException:
            self.parts.close()
            raise
        self.engines: list[EngineHandle] = self.pool.engines  # emptied in place by shutdown()
        self.startup = self.pool.startup
        self.memory = EngineMemory(self.pool, config.timeout_s)
        self.generation = Generation(
            config,
            self.source,
            self.renderer,
            self.parts,
            self.scorer,
            self.pool,
            self.dp_size,
            self.critic_dp_size,
            partial,
        )

    def _partial(self, config: RolloutConfig) -> PartialRollout | None:
        """``rollout.partial``: the open groups, kept here between steps (None: off)."""
        if not config.partial.enabled:
            return None
        limits = sample_limits(self.parts.fn, self.parts.fn_name, config)
        turns = self.parts.tools if self.parts.fn_name == "multi_turn" else None  # partial_turns
        return PartialRollout(config, limits, dp_multiple(self.dp_size, self.critic_dp_size), turns)

    # -- engines -----------------------------------------------------------------------------------
    def start_warm_up(self) -> Callable[[float], dict[str, float]]:
        """Start the built-in engines' warm-up for a training step's first wave (``EnginePool``);
        returns what waits for it: the slowest engine's ``{"warm_up_s": ...}``."""
        return self.pool.start_warm_up()

    def endpoints(self) -> list[EngineEndpoint]:
        """The engines as ppo_weight_sync endpoints, for ``WeightSender.connect``."""
        return self.pool.endpoints()

    def weights_checksums(self) -> list[str]:
        """``ppo_weight_sync.checksum`` of each engine's weights (built-in engines only)."""
        return weights_checksums(self.engines, self.config.timeout_s)

    # -- steps ---------------------------------------------------------------------------------------
    def generate(self, step: int) -> RolloutBatch:
        """Roll out ``prompts_per_step`` prompts x ``n_samples_per_prompt`` and pack one Box per dp rank
        (``generation.py``: the overlong penalty, dynamic sampling)."""
        self.memory.check_resident("generate")
        return self.generation.generate(step)

    def evaluate(self, step: int) -> dict[str, float]:
        """Reward, accuracy and response length on ``eval_prompts`` fixed held-out prompts, greedy and
        with the training sampling (``evaluation.py``). ``step`` no longer seeds anything: every
        evaluation draws alike."""
        if self.config.eval_prompts == 0:
            return {}
        self.memory.check_resident("evaluate")
        return evaluate(self.generation)

    # -- colocated runs --------------------------------------------------------------------------------
    def offload(self) -> None:
        """Every engine releases its weights and KV cache (idempotent); colocated runs, driver's command."""
        self.memory.offload()

    def onload(self) -> None:
        """Every engine takes its weights and KV cache back (idempotent)."""
        self.memory.onload()

    @property
    def is_offloaded(self) -> bool:
        return self.memory.offloaded

    def pop_metrics(self) -> dict[str, float]:
        """Bytes and seconds the engines' offloads and onloads moved since the last call (``offload/``
        and ``onload/`` ``bytes`` and ``seconds``); empty when an engine does not report them (SGLang)."""
        return self.memory.pop_metrics()

    # -- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The data position, and with ``rollout.partial`` the open groups (every paused sample's
        tokens, log-probs and weight versions). Sampling seeds are a function of (seed, step, engine):
        no RNG state to keep."""
        state: dict[str, Any] = {"version": 1, "data": self.source.state_dict()}
        if self.generation.partial is not None:
            state["partial"] = self.generation.partial.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != 1 or "data" not in state:
            raise ValueError(f"not a rollout state (expected version 1 with 'data'): keys {sorted(state)}")
        self.source.load_state_dict(state["data"])
        if self.generation.partial is not None:
            self.generation.partial.load_state_dict(state.get("partial", []))

    def shutdown(self) -> None:
        self.parts.close()
        self.pool.shutdown()
