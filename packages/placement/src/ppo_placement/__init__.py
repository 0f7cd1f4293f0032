"""Ray placement for PPO roles: GPU layout math, placement groups, bundle order."""

__version__ = "0.1.0"
