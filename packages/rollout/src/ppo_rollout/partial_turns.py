"""Multi-turn samples of partial rollouts (``rollout.partial`` with ``rollout_function: multi_turn``):
one round of turns against each sample's environment, pausing inside or between turns.

A round advances every unfinished sample as ``rollout_fns.multi_turn`` would, from where it stands:
a sample paused inside a turn continues that turn from its ids so far (the turn's tokens left as
the limit), one paused between turns starts its next turn, a new one makes its environment and
starts its first. Every engine call ends at its share of the budget (``engine.early_stop``, as for
single-turn samples): a turn still running then pauses inside the turn, its tokens, log-probs and
weight version kept, and its sample waits for the next round or step. A sample whose turn finished
steps its environment and appends the reply; it goes on to its next turn in the same round unless
the round's budget was reached when that turn's wave went out (``finish_fraction`` of the round's
samples had ended, or ``token_budget`` tokens were made), and then pauses between turns. Counted per
wave (a sample's ``j``-th request of a round is in the round's ``j``-th wave with ``turn_order:
fixed``), where a round stops is a fixed function of its inputs and seeds.

The environment stays with its sample (``OpenSample.env``) in this process between rounds and steps.
A checkpoint cannot hold it: after a resume, a sample's environment is made again, reset with its row
and replayed with the sample's finished turns (each turn's action as the model wrote it). When the
replay answers otherwise than recorded (another reward or reply, an end, an error) the sample restarts
from its prompt, counted; a deterministic environment (the built-in ones) continues exactly.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from . import env_errors
from .config import PartialSettings, RolloutConfig
from .engine.early_stop import PAUSED, StopRule
from .environment import Action, EnvironmentFailure, EnvironmentStop
from .generate_client import BatchGenerator, GenerateClient
from .partial import OpenSample, Piece
from .rollout_fns import ContextCall, ContextTools, PromptGroup, RolloutContext, Turn, cut_at_stop
from .runner import ClientSeeds, RolloutRun, named_within, rollout_bound, run_participants
from .trajectory import Status

__all__ = ["TurnRound", "run_turns"]


@dataclass
class TurnRound:
    """A round's budget between turns, counted by wave; and the samples restarted after a replay."""

    samples: int
    settings: PartialSettings
    ended: dict[int, int] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    replays_restarted: int = 0

    def count(self, wave: int, tokens: int = 0, ended: bool = False) -> None:
        self.tokens[wave] = self.tokens.get(wave, 0) + tokens
        self.ended[wave] = self.ended.get(wave, 0) + int(ended)

    def reached(self, wave: int) -> bool:
        """Whether the waves before ``wave`` reached the round's budget."""
        fraction, budget = self.settings.finish_fraction, self.settings.token_budget
        ended = sum(n for w, n in self.ended.items() if w < wave)
        tokens = sum(n for w, n in self.tokens.items() if w < wave)
        return (fraction is not None and ended >= max(1, math.ceil(fraction * self.samples - 1e-9))) or (
            budget is not None and tokens >= budget
        )


def run_turns(
    engines: Sequence[BatchGenerator],
    todo: Sequence[tuple[PromptGroup, int, OpenSample]],
    tools: ContextTools,
    call: ContextCall,
    config: RolloutConfig,
    seeds: ClientSeeds,
) -> tuple[list[OpenSample], RolloutRun, TurnRound]:
    """One round over ``todo`` (each sample's group, its place in the group, its state): the samples
    as they stand after it, the round as a run, and its counts (tokens made, replays restarted)."""
    limits = tools.limits
    s = config.partial
    rule = StopRule(s.finish_fraction, s.token_budget, s.chunk_tokens)

    async def every_sample() -> tuple[list[OpenSample], RolloutRun, TurnRound]:
        client = GenerateClient(
            engines, seed=seeds.seed, step=seeds.step, stream=seeds.stream, timeout_s=config.timeout_s
        )
        client.order, client.stop_rule = limits.turn_order, rule
        ctx, tally = RolloutContext(client, tools, call), TurnRound(len(todo), config.partial)
        bound = rollout_bound(limits, config.timeout_s)
        started = time.perf_counter()
        calls = [((g.index, k), partial(_bounded, ctx, g, k, sample, tally, bound)) for g, k, sample in todo]
        samples = await run_participants(client, limits.env_timeout_s, calls)
        seconds = time.perf_counter() - started
        run = RolloutRun([], seconds, client.idle_share(seconds), sum(client.calls))
        return samples, run, tally

    return asyncio.run(every_sample())


