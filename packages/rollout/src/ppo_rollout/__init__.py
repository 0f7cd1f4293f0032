"""Rollout engines (built-in and SGLang), the rollout manager, tasks and rewards.

The public interface (the README's "Public interface") is imported from the module that defines it,
so that reading the settings costs no torch, transformers or Ray (``ppo-driver validate``):

- ``ppo_rollout.config``: ``RolloutSettings``, ``RolloutConfig``, ``SamplingSettings``,
  ``SamplingConfig``, ``SGLangOptions`` (torch-free)
- ``ppo_rollout.tasks``: ``make_tiny_model`` and the built-in tasks (torch-free until a model is made)
- ``ppo_rollout.rewards``: ``RewardInput``, ``RewardFn``, ``RewardError``, ``register_reward``
- ``ppo_rollout.environment``: ``Action``, ``StepResult``, ``Environment`` (multi-turn environments)
- ``ppo_rollout.rollout_fns``: ``RolloutContext``, ``PromptGroup``, ``Turn``, ``register_rollout_function``
- ``ppo_rollout.trajectory``: ``Trajectory``, ``TrajectoryBuilder``, ``Segment``
- ``ppo_rollout.manager``: ``RolloutManager``, ``RolloutBatch``
- ``ppo_rollout.slots``: ``EngineSlots``
- ``ppo_rollout.engine.builtin``: ``BuiltinEngine``, ``BuiltinEngineActor``
- ``ppo_rollout.engine.core``: ``GenerationOutput``
- ``ppo_rollout.engine.sglang``: ``SGLangServer``, ``SGLangServerSpec``, ``SGLangClient``, ``SGLangError``
"""

__version__ = "0.7.0"
