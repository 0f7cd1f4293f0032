"""Built-in environments for multi-turn rollouts, by the name ``rollout.environment`` accepts."""

from __future__ import annotations

__all__ = ["BUILTIN_ENVIRONMENTS"]

BUILTIN_ENVIRONMENTS: dict[str, str] = {
    # <calc>expression</calc> answered by <result>value</result>; the final turn is scored by the reward
    "calculator": "ppo_rollout.environments.calculator:CalculatorEnvironment",
    # guess the row's number; "higher"/"lower" after each wrong guess, a reward every turn
    "guess_number": "ppo_rollout.environments.guess:GuessNumberEnvironment",
    # a BFCL multi-turn question against its simulated APIs, scored by BFCL's checker (the bfcl extra)
    "bfcl_multi_turn": "ppo_rollout.environments.bfcl.environment:BFCLMultiTurnEnvironment",
}