async def _bounded(
    ctx: RolloutContext, group: PromptGroup, k: int, sample: OpenSample, tally: TurnRound, bound: float
) -> OpenSample:
    what = f"rollout function multi_turn (rollout.partial) on prompt {group.index}, sample {k}"
    try:
        return await named_within(_advance(ctx, group, k, sample, tally), what, bound, "pause or end")
    finally:
        ctx.client.leave((group.index, k))


def _left(ctx: RolloutContext, s: OpenSample) -> int:
    """The current turn's tokens left: its limit (the per-turn one, within what the trajectory had
    left when the turn began) less what it made before it paused."""
    made = sum(len(p.token_ids) for p in s.turn_pieces(s.turn))
    began = len(s.token_ids) - made
    return min(ctx.sampling.max_new_tokens, s.limit - began) - made


def _request(ctx: RolloutContext, group: PromptGroup, s: OpenSample) -> asyncio.Future[list[Turn]]:
    ids = [*group.prompt_ids, *s.token_ids]
    return asyncio.ensure_future(ctx.generate(ids, max_new_tokens=_left(ctx, s)))


async def _advance(
    ctx: RolloutContext, group: PromptGroup, k: int, sample: OpenSample, tally: TurnRound
) -> OpenSample:
    """The sample's turns until it ends or pauses (inside a turn, or between turns at the budget)."""
    s, failure = sample, None
    if s.env is None and s.pieces:  # resumed from a checkpoint: its environment made again
        s = await _replayed(ctx, group, k, s, tally)
    pending = _request(ctx, group, s)  # before the environment: the first wave holds every sample
    if s.env is None:
        try:
            s = await _made(ctx, group, k, s)
        except EnvironmentFailure as exc:
            if isinstance(exc, EnvironmentStop):
                pending.cancel()
                raise
            failure = exc
    wave = 0
    while True:
        (turn,) = await pending
        s, ids, reason = _with_turn(ctx, s, turn)
        tally.count(wave, len(turn.token_ids))
        if failure is not None:
            return _ended(_failed(ctx, s, failure), "env_error", reason, tally, wave)
        if reason == PAUSED:
            return s  # paused inside the turn
        s = replace(s, rewards=(*s.rewards, 0.0))
        if reason == "length":  # a cut turn runs no tool
            return _ended(s, "length", reason, tally, wave)
        s, status = await _stepped(ctx, group, k, s, ids)
        if status is not None:
            return _ended(s, status, reason, tally, wave)
        if tally.reached(wave):
            return s  # paused between turns
        wave += 1
        pending = _request(ctx, group, s)


async def _made(ctx: RolloutContext, group: PromptGroup, k: int, s: OpenSample) -> OpenSample:
    where = ctx.where(group, k, s.turn)
    env = await ctx.make_environment(where)
    seconds = await ctx.reset(env, group.row, where)
    return replace(s, env=env, info=_counted(s, "env_seconds", seconds))


def _with_turn(ctx: RolloutContext, s: OpenSample, turn: Turn) -> tuple[OpenSample, tuple[int, ...], str]:
    """The sample with ``turn``'s tokens as a piece of its current turn, the turn cut at the first
    stop string of its whole text (one may span a pause); the turn's ids so far and its finish."""
    before = tuple(t for p in s.turn_pieces(s.turn) for t in p.token_ids)
    ids, log_probs, reason = turn.token_ids, turn.log_probs, turn.finish_reason
    if before:
        cut = cut_at_stop((*before, *ids), ctx.limits.stop, ctx.decode)
        if cut is not None:
            keep = max(cut - len(before), 0)
            ids, log_probs, reason = ids[:keep], log_probs[:keep], "stop"
    if ids:
        s = replace(s, pieces=(*s.pieces, Piece(ids, log_probs, turn.weight_version, s.turn)))
    return s, (*before, *ids), reason


