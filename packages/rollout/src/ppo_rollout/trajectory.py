"""One rollout of one prompt, however many turns it took: what a rollout function returns.

A trajectory's response is every token after the prompt, in order: each turn's generated tokens and,
between turns, the observation (a tool's or an environment's reply) appended as token ids. The model's
own ids are kept exactly as the engine returned them (never decoded and encoded again), so turn
``k + 1`` continues from the very ids the policy produced and the trainer scores the same tokens the
engine sampled.

``Trajectory.loss_mask`` is 1 exactly on generated tokens; ``log_probs`` holds the engine's log-prob of
each generated token and 0.0 on observation tokens; ``turn_ids`` numbers the turn each token belongs
to (an observation carries the number of the turn it answers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

__all__ = ["STATUSES", "Segment", "Status", "Trajectory", "TrajectoryBuilder", "with_outcome"]

Status = Literal["done", "max_turns", "length", "env_error"]
STATUSES: tuple[Status, ...] = ("done", "max_turns", "length", "env_error")
"""``done``: the model answered or the environment ended it; ``max_turns``: the turn limit; ``length``:
a turn hit its token limit or the trajectory its total (no tool runs after such a turn);
``env_error``: the environment raised, timed out or answered with the wrong type (``on_env_error``)."""


@dataclass(frozen=True)
class Segment:
    """A run of response tokens: one turn's generated tokens, or one observation."""

    token_ids: tuple[int, ...]
    generated: bool
    turn: int
    log_probs: tuple[float, ...] = ()  # generated segments: one per token

    def __post_init__(self) -> None:
        if self.generated and len(self.log_probs) != len(self.token_ids):
            raise ValueError(
                f"turn {self.turn}: {len(self.token_ids)} generated tokens but "
                f"{len(self.log_probs)} log-probs"
            )
        if not self.generated and self.log_probs:
            raise ValueError(f"turn {self.turn}: an observation segment carries no log-probs")


@dataclass(frozen=True)
class Trajectory:
    """A finished rollout of the prompt ``prompt_index`` (the group: samples of one prompt share it).

    ``reward`` is the outcome reward (it lands on the last generated token); ``turn_rewards[k]`` the
    environment's reward for turn ``k`` (on turn ``k``'s last generated token); ``score`` the raw task
    score before any shaping (accuracy and dynamic sampling read it); ``weight_versions[k]`` the
    engine's weight version that generated turn ``k``.
    """

    prompt_index: int
    prompt_tokens: tuple[int, ...]
    segments: tuple[Segment, ...]
    reward: float = 0.0
    score: float = 0.0
    turn_rewards: tuple[float, ...] = ()
    status: Status = "done"
    finish_reason: str = "stop"  # the last turn's: "stop" or "length"
    weight_versions: tuple[int, ...] = ()
    info: dict[str, float] = field(default_factory=dict)  # per-trajectory metrics (tool calls, ...)

    def __post_init__(self) -> None:
        turns = self.num_turns
        if self.turn_rewards and len(self.turn_rewards) != turns:
            raise ValueError(
                f"prompt {self.prompt_index}: {len(self.turn_rewards)} turn rewards for {turns} turns"
            )
        if self.weight_versions and len(self.weight_versions) != turns:
            raise ValueError(
                f"prompt {self.prompt_index}: {len(self.weight_versions)} weight versions for {turns} turns"
            )

    # -- the response as flat sequences --------------------------------------------------------------
    @property
    def response_tokens(self) -> tuple[int, ...]:
        return tuple(t for s in self.segments for t in s.token_ids)

    @property
    def loss_mask(self) -> tuple[int, ...]:
        return tuple(int(s.generated) for s in self.segments for _ in s.token_ids)

    @property
    def rollout_log_probs(self) -> tuple[float, ...]:
        return tuple(
            lp for s in self.segments for lp in (s.log_probs if s.generated else (0.0,) * len(s.token_ids))
        )

    @property
    def turn_ids(self) -> tuple[int, ...]:
        return tuple(s.turn for s in self.segments for _ in s.token_ids)

    @property
    def token_turn_rewards(self) -> tuple[float, ...]:
        """``turn_rewards`` spread over the response: each on its turn's last generated token."""
        out = [0.0] * len(self.response_tokens)
        if not self.turn_rewards:
            return tuple(out)
        position = 0
        last: dict[int, int] = {}
        for s in self.segments:
            if s.generated and s.token_ids:
                last[s.turn] = position + len(s.token_ids) - 1
            position += len(s.token_ids)
        for turn, reward in enumerate(self.turn_rewards):
            if turn in last:
                out[last[turn]] += reward
        return tuple(out)

    # -- counts --------------------------------------------------------------------------------------
    @property
    def num_turns(self) -> int:
        return sum(1 for s in self.segments if s.generated)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_tokens) + sum(len(s.token_ids) for s in self.segments)

    @property
    def generated_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments if s.generated)

    @property
    def observation_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments if not s.generated)

    @property
    def total_reward(self) -> float:
        """The outcome reward plus every turn's reward: what the trajectory earned in all."""
        return self.reward + sum(self.turn_rewards)

    def with_reward(self, reward: float, score: float | None = None) -> Trajectory:
        """The trajectory with its outcome ``reward`` (and raw ``score``, the reward when not given)."""
        return replace(self, reward=reward, score=reward if score is None else score)


