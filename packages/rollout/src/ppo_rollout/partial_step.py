"""One step of partial rollouts (``rollout.partial``): what finished by the budget trains, the rest waits.

A step draws ``prompts_per_step`` new prompts (the data position advances as in a synchronous run)
and adds them behind the open groups (``partial``). Then it generates for every unfinished sample,
the open groups' first: a paused sample continues from its prompt and tokens so far, under the
weights the engines hold now. Each engine call ends once its share of the budget is reached
(``finish_fraction`` of its samples finished, or ``token_budget`` tokens: ``engine.early_stop``), and
its unfinished samples pause again. The complete groups train, oldest first, as many as a multiple
of the data-parallel sizes; while fewer are complete, generation goes on in another round (same
weights, seeds of their own).

Samples are paused and continued from token ids in the rollout manager, never in an engine: an
engine that sleeps between steps (the offload plan) frees its KV cache, and the continuation's
prefill recomputes it.

Which rollout functions can pause: ``single_turn``; ``multi_turn``, whose trajectories pause inside a
turn or between turns and keep their environment (``partial_turns``); and a function of one request
per sample that says each sample's token limit (``lengths(step, group, samples) -> list[int]``, as
``testing.long_tail.LongTailRollout`` does).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from . import env_errors
from .config import RolloutConfig, SamplingConfig
from .engine.early_stop import StopRule
from .engine.handles import EngineHandle
from .generate_client import GenerateClient, Generated
from .partial import OpenGroup, OpenGroups, OpenSample, StaleCounts
from .partial_turns import run_turns
from .rollout_fns import ContextCall, ContextTools, PromptGroup, RolloutFn
from .runner import ClientSeeds, RolloutRun
from .trajectory import Trajectory
from .weight_versions import versions_held

__all__ = ["PartialRollout", "PartialStep", "dp_multiple", "run_requests", "sample_limits"]

Limits = Callable[[int, int, int], list[int]]


def sample_limits(fn: RolloutFn, fn_name: str, config: RolloutConfig) -> Limits:
    """Each new sample's token limit, ``(step, group, samples) -> limits``; a rollout function that
    cannot be paused is refused, named."""
    if fn_name in ("single_turn", "multi_turn"):
        limit = config.train_response_limit  # a multi-turn trajectory's: multi_turn.max_response_tokens
        return lambda step, group, samples: [limit] * samples
    lengths = getattr(fn, "lengths", None)
    if not callable(lengths):
        raise ValueError(
            f"rollout.partial.enabled: rollout function {fn_name!r} cannot be paused; use "
            "rollout_function=single_turn or multi_turn, or give the function a lengths(step, group, "
            "samples) method (one request per sample, as ppo_rollout.testing.long_tail.LongTailRollout)"
        )
    return lambda step, group, samples: [int(n) for n in lengths(step, group, samples)]


@dataclass(frozen=True)
class PartialStep:
    """The step's trained groups (indexed in batch order) and their trajectories, the rounds as one
    run, and the ``rollout/partial/`` metrics."""

    groups: list[PromptGroup]
    trajectories: list[Trajectory]
    run: RolloutRun
    metrics: dict[str, float]


class PartialRollout:
    """The open groups of a run and how a step generates for them."""

    def __init__(
        self, config: RolloutConfig, limits: Limits, multiple: int, turns: ContextTools | None = None
    ) -> None:
        self.config = config
        self.settings = config.partial
        self.limits = limits
        self.multiple = multiple  # trained groups per step: a multiple of the data-parallel sizes
        s = self.settings
        self.rule = StopRule(s.finish_fraction, s.token_budget, s.chunk_tokens)
        self.open = OpenGroups()
        self.turns = turns  # multi_turn's context tools (None: one request per sample)
        self.replays_restarted = 0  # this step's samples restarted after their environment's replay

    def generate(self, step: int, new: Sequence[PromptGroup], engines: Sequence[EngineHandle]) -> PartialStep:
        """Step ``step``: ``new`` joins the open groups, generation until the budget, the complete
        groups out."""
        cfg, s = self.config, self.settings
        t0 = time.perf_counter()
        rounds: list[tuple[RolloutRun, int]] = []
        self.replays_restarted = 0
        with versions_held(engines, cfg.timeout_s, step) as versions:
            current = min(versions)
            stale = self.open.enforce_staleness(current, s.max_staleness, s.on_stale)
            for group in new:
                limits = self.limits(step, group.index, group.samples)
                samples = tuple(OpenSample(n) for n in limits)
                self.open.groups.append(
                    OpenGroup(group.row, group.prompt_text, group.prompt_ids, step, samples)
                )
            while self.open.unfinished() and (not rounds or self.open.complete_count() < self.multiple):
                rounds.append(self._round(step, len(rounds), engines, versions))
        taken = self.open.take_complete(self.multiple)
        groups, trajectories = _trained(taken, current)
        if self.turns is not None and self.turns.limits.on_env_error == "zero":
            bound, name = self.turns.limits.max_env_error_share, self.turns.environment.name
            env_errors.check_share(trajectories, step, name, bound)
        run = _combined([r for r, _ in rounds], trajectories, time.perf_counter() - t0)
        metrics = self._metrics(taken, current, stale, rounds)
        return PartialStep(groups, trajectories, run, metrics)

    def _round(
        self, step: int, round_: int, engines: Sequence[EngineHandle], versions: Sequence[int]
    ) -> tuple[RolloutRun, int]:
        """One generation over every unfinished sample; returns its run and the tokens it made."""
        if self.turns is not None:
            return self._turn_round(step, round_, engines, versions)
        todo = self.open.unfinished()
        requests = []
        for g, k in todo:
            group, sample = self.open.groups[g], self.open.groups[g].samples[k]
            requests.append(([*group.prompt_ids, *sample.token_ids], sample.limit - sample.made))
        seeds = ClientSeeds(self.config.seed, step, 0 if round_ == 0 else 2 + round_)
        outputs, run = run_requests(engines, requests, self.config, self.rule, seeds)
        for (g, k), out in zip(todo, outputs, strict=True):
            sample = self.open.groups[g].samples[k]
            version = versions[out.engine]
            self.open.record(
                (g, k), sample.continued(out.token_ids, out.log_probs, out.finish_reason, version)
            )
        return run, sum(len(o.token_ids) for o in outputs)

    def _turn_round(
        self, step: int, round_: int, engines: Sequence[EngineHandle], versions: Sequence[int]
    ) -> tuple[RolloutRun, int]:
        """One round of turns over every unfinished multi-turn sample (``partial_turns``)."""
        assert self.turns is not None
        todo = self.open.unfinished()
        work = []
        for g, k in todo:
            group = self.open.groups[g]
            prompt = PromptGroup(g, group.row, group.prompt_text, group.prompt_ids, len(group.samples))
            work.append((prompt, k, group.samples[k]))
        call = ContextCall(self.config.sampling, tuple(versions), step)
        seeds = ClientSeeds(self.config.seed, step, 0 if round_ == 0 else 2 + round_)
        samples, run, tally = run_turns(engines, work, self.turns, call, self.config, seeds)
        self.replays_restarted += tally.replays_restarted
        for where, sample in zip(todo, samples, strict=True):
            self.open.record(where, sample)
        return run, sum(tally.tokens.values())

    def _metrics(
        self,
        taken: Sequence[OpenGroup],
        current: int,
        stale: StaleCounts,
        rounds: Sequence[tuple[RolloutRun, int]],
    ) -> dict[str, float]:
        ages = [0, 0, 0]  # trained tokens 0, 1, 2+ versions old
        for group in taken:
            for sample in group.samples:
                for piece in sample.pieces:
                    if not piece.observation:
                        ages[min(current - piece.version, 2)] += len(piece.token_ids)
        total = max(sum(ages), 1)
        unfinished = self.open.unfinished()
        waiting = sum(len(g.samples) for g in self.open.groups) - len(unfinished)
        replays = {"rollout/partial/replay_restarts": float(self.replays_restarted)} if self.turns else {}
        return replays | {
            "rollout/partial/trained_groups": float(len(taken)),
            "rollout/partial/open_groups": float(len(self.open.groups)),
            "rollout/partial/paused_samples": float(len(unfinished)),
            "rollout/partial/waiting_samples": float(waiting),
            "rollout/partial/dropped_samples": float(stale.dropped),
            "rollout/partial/restarted_samples": float(stale.restarted),
            "rollout/partial/rounds": float(len(rounds)),
            "rollout/partial/generated_tokens": float(sum(n for _, n in rounds)),
            "rollout/partial/trained_tokens": float(sum(ages)),
            "rollout/partial/token_share_0": ages[0] / total,
            "rollout/partial/token_share_1": ages[1] / total,
            "rollout/partial/token_share_2plus": ages[2] / total,
        }

    # -- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> list[dict[str, object]]:
        return self.open.state_dict()

    def load_state_dict(self, state: Sequence[dict[str, object]]) -> None:
        self.open.load_state_dict(state)


def _trained(taken: Sequence[OpenGroup], current: int) -> tuple[list[PromptGroup], list[Trajectory]]:
    """The complete groups as the step's prompt groups and trajectories (each turn's weight version
    its oldest token's: ``OpenSample.trajectory``)."""
    groups, trajectories = [], []
    for i, g in enumerate(taken):
        groups.append(PromptGroup(i, g.row, g.prompt_text, g.prompt_ids, len(g.samples)))
        trajectories += [sample.trajectory(i, g.prompt_ids, current) for sample in g.samples]
    return groups, trajectories


