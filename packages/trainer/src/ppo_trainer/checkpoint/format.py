"""The files of one role's checkpoint folder, shared by both backends and every kind of save.

Layout of ``<folder>/<role>/``::

    model.safetensors       the trained model (critic: backbone.* and value_head.*), whole tensors
    optimizer.pt            AdamW state dict keyed by parameter name, whole tensors (tensors and
                            numbers only; read with weights_only=True; ``optimizer_format``)
    rng_rank<r>.safetensors torch CPU/CUDA generator states; python and numpy states as JSON metadata
    trainer_state.json      role, world size, data parallelism, last step, format version
    hf/                     actor only: save_pretrained output plus the tokenizer files of model_path

The files hold whole tensors whichever backend and data parallelism wrote them, so a checkpoint
written by replicated ranks loads into FSDP2 ranks or megatron ranks and back, at any world size. The
group writes into ``<role>.tmp`` and ``commit`` renames it into place, so a crash never leaves a
half-written ``<role>/``. Format 1 keyed the optimizer state by parameter index; it still loads on
the torch backend.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ppo_trainer.backend_protocol import TrainerBackend

FORMAT_VERSION = 2
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)


class CheckpointIO(Protocol):
    """How a worker saves and loads a role's checkpoint folder: ``checkpoint.torch_io`` (the torch
    backend) and ``checkpoint.megatron_io`` (the megatron backend; same files)."""

    def save_shard(self, trainer: TrainerBackend, folder: Path, step: int | None) -> None:
        """Write this rank's part into ``folder`` (the staging ``<role>.tmp``); every rank calls it."""
        ...

    def load_shard(self, trainer: TrainerBackend, folder: Path) -> int | None:
        """Restore the model, the optimizer and this rank's RNG from a ``<role>/`` folder; the step."""
        ...


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This process's torch CPU/CUDA generator states as tensors; python's and numpy's as JSON metadata."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["torch_cuda"] = torch.cuda.get_rng_state()
    version, state, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    assert isinstance(np_state, dict)
    np_json = {
        "bit_generator": np_state["bit_generator"],
        "state": {"key": np_state["state"]["key"].tolist(), "pos": int(np_state["state"]["pos"])},
        "has_gauss": int(np_state["has_gauss"]),
        "gauss": float(np_state["gauss"]),
    }
    meta = {"python": json.dumps([version, list(state), gauss]), "numpy": json.dumps(np_json)}
    return tensors, meta


def set_rng_state(path: Path) -> None:
    """Restore the generator states ``rng_state`` wrote into the file ``path``."""
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["torch_cuda"])
    if "python" in meta:
        version, state, gauss = json.loads(meta["python"])
        random.setstate((version, tuple(state), gauss))
    if "numpy" in meta:
        np_json = json.loads(meta["numpy"])
        np.random.set_state(
            {
                "bit_generator": np_json["bit_generator"],
                "state": {
                    "key": np.array(np_json["state"]["key"], dtype=np.uint32),
                    "pos": np_json["state"]["pos"],
                },
                "has_gauss": np_json["has_gauss"],
                "gauss": np_json["gauss"],
            }
        )


def write_rng(folder: Path, rank: int, state: tuple[dict[str, torch.Tensor], dict[str, str]]) -> None:
    """Rank ``rank``'s generator states (``rng_state``) into ``folder``."""
    tensors, meta = state
    save_file(tensors, str(folder / f"rng_rank{rank}.safetensors"), metadata=meta)


def restore_rng(folder: Path, rank: int) -> bool:
    """Rank ``rank``'s generator states from ``folder``; False when it holds none for that rank."""
    path = folder / f"rng_rank{rank}.safetensors"
    if not path.is_file():
        return False
    set_rng_state(path)
    return True


def copy_tokenizer(source: Path, hf: Path) -> None:
    """The tokenizer files of the model folder ``source`` into the checkpoint's ``hf/``."""
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, hf / name)


def read_saved(folder: Path, role: str) -> tuple[Path, dict[str, Any]]:
    """A ``<role>/`` folder's ``model.safetensors`` (``FileNotFoundError`` without it) and its
    ``trainer_state.json`` (empty when absent)."""
    model_file = folder / "model.safetensors"
    if not model_file.is_file():
        raise FileNotFoundError(f"{model_file} not found; is {folder} a {role} checkpoint folder?")
    state_file = folder / "trainer_state.json"
    saved = json.loads(state_file.read_text()) if state_file.is_file() else {}
    return model_file, saved


def saved_step(saved: dict[str, Any]) -> int | None:
    """The training step a ``trainer_state.json`` records (None: saved before any step)."""
    step = saved.get("step")
    return int(step) if step is not None else None


def commit(tmp: Path, final: Path) -> None:
    """Move a finished ``tmp`` into ``final``, replacing an older one; safe to call again after a crash."""
    if not tmp.exists():
        if final.exists():
            return  # already committed by an earlier call
        raise FileNotFoundError(f"checkpoint staging folder {tmp} does not exist; save_shard did not run")
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)