async def _stepped(
    ctx: RolloutContext, group: PromptGroup, k: int, s: OpenSample, ids: tuple[int, ...]
) -> tuple[OpenSample, Status | None]:
    """The environment's answer to the finished turn ``ids``: its reward and counts, then its reply
    appended; the status when the trajectory ends here (None: it goes on)."""
    turn = s.turn - 1
    where = ctx.where(group, k, turn)
    try:
        result, seconds = await ctx.step_env(s.env, Action(ctx.decode(ids), ids, "stop", turn), where)
    except EnvironmentFailure as exc:
        return _failed(ctx, s, exc), "env_error"
    info = _counted(s, "env_seconds", seconds)
    for key, value in result.info.items():
        info[key] = info.get(key, 0.0) + float(value)
    s = replace(s, rewards=(*s.rewards[:-1], s.rewards[-1] + float(result.reward)), info=info)
    if result.done:
        return s, "done"
    if s.turn >= ctx.limits.max_turns:
        return s, "max_turns"
    reply = tuple(ctx.observation_ids(str(result.observation), ids))
    if len(s.token_ids) + len(reply) >= s.limit:
        return s, "length"  # no room for the reply and a turn
    if reply:
        s = replace(s, pieces=(*s.pieces, Piece(reply, (), -1, turn, observation=True)))
    return s, None


def _counted(s: OpenSample, key: str, amount: float) -> dict[str, float]:
    info = dict(s.info)
    info[key] = info.get(key, 0.0) + amount
    return info


def _failed(ctx: RolloutContext, s: OpenSample, failure: EnvironmentFailure) -> OpenSample:
    """``on_env_error: stop`` (or a failure that always stops) raises; ``zero`` writes it down."""
    if ctx.limits.on_env_error == "stop" or isinstance(failure, EnvironmentStop):
        raise failure
    env_errors.record(str(failure))
    if s.turn_pieces(s.turn):  # the turn it failed on (not yet rewarded) ends with it
        s = replace(s, rewards=(*s.rewards, 0.0))
    return replace(s, info=_counted(s, "env_errors", 1.0))


def _ended(s: OpenSample, status: Status, reason: str, tally: TurnRound, wave: int) -> OpenSample:
    tally.count(wave, ended=True)
    finish = "length" if reason in ("length", PAUSED) else "stop"
    return replace(s, finish_reason=finish, status=status, env=None)


async def _replayed(
    ctx: RolloutContext, group: PromptGroup, k: int, s: OpenSample, tally: TurnRound
) -> OpenSample:
    """``s`` with its environment made again, reset and stepped with its finished turns; restarted
    from its prompt (counted) when an answer differs from the recorded one."""
    env = await ctx.make_environment(ctx.where(group, k, 0))  # a factory that fails stops the run
    try:
        await ctx.reset(env, group.row, ctx.where(group, k, 0))
        for turn in range(s.turn):
            ids = tuple(t for p in s.turn_pieces(turn) for t in p.token_ids)
            action = Action(ctx.decode(ids), ids, "stop", turn)
            result, _ = await ctx.step_env(env, action, ctx.where(group, k, turn))
            reply = tuple(t for p in s.pieces if p.observation and p.turn == turn for t in p.token_ids)
            if (
                result.done
                or float(result.reward) != s.rewards[turn]
                or tuple(ctx.observation_ids(str(result.observation), ids)) != reply
            ):
                raise EnvironmentFailure(f"{ctx.where(group, k, turn)}: answered otherwise on replay")
    except EnvironmentFailure as exc:
        if isinstance(exc, EnvironmentStop):
            raise
        tally.replays_restarted += 1
        return s.restarted()
    return replace(s, env=env)
