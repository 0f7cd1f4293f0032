"""The types the algorithm's settings, its estimators and its formulas share; imports nothing of this package.

``ppo_trainer.config`` declares the settings with these types, ``ppo_trainer.ppo_math`` computes with
them and ``ppo_trainer.estimators`` reads the settings through ``AdvantageSettings``, so the imports run
one way: ``config -> estimators -> ppo_math -> algorithm_types``. Standard library only (``ppo-driver
validate`` imports the settings without torch).
"""

from __future__ import annotations

from typing import Literal, Protocol

KLEstimator = Literal["k1", "abs", "k2", "k3", "low_var_kl"]
LossAggregation = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
]
GaeUnit = Literal["token", "turn"]
CorrectionLevel = Literal["none", "token", "sequence", "geometric"]
WeightBound = Literal["truncate", "clip", "none"]
OffPolicyReturns = Literal["none", "vtrace"]


class AdvantageSettings(Protocol):
    """What an advantage estimator reads of the ``algorithm`` settings (``config.AlgorithmConfig``
    has it all)."""

    @property
    def estimator(self) -> str: ...

    @property
    def gamma(self) -> float: ...

    @property
    def lam(self) -> float: ...

    @property
    def gae_unit(self) -> GaeUnit: ...

    @property
    def gae_through_observations(self) -> bool: ...

    @property
    def norm_adv_by_std_in_grpo(self) -> bool: ...

    @property
    def off_policy_returns(self) -> OffPolicyReturns: ...

    @property
    def vtrace_rho_bar(self) -> float: ...

    @property
    def vtrace_c_bar(self) -> float: ...


__all__ = [
    "AdvantageSettings",
    "CorrectionLevel",
    "GaeUnit",
    "KLEstimator",
    "LossAggregation",
    "OffPolicyReturns",
    "WeightBound",
]
