"""Generating one step's batch over the engines: the prompts rendered and encoded, the rollout
function run against the engines (their weights held still), the rewards, one packed Box per rank.

Outcome rewards get the overlong penalty (``rollout.overlong``); with ``rollout.dynamic_sampling``
the groups whose raw scores do not vary are dropped and more prompts rolled out until
``prompts_per_step`` groups are kept (``dynamic_sampling``). With ``rollout.partial`` a step trains
the groups that finished by its budget and the rest continue at the next step (``partial_step``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ppo_value_transport import Box, pack_fields

from .batch import rank_fields, split_indices
from .config import RolloutConfig, SamplingSettings
from .data import PromptRenderer, PromptSource
from .dynamic_sampling import select_groups
from .engine_pool import EnginePool
from .generate_client import GenerateClient
from .overlong import shape_overlong
from .partial_step import PartialRollout
from .prompts import encode_texts
from .rollout_fns import ContextCall, PromptGroup, RolloutContext
from .rollout_metrics import multi_turn_metrics, sample_metrics
from .rollout_parts import RolloutParts
from .runner import ClientSeeds, RolloutRun, run_rollout
from .sample_limits import check_samples, model_limits
from .scoring import Scorer
from .trajectory import Trajectory
from .weight_versions import versions_held

__all__ = ["Generation", "RolloutBatch", "check_dp_sizes"]


@dataclass(frozen=True)
class RolloutBatch:
    """One step's training batch: a ``pack_fields`` Box per actor data-parallel rank, and metrics.

    ``sample_ids[r]``: the step's sample ids actor rank ``r`` holds, in its order. ``critic_boxes``
    and ``critic_sample_ids``: the same samples split over the critic's ranks (the actor's split
    when the two sizes agree); ``ppo_value_transport.pair_values`` maps the critic's values back.
    """

    boxes: list[Box]
    metrics: dict[str, float] = field(default_factory=dict)
    sample_ids: list[list[int]] = field(default_factory=list)
    critic_boxes: list[Box] = field(default_factory=list)
    critic_sample_ids: list[list[int]] = field(default_factory=list)


def check_dp_sizes(config: RolloutConfig, dp_size: int, critic_dp_size: int | None) -> None:
    """The step's prompts split evenly over the actor's (and the critic's) data-parallel ranks."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if critic_dp_size is not None and (critic_dp_size < 1 or config.prompts_per_step % critic_dp_size):
        raise ValueError(
            f"rollout.prompts_per_step ({config.prompts_per_step}) must be a multiple of the critic's "
            f"data-parallel size ({critic_dp_size}): the samples of one prompt stay on one rank"
        )
    if config.prompts_per_step % dp_size:
        raise ValueError(
            f"rollout.prompts_per_step ({config.prompts_per_step}) must be a multiple of the "
            "data-parallel "
            f"size ({dp_size}): the samples of one prompt stay on one rank and ranks get equal shares"
        )


def _combined(runs: Sequence[RolloutRun], trajectories: list[Trajectory]) -> RolloutRun:
    """The rounds of one step as one run: the trained trajectories, the rounds' seconds and engine
    calls summed, their idle shares weighted by seconds."""
    seconds = sum(r.seconds for r in runs)
    idle = sum(r.engine_idle_share * r.seconds for r in runs) / seconds if seconds > 0 else 0.0
    return RolloutRun(trajectories, seconds, idle, sum(r.engine_calls for r in runs))


def _packed(trajectories: Sequence[Trajectory], ranks: int) -> tuple[list[list[int]], list[Box]]:
    """The sample ids each of ``ranks`` ranks gets, and its Box."""
    ids = split_indices(trajectories, ranks)
    return ids, [pack_fields(rank_fields([trajectories[i] for i in part])) for part in ids]


@dataclass
class Generation:
    """Rolls out prompts of ``source`` over the engines of ``pool``."""

    config: RolloutConfig
    source: PromptSource
    renderer: PromptRenderer
    parts: RolloutParts
    scorer: Scorer
    pool: EnginePool
    dp_size: int
    critic_dp_size: int
    partial: PartialRollout | None = None  # rollout.partial: the open groups between steps

    def groups(self, rows: Sequence[Mapping[str, Any]], samples: int) -> list[PromptGroup]:
        """The step's prompts: rendered (chat template when on) and encoded once, here, for every
        engine kind (SGLang's ``/generate`` takes ``input_ids`` too). The dataset pre-flight
        (``prompts.check_dataset``) encodes with the same function."""
        texts = [self.renderer.render(row) for row in rows]
        ids = encode_texts(self.renderer, texts, self.config.max_prompt_length)
        return [
            PromptGroup(i, row, text, tuple(prompt), samples)
            for i, (row, text, prompt) in enumerate(zip(rows, texts, ids, strict=True))
        ]

    def rollout(
        self, groups: Sequence[PromptGroup], sampling: SamplingSettings, step: int, stream: int
    ) -> RolloutRun:
        """Every group's trajectories from the rollout function, over the engines; the engines' weight
        versions must not change meanwhile (a weight update never overlaps a rollout)."""
        cfg, engines, parts = self.config, self.pool.engines, self.parts
        with versions_held(engines, cfg.timeout_s, step) as versions:
            call = ContextCall(sampling, versions, step)

            def context(client: GenerateClient) -> RolloutContext:
                return RolloutContext(client, parts.tools, call)

            # Every step's seeds derive from the run's seed (``config.seed``), whatever the settings hold.
            seeds = ClientSeeds(cfg.seed, step, stream)
            return run_rollout(parts.fn, parts.fn_name, groups, engines, context, seeds, cfg.timeout_s)

    def generate(self, step: int) -> RolloutBatch:
        """Roll out ``prompts_per_step`` prompts x ``n_samples_per_prompt`` and pack one Box per dp rank."""
        cfg = self.config
        t0 = time.perf_counter()
        runs: list[RolloutRun] = []

        def roll(round_: int, prompts: int) -> list[list[Trajectory]]:
            # Each round draws new rows (the saved data position advances by all of them) and samples
            # from its own stream: the step stays a function of (seed, step, data position).
            rows = self.source.next_rows(prompts)
            groups = self.groups(rows, cfg.sampling.n_samples_per_prompt)
            run = self.rollout(groups, cfg.sampling, step, stream=0 if round_ == 0 else 2 + round_)
            runs.append(run)
            # What the model cannot train on stops here, named, before the reward decodes it.
            check_samples(run.trajectories, model_limits(cfg.model_path), self.parts.fn_name)
            rewarded = shape_overlong(
                self.scorer.rewarded(groups, run.trajectories), cfg.overlong, cfg.train_response_limit
            )
            by_prompt: dict[int, list[Trajectory]] = {g.index: [] for g in groups}
            for t in rewarded:
                by_prompt[t.prompt_index].append(t)
            return list(by_prompt.values())

        dynamic: dict[str, float] = {}
        if self.partial is not None:
            trajectories, run, dynamic = self._partial_step(step)
            runs.append(run)
        elif cfg.dynamic_sampling.enabled:
            selection = select_groups(roll, cfg.prompts_per_step, cfg.dynamic_sampling)
            trajectories, dynamic = selection.trajectories, selection.metrics
        else:
            trajectories = [t for g in roll(0, cfg.prompts_per_step) for t in g]
        run = runs[0] if self.partial is not None else _combined(runs, trajectories)
        ids, boxes = _packed(trajectories, self.dp_size)
        critic_ids, critic_boxes = ids, boxes
        if self.critic_dp_size != self.dp_size:
            critic_ids, critic_boxes = _packed(trajectories, self.critic_dp_size)
        return RolloutBatch(
            boxes=boxes,
            metrics=self._step_metrics(trajectories, run, time.perf_counter() - t0) | dynamic,
            sample_ids=ids,
            critic_boxes=critic_boxes,
            critic_sample_ids=critic_ids,
        )

    def _partial_step(self, step: int) -> tuple[list[Trajectory], RolloutRun, dict[str, float]]:
        """``prompts_per_step`` new prompts join the open groups; the groups complete by the budget,
        checked and rewarded (``partial_step``)."""
        assert self.partial is not None
        cfg = self.config
        new = self.groups(self.source.next_rows(cfg.prompts_per_step), cfg.sampling.n_samples_per_prompt)
        done = self.partial.generate(step, new, self.pool.engines)
        check_samples(done.trajectories, model_limits(cfg.model_path), self.parts.fn_name)
        rewarded = shape_overlong(
            self.scorer.rewarded(done.groups, done.trajectories), cfg.overlong, cfg.train_response_limit
        )
        return rewarded, done.run, done.metrics

    def _step_metrics(
        self, trajectories: Sequence[Trajectory], run: RolloutRun, seconds: float
    ) -> dict[str, float]:
        versions = [min(t.weight_versions) for t in trajectories]
        generated = sum(t.generated_tokens for t in trajectories)
        metrics = sample_metrics(trajectories) | {
            "rollout/generate_seconds": run.seconds,
            "rollout/tokens_per_second": generated / run.seconds if run.seconds > 0 else 0.0,
            "rollout/seconds": seconds,
            "rollout/weight_version_min": float(min(versions)),
            "rollout/weight_version_max": float(max(versions)),
        }
        if self.parts.multi_turn:
            metrics |= multi_turn_metrics(trajectories) | {
                "rollout/engine_idle_share": run.engine_idle_share,
                "rollout/engine_calls": float(run.engine_calls),
            }
        return metrics
