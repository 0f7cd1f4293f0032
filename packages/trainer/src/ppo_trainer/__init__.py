"""PPO math and actor/critic train workers (Ray) with a torch/transformers backend."""

# Names load on first use (PEP 562): `ppo-driver validate` reads this package's configs and task
# names without paying for torch, transformers and Ray, which the modules behind the rest import.
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ppo_trainer.backend import DataParallel, TorchTrainer
    from ppo_trainer.backend_protocol import TrainerBackend, make_trainer
    from ppo_trainer.batch import Samples
    from ppo_trainer.config import AlgorithmConfig, TrainerConfig, TrainSettings
    from ppo_trainer.errors import NonFiniteWeightsError
    from ppo_trainer.group import LocalSlots, Slots, TrainGroup, TrainResult
    from ppo_trainer.models import CriticModel, load_causal_lm, load_critic, load_policy_state_into_critic
    from ppo_trainer.worker import TrainWorker

_LAZY = {
    "DataParallel": "ppo_trainer.backend",
    "TorchTrainer": "ppo_trainer.backend",
    "TrainerBackend": "ppo_trainer.backend_protocol",
    "make_trainer": "ppo_trainer.backend_protocol",
    "Samples": "ppo_trainer.batch",
    "AlgorithmConfig": "ppo_trainer.config",
    "TrainerConfig": "ppo_trainer.config",
    "TrainSettings": "ppo_trainer.config",
    "NonFiniteWeightsError": "ppo_trainer.errors",
    "LocalSlots": "ppo_trainer.group",
    "Slots": "ppo_trainer.group",
    "TrainGroup": "ppo_trainer.group",
    "TrainResult": "ppo_trainer.group",
    "CriticModel": "ppo_trainer.models",
    "load_causal_lm": "ppo_trainer.models",
    "load_critic": "ppo_trainer.models",
    "load_policy_state_into_critic": "ppo_trainer.models",
    "TrainWorker": "ppo_trainer.worker",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "AlgorithmConfig",
    "CriticModel",
    "DataParallel",
    "LocalSlots",
    "NonFiniteWeightsError",
    "Samples",
    "Slots",
    "TorchTrainer",
    "TrainGroup",
    "TrainResult",
    "TrainSettings",
    "TrainWorker",
    "TrainerBackend",
    "TrainerConfig",
    "__version__",
    "load_causal_lm",
    "load_critic",
    "load_policy_state_into_critic",
    "make_trainer",
]
