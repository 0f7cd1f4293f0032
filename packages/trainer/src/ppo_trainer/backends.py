"""The training backend a role's config names (``train.backend``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ppo_lifecycle.process_groups import ReloadableProcessGroups
from ppo_trainer.backend import TorchTrainer
from ppo_trainer.backend_protocol import DataParallel, Region, TrainerBackend
from ppo_trainer.config import TrainerConfig
from ppo_trainer.megatron_backend import MegatronTrainer  # megatron-core itself loads on first use
from ppo_trainer.shared_base import SharedBaseHandle

if TYPE_CHECKING:
    from ppo_trainer.checkpoint.protocol import TorchCheckpointable

    # The torch backend's checkpoint code reads a TorchTrainer through this Protocol (mypy checks it).
    _CHECKPOINTABLE: type[TorchCheckpointable] = TorchTrainer


def make_trainer(
    config: TrainerConfig,
    dp: DataParallel,
    region: Region,
    groups: ReloadableProcessGroups | None = None,
    *,
    publish_base: bool = False,
    base: SharedBaseHandle | None = None,
) -> TrainerBackend:
    """The backend ``config.backend`` names. ``groups``: the worker's reloadable process groups
    (megatron creates its model-parallel groups through them; required for ``megatron``);
    ``publish_base``/``base``: ``train.lora.share_base`` (``TorchTrainer``)."""
    if config.backend == "megatron":
        if groups is None:
            raise ValueError("train.backend='megatron' needs the worker's ReloadableProcessGroups")
        return MegatronTrainer(config, groups, region=region)
    return TorchTrainer(config, dp, region=region, publish_base=publish_base, base=base)
