"""Checkpoints of the megatron backend, in the torch backend's layout and Hugging Face names.

Written through the ``TrainerBackend`` interface alone (``hf_state_dict`` / ``load_hf_state_dict`` and
``hf_optimizer_state`` / ``load_hf_optimizer_state``; every rank calls them), so any backend can use
it; the megatron backend does (``TrainWorker.save``/``load`` with ``backend='megatron'``), and the
tests run it on the torch backend to check the files against ``torch_io``'s.

``<folder>/`` gets ``model.safetensors`` (whole float32 tensors in Hugging Face names, tied aliases
dropped, as the torch backend writes them), ``rng_rank<r>.safetensors`` and ``trainer_state.json``;
the actor also ``hf/`` (``config.json``, the weights, the tokenizer files of ``model_path``). So a run
saved by either backend resumes on the other: the model loads by name (``load_hf_state_dict``).

The optimizer goes into ``optimizer.pt`` in the torch backend's format (``optimizer_format``: AdamW's
state dict keyed by Hugging Face name, whole float32 tensors, ``weights_only`` loadable) through
``hf_optimizer_state`` / ``load_hf_optimizer_state``: the megatron backend gathers its
``DistributedOptimizer``'s data-parallel shards and converts them with the weights' code. Its
``model.safetensors`` holds the float32 main weights (the bf16 model weights are their rounding),
and a load sets both, so a resume continues the run exactly, on either backend. The hyperparameters
(lr, betas, weight decay) come from the config on the megatron backend; the torch backend adopts the
file's, as it does for its own checkpoints. A folder without ``optimizer.pt`` loads with a warning
(Adam then starts from the state it holds).

The second half of the module is that conversion, the megatron backend's side of ``optimizer.pt``:
``OptimizerShards`` (one rank's ``DistributedOptimizer`` shards gathered to whole megatron tensors and
scattered back), ``hf_optimizer_state`` / ``load_hf_optimizer_state`` (to and from the file's dict),
``chained`` and ``init_optimizer_state``. ``MegatronTrainer`` calls them; megatron-core is imported
only inside the functions that use it, so the module imports without it.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from ppo_trainer import megatron_convert as mc
from ppo_trainer.backend_protocol import TrainerBackend
from ppo_trainer.checkpoint import format as fmt
from ppo_trainer.checkpoint import optimizer_format as of
from ppo_trainer.checkpoint.torch_optimizer import init_adam_state
from ppo_trainer.config import TrainerConfig
from ppo_trainer.errors import NonFiniteWeightsError
from ppo_weight_sync import non_finite_names

log = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _tied(model_path: str) -> bool:
    """Whether the model ties its output layer to the embeddings (``lm_head.weight`` is an alias)."""
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.from_pretrained(model_path), "tie_word_embeddings", False))


def save_shard(trainer: TrainerBackend, folder: Path, step: int | None) -> None:
    """Every rank calls it (the TP gather is collective); global rank 0 writes the model."""
    folder.mkdir(parents=True, exist_ok=True)
    rank = _rank()
    fmt.write_rng(folder, rank, fmt.rng_state())
    # Every rank: megatron gathers its main weights and Adam moments over tensor- and data-parallel
    # shards (collectives); FSDP2 gathers too; replicated torch ranks read their own copy.
    state = trainer.hf_state_dict()
    optimizer = trainer.hf_optimizer_state()
    if rank != 0:
        return
    # As the torch backend's save: a checkpoint never holds non-finite weights.
    bad = non_finite_names([(k, v) for k, v in state.items() if isinstance(v, torch.Tensor)])
    if bad:
        raise NonFiniteWeightsError(trainer.config.role, rank, bad, "save")
    if trainer.config.role == "actor" and _tied(trainer.config.model_path):
        state.pop("lm_head.weight", None)  # an alias of the embeddings, as the torch backend drops it
    save_file(state, str(folder / "model.safetensors"))
    torch.save(optimizer, folder / "optimizer.pt")
    info: dict[str, Any] = {
        "format_version": fmt.FORMAT_VERSION,
        "role": trainer.config.role,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "data_parallel": trainer.layout,
        "backend": trainer.config.backend,
        "step": step,
    }
    (folder / "trainer_state.json").write_text(json.dumps(info, indent=2))
    if trainer.config.role == "actor":
        hf = folder / "hf"
        hf.mkdir(exist_ok=True)
        source = Path(trainer.config.model_path)
        shutil.copy2(source / "config.json", hf / "config.json")
        save_file(state, str(hf / "model.safetensors"), metadata={"format": "pt"})
        fmt.copy_tokenizer(source, hf)


def load_shard(trainer: TrainerBackend, folder: Path) -> int | None:
    """Load a ``<role>/`` folder written by either backend; returns the saved step."""
    model_file, saved = fmt.read_saved(folder, trainer.config.role)
    saved_role = saved.get("role", trainer.config.role)
    if saved_role != trainer.config.role and trainer.config.role == "actor":
        raise ValueError(f"{folder} holds a {saved_role} checkpoint; it cannot be loaded into the actor")
    state = load_file(str(model_file))
    trainer.load_hf_state_dict(state)
    if saved_role != trainer.config.role:
        return None  # a policy checkpoint into the critic: a fresh start, as in the torch backend
    optimizer_file = folder / "optimizer.pt"
    if optimizer_file.is_file():
        optimizer = torch.load(optimizer_file, map_location="cpu", weights_only=True)
        trainer.load_hf_optimizer_state(optimizer)
    else:
        log.warning("%s: %s has no optimizer.pt; Adam starts afresh", trainer.config.role, folder)
    fmt.restore_rng(folder, _rank())
    return fmt.saved_step(saved)


# ---------------------------------------------------------------------------------------------------
# The megatron backend's ``DistributedOptimizer`` in ``optimizer.pt``'s format. Its main weights and
# Adam moments are flat float32 shards cut over data parallelism, of tensors sliced over tensor
# parallelism: gathered into whole tensors in megatron names, converted with the weights' code
# (``optimizer_format``), and back. megatron-core is imported only where a function needs it.


def chained(optimizer: Any) -> list[Any]:
    """The optimizers a megatron optimizer holds (one, or a ``ChainedOptimizer``'s several)."""
    from megatron.core.optimizer import ChainedOptimizer

    if isinstance(optimizer, ChainedOptimizer):
        return list(optimizer.chained_optimizers)
    return [optimizer]


def init_optimizer_state(optimizers: list[Any]) -> None:
    """Adam's state for every main-weight shard now (``init_adam_state``: what torch's Adam makes in
    its first step); megatron's own init for the fused optimizers (Transformer Engine, apex)."""
    for opt in optimizers:
        inner = opt.optimizer
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            init_adam_state(inner)
        else:
            opt.init_state_fn(inner, opt.config)


@dataclass(frozen=True)
class OptimizerShards:
    """One megatron rank's view of its ``DistributedOptimizer``: what the conversion reads and writes.

    ``optimizers``: the optimizers it chains (``chained``); ``params``: the trained model parameters by
    megatron name; ``shape``/``critic``: the model, for the name and layout conversion;
    ``whole_over_tp``: this rank's tensor-parallel slice of a tensor made whole (collective when TP > 1);
    ``tp_slice``: a whole tensor's slice of this rank."""

    optimizers: list[Any]
    params: list[tuple[str, nn.Parameter]]
    device: torch.device
    shape: mc.ModelShape
    critic: bool
    whole_over_tp: Callable[[str, torch.Tensor], torch.Tensor]
    tp_slice: Callable[[str, torch.Tensor], torch.Tensor]

    def shard_of(self, param: nn.Parameter) -> tuple[dict[str, torch.Tensor], int, int] | None:
        """This data-parallel rank's main weight and Adam moments for model ``param`` (flat float32
        shards) and the element range of the parameter they cover; None when it owns none of it."""
        for opt in self.optimizers:
            if param in opt.model_param_group_index_map:
                tensors = opt._get_main_param_and_optimizer_states(param)
                span = opt._get_model_param_range_map(param)["param"]
                return tensors, int(span.start), int(span.end)
        return None

    def gathered(self, key: str) -> dict[str, torch.Tensor]:
        """``key`` ("param", "exp_avg", "exp_avg_sq") of every parameter as whole float32 CPU
        tensors in megatron names: each data-parallel rank contributes its shard (an all-reduce of
        the bits: exactly one rank holds each element, the others add zeros), then the
        tensor-parallel slices are gathered. Collective on every rank."""
        # The group the distributed optimizer cut its shards over (rebound after a wake).
        dp_group = self.optimizers[0].data_parallel_group
        dp_size = dist.get_world_size(dp_group)
        out: dict[str, torch.Tensor] = {}
        for name, param in self.params:
            flat = torch.zeros(param.numel(), dtype=torch.float32, device=self.device)
            shard = self.shard_of(param)
            if shard is not None:
                tensors, start, end = shard
                flat[start:end] = tensors[key].detach().view(-1)
            if dp_size > 1:
                dist.all_reduce(flat.view(torch.int32), group=dp_group)
            out[name] = self.whole_over_tp(name, flat.view(param.shape)).cpu()
        return out

    def scatter(self, key: str, whole: Mapping[str, torch.Tensor]) -> None:
        """Whole megatron tensors (``whole``, by megatron name) into this rank's shards of ``key``;
        parameters absent from ``whole`` keep theirs."""
        for name, param in self.params:
            shard = self.shard_of(param)
            if name not in whole or shard is None:
                continue
            tensors, start, end = shard
            flat = self.tp_slice(name, whole[name]).reshape(-1)[start:end]
            tensors[key].view(-1).copy_(flat.to(device=tensors[key].device, dtype=tensors[key].dtype))

    def adam_steps(self) -> set[int]:
        """The step counts Adam holds: per parameter (torch) or per param group (fused optimizers)."""
        steps: set[int] = set()
        for opt in self.optimizers:
            inner = opt.optimizer
            for group in inner.param_groups:
                if "step" in group:
                    steps.add(int(group["step"]))
                for p in group["params"]:
                    if "step" in inner.state.get(p, {}):
                        steps.add(int(inner.state[p]["step"]))
        return steps

    def set_adam_step(self, step: int) -> None:
        """Adam's step count, wherever the optimizers keep it (in place: a tensor step is filled)."""
        for opt in self.optimizers:
            inner = opt.optimizer
            for group in inner.param_groups:
                if "step" in group:
                    group["step"] = step
                for p in group["params"]:
                    held = inner.state[p].get("step")
                    if isinstance(held, torch.Tensor):
                        held.fill_(step)


def hf_optimizer_state(shards: OptimizerShards, config: TrainerConfig, eps: float) -> dict[str, Any]:
    """The ``DistributedOptimizer``'s Adam state as the torch backend's ``optimizer.pt`` dict:
    moments gathered (data and tensor parallel) and converted to Hugging Face names and layouts
    with the weights' code, float32 CPU tensors. Every rank calls it and gets the whole dict.
    ``config``: the role and its hyperparameters (``eps``: Adam's, from megatron's optimizer config)."""
    steps = shards.adam_steps() or {0}
    if len(steps) > 1:
        raise RuntimeError(f"{config.role}: Adam's step counts differ across parameters {steps}")
    moments = {
        key: of.moments_to_hf(shards.gathered(key), shards.shape, shards.critic) for key in of.ADAM_MOMENTS
    }
    group = of.adam_param_group(
        of.optimizer_names(shards.shape, shards.critic),
        lr=config.lr,
        betas=config.betas,
        eps=eps,
        weight_decay=config.weight_decay,
    )
    return of.adam_state_dict(moments, steps.pop(), group)


def load_hf_optimizer_state(shards: OptimizerShards, state: Mapping[str, Any], role: str) -> None:
    """An ``optimizer.pt`` dict (either backend's) into this rank's shards of the Adam moments and
    the step count, in the tensors the optimizer holds (the caller runs it in the memory backend's
    optimizer region, without gradients)."""
    names = of.optimizer_names(shards.shape, shards.critic)
    adam = of.read_adam_state(state, names, source=f"{role} optimizer state")
    init_optimizer_state(shards.optimizers)  # present since setup; a no-op then
    for key in of.ADAM_MOMENTS:
        shards.scatter(key, of.moments_to_megatron(adam.moments[key], shards.shape, shards.critic))
    shards.set_adam_step(adam.step)
