"""The outcome reward of a step's trajectories: ``rollout.reward`` (or the task's) over the whole
batch at once, on each trajectory's last turn."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .config import RolloutConfig
from .rewards import RewardFn, RewardInput, compute_rewards, resolve_reward, response_text
from .rollout_fns import PromptGroup
from .tasks import get_task
from .trajectory import Trajectory, with_outcome

__all__ = ["Scorer", "reward_spec"]


def reward_spec(config: RolloutConfig) -> str:
    """The reward a run uses: ``rollout.reward``, else its task's; a dataset needs one named."""
    if config.task is not None:
        return config.reward or get_task(config.task).reward
    if config.reward is None:
        raise ValueError("rollout.reward is required with a dataset (a registered name or 'module:function')")
    return config.reward


class Scorer:
    """Gives trajectories their outcome reward with ``reward_fn`` (resolved from ``reward_name``).

    ``score_unfinished``: whether a trajectory that ran out of turns or tokens before its environment
    ended it is scored (single-turn runs, ``multi_turn.score_unfinished``) or gets 0.
    ``stop_token_ids``: the run's ``rollout.sampling.stop_token_ids``; with the model's eos ids they are
    the tokens that end a response, the only ones its text leaves out (``rewards.response_text``).
    """

    def __init__(
        self,
        reward_name: str,
        tokenizer: Any,
        *,
        timeout_s: float,
        score_unfinished: bool,
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        self.reward_name = reward_name
        self.reward_fn: RewardFn = resolve_reward(reward_name)
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.score_unfinished = score_unfinished
        self.stop_token_ids = tuple(stop_token_ids)

    def rewarded(self, groups: Sequence[PromptGroup], trajectories: Sequence[Trajectory]) -> list[Trajectory]:
        """The trajectories with their outcome reward: the reward function over the whole batch at once,
        on each trajectory's last turn (its whole response when single-turn). A trajectory whose
        environment failed (``on_env_error: zero``) gets 0 and no turn rewards; a multi-turn one that
        ran out of turns or tokens before its environment ended it gave no final answer: 0 unless
        ``multi_turn.score_unfinished`` (else a tool call with the answer in it, cut by ``max_turns``,
        would score as an answer)."""
        inputs = [self._reward_input(groups[t.prompt_index], t) for t in trajectories]
        rewards = compute_rewards(self.reward_fn, inputs, timeout_s=self.timeout_s)
        return [
            with_outcome(t, r, score_unfinished=self.score_unfinished)
            for t, r in zip(trajectories, rewards, strict=True)
        ]

    def _reward_input(self, group: PromptGroup, t: Trajectory) -> RewardInput:
        last = next(s for s in reversed(t.segments) if s.generated)
        # The special tokens the model wrote are text (a <bos>-padded answer is not the bare answer);
        # only the token that ended the response is left out.
        response = response_text(self.tokenizer, last.token_ids, self.stop_token_ids)
        transcript = (
            response
            if len(t.segments) == 1
            else str(self.tokenizer.decode(list(t.response_tokens), skip_special_tokens=True))
        )
        return RewardInput(
            prompt=group.prompt_text,
            response=response,
            response_token_ids=last.token_ids,
            finish_reason=t.finish_reason,
            row=group.row,
            prompt_index=group.index,
            transcript=transcript,
            num_turns=t.num_turns,
        )
