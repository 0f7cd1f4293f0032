"""PPO math and actor/critic train workers with a torch backend and a megatron-core backend."""

__version__ = "0.1.0"
