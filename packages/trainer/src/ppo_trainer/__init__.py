"""PPO math and actor/critic train workers (Ray) with torch/transformers and megatron-core backends.

The package itself imports only its settings (``ppo_trainer.config``: pydantic, no torch), so that
``ppo-driver validate`` checks a run config without paying for torch, transformers and Ray. Everything
else is imported from its module: ``ppo_trainer.group.TrainGroup``, ``ppo_trainer.worker.TrainWorker``,
``ppo_trainer.backend.TorchTrainer``, ``ppo_trainer.objective``, ``ppo_trainer.checkpoint.*``.
"""

from ppo_trainer.config import AlgorithmConfig, TrainerConfig, TrainSettings

__version__ = "0.6.0"

__all__ = ["AlgorithmConfig", "TrainSettings", "TrainerConfig", "__version__"]