class TrajectoryBuilder:
    """Accumulates one trajectory turn by turn; ``input_ids`` is what the next turn continues from."""

    def __init__(self, prompt_index: int, prompt_tokens: Sequence[int]) -> None:
        self.prompt_index = prompt_index
        self.prompt_tokens = tuple(int(t) for t in prompt_tokens)
        self.segments: list[Segment] = []
        self.turn_rewards: list[float] = []
        self.weight_versions: list[int] = []
        self.info: dict[str, float] = {}

    @property
    def turn(self) -> int:
        """The number of turns generated so far (the next turn's index)."""
        return len(self.turn_rewards)

    @property
    def response_length(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    @property
    def input_ids(self) -> list[int]:
        """The prompt and every response token so far: the next turn's input, exactly."""
        return [*self.prompt_tokens, *(t for s in self.segments for t in s.token_ids)]

    def add_turn(self, token_ids: Sequence[int], log_probs: Sequence[float], weight_version: int) -> None:
        self.segments.append(
            Segment(tuple(int(t) for t in token_ids), True, self.turn, tuple(float(x) for x in log_probs))
        )
        self.turn_rewards.append(0.0)
        self.weight_versions.append(weight_version)

    def add_observation(self, token_ids: Sequence[int]) -> None:
        if not self.turn_rewards:
            raise ValueError("an observation answers a turn: generate a turn before adding one")
        if token_ids:
            self.segments.append(Segment(tuple(int(t) for t in token_ids), False, self.turn - 1))

    def reward_last_turn(self, reward: float) -> None:
        self.turn_rewards[-1] += float(reward)

    def count(self, key: str, amount: float = 1.0) -> None:
        self.info[key] = self.info.get(key, 0.0) + amount

    def build(self, status: Status, finish_reason: str) -> Trajectory:
        return Trajectory(
            prompt_index=self.prompt_index,
            prompt_tokens=self.prompt_tokens,
            segments=tuple(self.segments),
            turn_rewards=tuple(self.turn_rewards),
            status=status,
            finish_reason=finish_reason,
            weight_versions=tuple(self.weight_versions),
            info=dict(self.info),
        )


UNFINISHED: frozenset[Status] = frozenset({"max_turns", "length"})


def with_outcome(trajectory: Trajectory, reward: float, *, score_unfinished: bool) -> Trajectory:
    """``trajectory`` with the reward function's ``reward`` as its outcome: 0 and no turn rewards when
    its environment failed; 0 when it ran out of turns or tokens before its environment ended it,
    unless ``score_unfinished`` (such a trajectory gave no final answer: a tool call cut by
    ``max_turns`` that holds the answer's number must not score as an answer). ``score`` keeps the
    reward function's value."""
    if trajectory.status == "env_error":
        return replace(trajectory, turn_rewards=(0.0,) * trajectory.num_turns).with_reward(0.0, score=0.0)
    if trajectory.status in UNFINISHED and not score_unfinished:
        return trajectory.with_reward(0.0, score=reward)
    return trajectory.with_reward(reward)
