"""Save and load one role's training state to a folder, without pickle on the way in.

Layout of ``<folder>/<role>/``::

    model.safetensors       the trained model (critic: backbone.* and value_head.*)
    optimizer.pt            AdamW state dict (tensors and numbers only; read with weights_only=True)
    rng_rank<r>.safetensors torch CPU/CUDA generator states; python and numpy states as JSON metadata
    trainer_state.json      role, world size, last step, format version
    hf/                     actor only: save_pretrained output plus the tokenizer files of model_path

Rank 0 writes the replicated model and optimizer; every rank writes its RNG state. The group writes
into ``<role>.tmp`` and renames it into place, so a crash never leaves a half-written ``<role>/``.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_file, save_model

from ppo_trainer.backend import TorchTrainer
from ppo_trainer.models import CriticModel, load_policy_state_into_critic

FORMAT_VERSION = 1
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
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


def _set_rng_state(path: Path) -> None:
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


def save_shard(trainer: TorchTrainer, folder: Path, step: int | None) -> None:
    """Write this rank's part of the checkpoint into ``folder`` (the temporary ``<role>.tmp``)."""
    folder.mkdir(parents=True, exist_ok=True)
    rank = trainer.dp.rank
    tensors, meta = _rng_state()
    save_file(tensors, str(folder / f"rng_rank{rank}.safetensors"), metadata=meta)
    if rank != 0:
        return
    save_model(trainer.model, str(folder / "model.safetensors"))
    torch.save(trainer.optimizer.state_dict(), folder / "optimizer.pt")
    state: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "role": trainer.config.role,
        "world_size": trainer.dp.world_size,
        "step": step,
    }
    (folder / "trainer_state.json").write_text(json.dumps(state, indent=2))
    if trainer.config.role == "actor":
        hf = folder / "hf"
        trainer.model.save_pretrained(hf, safe_serialization=True)  # type: ignore[operator]
        source = Path(trainer.config.model_path)
        for name in _TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, hf / name)


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


def load_shard(trainer: TorchTrainer, folder: Path) -> int | None:
    """Restore model, optimizer and this rank's RNG from ``folder`` (a ``<role>/`` folder); returns the step.

    A critic accepts an actor's ``model.safetensors`` (a policy checkpoint): its backbone loads and the
    value head stays fresh; the optimizer state is then not loaded (it belongs to another model).
    """
    model_file = folder / "model.safetensors"
    if not model_file.is_file():
        raise FileNotFoundError(
            f"{model_file} not found; is {folder} a {trainer.config.role} checkpoint folder?"
        )
    state_file = folder / "trainer_state.json"
    saved = json.loads(state_file.read_text()) if state_file.is_file() else {}
    saved_role = saved.get("role", trainer.config.role)
    with trainer.region(trainer.WEIGHTS_TAG):
        if isinstance(trainer.model, CriticModel) and saved_role != "critic":
            state = load_file(str(model_file), device=str(trainer.device))
            load_policy_state_into_critic(trainer.model, state)
            return None
        if saved_role != trainer.config.role:
            raise ValueError(f"{folder} holds a {saved_role} checkpoint; it cannot be loaded into the actor")
        missing, unexpected = load_model(
            trainer.model, str(model_file), strict=False, device=str(trainer.device)
        )
        if missing or unexpected:
            raise ValueError(
                f"{model_file} does not match the {trainer.config.role} model: "
                f"missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
    optimizer_file = folder / "optimizer.pt"
    if optimizer_file.is_file():
        optimizer_state = torch.load(optimizer_file, map_location=trainer.device, weights_only=True)
        with trainer.region(trainer.OPTIMIZER_TAG):
            trainer.optimizer.load_state_dict(optimizer_state)
            # Tensors read from a file may share a storage that cannot be resized; own copies let the
            # memory backend release and restore them like any other optimizer state.
            for state in trainer.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        state[key] = value.clone()
    rng_file = folder / f"rng_rank{trainer.dp.rank}.safetensors"
    if rng_file.is_file():
        _set_rng_state(rng_file)
    else:
        # Resuming with more ranks than were saved: the new ranks start from the configured seed.
        torch.manual_seed(trainer.config.seed + trainer.dp.rank)
    step = saved.get("step")
    return int(step) if step is not None else None
