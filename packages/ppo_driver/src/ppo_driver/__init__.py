"""The PPO driver: config, the training loop, checkpoints, metrics and the ppo-driver CLI."""

__version__ = "0.7.0"
