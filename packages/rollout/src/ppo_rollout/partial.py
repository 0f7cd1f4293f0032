"""Partial rollouts' state (``rollout.partial``): the prompt groups still open between steps.

A group is open from the step its prompt was drawn until every one of its samples has finished;
then it trains, whole (a group estimator compares a prompt's samples with each other, and every
estimator sees the same groups). Each sample keeps its *pieces*: the runs of tokens it generated,
each with the engine's log-prob of every token and the weight version that drew it. A paused
sample continues from its prompt and tokens so far, with the tokens it has left as its limit.

A multi-turn sample (``partial_turns``) also keeps its environment's replies as observation pieces,
each turn's reward, the environment's ``info`` counts, and the environment object itself
(:attr:`OpenSample.env`, alive in this process between steps, never saved). Its current turn is
the one after its last rewarded turn: pieces of that turn mean it paused inside the turn, none that
it paused between turns (after the environment's reply).

Staleness: a token drawn with weight version ``v`` that trains with version ``w`` is ``w - v``
versions old. Before a step generates, every open sample whose oldest token would train more than
``max_staleness`` versions old is dropped (its whole group: it can no longer be whole) or restarted
from its prompt (``on_stale``). The state is plain data (:meth:`OpenGroups.state_dict`): a checkpoint
saves it and a resumed run continues the same samples (a multi-turn sample's environment is made
again and replayed with its finished turns: ``partial_turns``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from .engine.early_stop import PAUSED
from .trajectory import STATUSES, Segment, Status, Trajectory

__all__ = ["OpenGroup", "OpenGroups", "OpenSample", "Piece", "StaleCounts"]


@dataclass(frozen=True)
class Piece:
    """Tokens one engine call generated for a sample, their log-probs, the weight version that drew
    them and the turn they belong to; or (``observation``) an environment's reply to that turn, with no
    log-probs and no version."""

    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    version: int
    turn: int = 0
    observation: bool = False


@dataclass(frozen=True)
class OpenSample:
    """One sample of an open group: its token limit, its pieces so far, how it finished (None: not
    yet), and how often it was restarted. A multi-turn sample also has each finished turn's reward
    (``rewards``), the environment's counts (``info``), its trajectory's status once finished, and its
    live environment (``env``: None before it is made, once the sample finished, and after a resume)."""

    limit: int
    pieces: tuple[Piece, ...] = ()
    finish_reason: str | None = None
    restarts: int = 0
    rewards: tuple[float, ...] = ()
    info: Mapping[str, float] = field(default_factory=dict)
    status: Status | None = None
    env: Any = field(default=None, compare=False, repr=False)

    @property
    def made(self) -> int:
        """Generated tokens so far."""
        return sum(len(p.token_ids) for p in self.pieces if not p.observation)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def oldest(self) -> int | None:
        """The weight version of its oldest token (None: no tokens yet)."""
        return min((p.version for p in self.pieces if p.token_ids and not p.observation), default=None)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every response token so far, observations included: what a continuation follows."""
        return tuple(t for p in self.pieces for t in p.token_ids)

    @property
    def log_probs(self) -> tuple[float, ...]:
        """One per response token: the engine's log-prob, 0.0 on observation tokens."""
        return tuple(
            x for p in self.pieces for x in ((0.0,) * len(p.token_ids) if p.observation else p.log_probs)
        )

    @property
    def turn(self) -> int:
        """The current turn: the one after the last rewarded (finished) turn."""
        return len(self.rewards)

    def turn_pieces(self, turn: int) -> tuple[Piece, ...]:
        """The generated pieces of ``turn``, in order."""
        return tuple(p for p in self.pieces if p.turn == turn and not p.observation)

    def continued(
        self, token_ids: Sequence[int], log_probs: Sequence[float], reason: str, version: int
    ) -> OpenSample:
        """After an engine call returned ``token_ids`` (finish ``reason``) drawn with ``version``."""
        pieces = self.pieces
        if token_ids:
            pieces = (*pieces, Piece(tuple(token_ids), tuple(log_probs), version, self.turn))
        return replace(self, pieces=pieces, finish_reason=None if reason == PAUSED else reason)

    def restarted(self) -> OpenSample:
        return OpenSample(self.limit, restarts=self.restarts + 1)

    def trajectory(self, prompt_index: int, prompt_ids: Sequence[int], current: int) -> Trajectory:
        """The finished sample as a trajectory: each turn's pieces as one generated segment (its
        weight version the oldest of them; ``current`` for a turn without tokens) followed by the
        environment's reply to it. A single-turn sample is one turn, its status from its finish."""
        segments: list[Segment] = []
        versions: list[int] = []
        turns = max(len(self.rewards), 1)
        for turn in range(turns):
            made = self.turn_pieces(turn)
            ids = tuple(t for p in made for t in p.token_ids)
            segments.append(Segment(ids, True, turn, tuple(x for p in made for x in p.log_probs)))
            versions.append(min((p.version for p in made if p.token_ids), default=current))
            replies = [p for p in self.pieces if p.observation and p.turn == turn and p.token_ids]
            segments += [Segment(p.token_ids, False, turn) for p in replies]
        reason = self.finish_reason or "stop"
        return Trajectory(
            prompt_index=prompt_index,
            prompt_tokens=tuple(int(t) for t in prompt_ids),
            segments=tuple(segments),
            turn_rewards=self.rewards or (0.0,) * turns,
            status=self.status or ("length" if reason == "length" else "done"),
            finish_reason=reason,
            weight_versions=tuple(versions),
            info=dict(self.info),
        )


