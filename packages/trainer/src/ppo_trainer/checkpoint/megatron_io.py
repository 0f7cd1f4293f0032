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
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from ppo_trainer.backend_protocol import TrainerBackend
from ppo_trainer.checkpoint import format as fmt
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