def _combined(runs: Sequence[RolloutRun], trajectories: list[Trajectory], seconds: float) -> RolloutRun:
    busy = sum(r.seconds for r in runs)
    idle = sum(r.engine_idle_share * r.seconds for r in runs) / busy if busy > 0 else 0.0
    return RolloutRun(trajectories, seconds, idle, sum(r.engine_calls for r in runs))


def run_requests(
    engines: Sequence[EngineHandle],
    requests: Sequence[tuple[list[int], int]],
    config: RolloutConfig,
    rule: StopRule,
    seeds: ClientSeeds,
) -> tuple[list[Generated], RolloutRun]:
    """One sample per ``(input ids, token limit)`` request, all in one wave over the engines, each
    engine call ended by ``rule``; the outputs in request order."""
    sampling = replace(config.sampling, n_samples_per_prompt=1)

    async def wave() -> tuple[list[Generated], RolloutRun]:
        client = GenerateClient(
            engines, seed=seeds.seed, step=seeds.step, stream=seeds.stream, timeout_s=config.timeout_s
        )
        client.stop_rule = rule
        started = time.perf_counter()
        try:
            pending = [
                asyncio.ensure_future(
                    client.generate(ids, SamplingConfig.of(replace(sampling, max_new_tokens=limit), seed=0))
                )
                for ids, limit in requests
            ]
            outputs = [out[0] for out in await asyncio.gather(*pending)]
        except BaseException:
            await client.drain()  # no engine call of this step may outlive it
            raise
        finally:
            client.close()
        seconds = time.perf_counter() - started
        return outputs, RolloutRun([], seconds, client.idle_share(seconds), sum(client.calls))

    return asyncio.run(wave())


def dp_multiple(dp_size: int, critic_dp_size: int) -> int:
    """Trained groups per step are a multiple of both data-parallel sizes."""
    return dp_size * critic_dp_size // math.gcd(dp_size, critic_dp_size)
