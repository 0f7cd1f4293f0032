"""PPO math and actor/critic train workers (Ray) with a torch/transformers backend."""

from ppo_trainer.backend import DataParallel, TorchTrainer
from ppo_trainer.batch import Samples
from ppo_trainer.config import AlgorithmConfig, TrainerConfig, TrainSettings
from ppo_trainer.group import LocalSlots, Slots, TrainGroup, TrainResult
from ppo_trainer.models import CriticModel, load_causal_lm, load_critic, load_policy_state_into_critic
from ppo_trainer.worker import TrainWorker

__version__ = "0.1.0"

__all__ = [
    "AlgorithmConfig",
    "CriticModel",
    "DataParallel",
    "LocalSlots",
    "Samples",
    "Slots",
    "TorchTrainer",
    "TrainGroup",
    "TrainResult",
    "TrainSettings",
    "TrainWorker",
    "TrainerConfig",
    "__version__",
    "load_causal_lm",
    "load_critic",
    "load_policy_state_into_critic",
]