@dataclass(frozen=True)
class OpenGroup:
    """A prompt drawn at ``born`` (a step) whose samples have not all trained yet."""

    row: Mapping[str, Any]
    prompt_text: str
    prompt_ids: tuple[int, ...]
    born: int
    samples: tuple[OpenSample, ...]

    @property
    def complete(self) -> bool:
        return all(s.finished for s in self.samples)


@dataclass(frozen=True)
class StaleCounts:
    """What the staleness bound did before a step: samples dropped (with their groups) and restarted."""

    dropped: int = 0
    restarted: int = 0


class OpenGroups:
    """The open groups in the order they were drawn: the oldest are first in line."""

    def __init__(self) -> None:
        self.groups: list[OpenGroup] = []

    def unfinished(self) -> list[tuple[int, int]]:
        """(group, sample) of every sample still to generate, oldest group first."""
        return [
            (g, s)
            for g, group in enumerate(self.groups)
            for s, x in enumerate(group.samples)
            if not x.finished
        ]

    def record(self, where: tuple[int, int], sample: OpenSample) -> None:
        g, s = where
        group = self.groups[g]
        samples = (*group.samples[:s], sample, *group.samples[s + 1 :])
        self.groups[g] = replace(group, samples=samples)

    def complete_count(self) -> int:
        return sum(group.complete for group in self.groups)

    def take_complete(self, multiple: int) -> list[OpenGroup]:
        """The complete groups, oldest first, as many as a multiple of ``multiple`` (the others wait)."""
        complete = [g for g in self.groups if g.complete]
        taken = complete[: len(complete) - len(complete) % multiple]
        ids = {id(g) for g in taken}
        self.groups = [g for g in self.groups if id(g) not in ids]
        return taken

    def enforce_staleness(
        self, trains_with: int, max_staleness: int, on_stale: Literal["drop", "restart"]
    ) -> StaleCounts:
        """Drop or restart every sample whose oldest token would train more than ``max_staleness``
        versions behind ``trains_with``."""
        dropped = restarted = 0
        kept: list[OpenGroup] = []
        for group in self.groups:
            stale = [s.oldest is not None and trains_with - s.oldest > max_staleness for s in group.samples]
            if not any(stale):
                kept.append(group)
            elif on_stale == "drop":
                dropped += len(group.samples)
            else:
                restarted += sum(stale)
                samples = tuple(
                    s.restarted() if old else s for s, old in zip(group.samples, stale, strict=True)
                )
                kept.append(replace(group, samples=samples))
        self.groups = kept
        return StaleCounts(dropped, restarted)

    # -- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> list[dict[str, Any]]:
        """Plain lists and numbers (JSON): every open group and its samples' pieces."""
        return [
            {
                "row": dict(g.row),
                "prompt_text": g.prompt_text,
                "prompt_ids": list(g.prompt_ids),
                "born": g.born,
                "samples": [
                    {
                        "limit": s.limit,
                        "finish_reason": s.finish_reason,
                        "restarts": s.restarts,
                        "pieces": [
                            [list(p.token_ids), list(p.log_probs), p.version, p.turn, p.observation]
                            for p in s.pieces
                        ],
                        "rewards": list(s.rewards),
                        "info": dict(s.info),
                        "status": s.status,
                    }
                    for s in g.samples
                ],
            }
            for g in self.groups
        ]

    def load_state_dict(self, state: Sequence[Mapping[str, Any]]) -> None:
        self.groups = [
            OpenGroup(
                row=dict(g["row"]),
                prompt_text=str(g["prompt_text"]),
                prompt_ids=tuple(int(t) for t in g["prompt_ids"]),
                born=int(g["born"]),
                samples=tuple(_sample(s) for s in g["samples"]),
            )
            for g in state
        ]


def _piece(state: Sequence[Any]) -> Piece:
    ids, lps, version, *where = state  # [ids, log-probs, version, turn, observation]; older: the first 3
    turn, observation = (int(where[0]), bool(where[1])) if where else (0, False)
    return Piece(tuple(int(t) for t in ids), tuple(float(x) for x in lps), int(version), turn, observation)


def _sample(state: Mapping[str, Any]) -> OpenSample:
    reason, status = state["finish_reason"], state.get("status")
    return OpenSample(
        int(state["limit"]),
        tuple(_piece(p) for p in state["pieces"]),
        None if reason is None else str(reason),
        int(state["restarts"]),
        tuple(float(x) for x in state.get("rewards", ())),
        {str(k): float(v) for k, v in state.get("info", {}).items()},
        None if status is None else _status(status),
    )


def _status(value: object) -> Status:
    if value not in STATUSES:
        raise ValueError(f"rollout state: a partial sample's status {value!r} is not one of {STATUSES}")
    return value
