"""A critic that starts from a separately trained value model (``train.critic_init_from``).

The source is a folder of one of three kinds:

- a critic checkpoint of this project: a run's ``<checkpoint>/critic/`` folder, or the checkpoint folder
  holding it (``step_000010/``); its ``model.safetensors`` holds ``backbone.*`` and ``value_head.*``;
- a Hugging Face folder (``config.json`` and ``model.safetensors`` or its index) of a value model whose
  head is one of ``HEADS``: ``score.*`` (``AutoModelForTokenClassification`` or
  ``AutoModelForSequenceClassification`` with ``num_labels=1``, as OpenRLHF and TRL's reward trainer save
  them), ``v_head.summary.*`` (TRL's ``AutoModelForCausalLMWithValueHead``) or ``value_head.*``
  (OpenRLHF's critic).

The head becomes the critic's ``value_head``; every other tensor the critic holds is found under the
critic's name, the backbone's bare name or the model's (``<base_model_prefix>.*``), as a policy
checkpoint loads (``models.map_policy_state_to_critic``); the rest (an LM head, OpenRLHF's reward
normalisation buffers) is ignored. Every critic tensor must be found at its shape.

The mapping (``plan``) reads names and shapes only: ``problem`` runs it on the safetensors headers
before Ray starts (ppo-driver's preflight), ``load_into`` on the same names when the critic is built.
This module imports neither torch nor transformers until ``load_into`` or ``critic_shapes`` runs.
A resumed run loads its checkpoint over these weights: the source decides step 0 only.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from ppo_trainer.models import CriticModel

__all__ = ["FIELD", "HEADS", "ValueSource", "find_source", "load_into", "plan", "problem", "tensor_shapes"]

FIELD = "train.critic_init_from"
# A value head's prefix in the source -> the critic's, in the order they are looked for.
HEADS = ("score.", "v_head.summary.", "value_head.")
_MODEL_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"

Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class ValueSource:
    """A value model's folder, as ``find_source`` resolved it: its kind and its safetensors files."""

    folder: Path
    kind: Literal["checkpoint", "huggingface"]
    files: tuple[Path, ...]


def _refuse(path: str | Path, why: str) -> ValueError:
    return ValueError(f"{FIELD}={str(path)!r}: {why}")


def find_source(path: str | Path) -> ValueSource:
    """The source folder's kind and files; ``ValueError`` naming the setting when it is neither kind."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise _refuse(path, "is not a folder; give a run's critic checkpoint folder or a Hugging Face folder")
    if (folder / "critic" / _MODEL_FILE).is_file():
        folder = folder / "critic"
    state_file = folder / "trainer_state.json"
    if (folder / _MODEL_FILE).is_file() and state_file.is_file():
        role = json.loads(state_file.read_text()).get("role")
        if role != "critic":
            raise _refuse(path, f"holds the {role}'s checkpoint; give the critic's (<checkpoint>/critic)")
        return ValueSource(folder, "checkpoint", (folder / _MODEL_FILE,))
    if (folder / "config.json").is_file():
        return ValueSource(folder, "huggingface", _hf_files(path, folder))
    if any(folder.glob("step_*")):
        raise _refuse(path, "is a checkpoints folder; give one of its checkpoints (e.g. its latest step_*)")
    raise _refuse(
        path,
        "holds neither a critic checkpoint (critic/model.safetensors) nor a Hugging Face model "
        "(config.json); give one of them",
    )


def _hf_files(path: str | Path, folder: Path) -> tuple[Path, ...]:
    if (folder / _MODEL_FILE).is_file():
        return (folder / _MODEL_FILE,)
    if (folder / _INDEX_FILE).is_file():
        weight_map = json.loads((folder / _INDEX_FILE).read_text()).get("weight_map", {})
        return tuple(folder / name for name in sorted(set(weight_map.values())))
    raise _refuse(
        path,
        "has no model.safetensors (pytorch_model.bin is not read: it unpickles); save the value model "
        "with save_pretrained(..., safe_serialization=True)",
    )


def tensor_shapes(source: ValueSource) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, from the files' safetensors headers (no weights read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in source.files:
        try:
            with file.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            for name, entry in header.items():
                if name != "__metadata__":
                    shapes[name] = tuple(entry["shape"])
        except (struct.error, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _refuse(source.folder, f"{file.name} has no readable safetensors header ({exc!r})") from exc
    return shapes


def _head(source: str | Path, names: Shapes) -> str:
    found = [h for h in HEADS if any(n.startswith(h) for n in names)]
    if not found:
        raise _refuse(
            source,
            f"has no value head ({', '.join(h + '*' for h in HEADS)}); give a value model (e.g. "
            "AutoModelForTokenClassification with num_labels=1), not a policy",
        )
    if len(found) > 1:
        raise _refuse(source, f"has two value heads ({', '.join(h + '*' for h in found)}); keep one")
    return found[0]


def _candidates(name: str, head: str, prefix: str) -> list[str]:
    """The critic's names ``name`` (a source tensor) may stand for, best first."""
    if name.startswith(head):
        return ["value_head." + name.removeprefix(head)]
    out = [name, f"backbone.{name}"]
    if prefix and name.startswith(prefix + "."):
        out.append(f"backbone.{name.removeprefix(prefix + '.')}")
    return out


def plan(source: str | Path, given: Shapes, critic: Shapes, prefix: str) -> dict[str, str]:
    """Each critic tensor -> the source tensor it is loaded from. ``given``: the source's names and
    shapes; ``critic``: the critic's; ``prefix``: its backbone's ``base_model_prefix``. ``ValueError``
    (one line naming ``FIELD``) for adapters, no value head, a tensor of another shape or one missing
    (a head without a bias may be: the critic's is then zero)."""
    adapters = [n for n in given if ".lora_A." in n or ".lora_B." in n]
    if adapters:
        raise _refuse(
            source, f"holds LoRA adapters ({adapters[0]}); give a critic trained without train.lora"
        )
    head = _head(source, given)
    chosen: dict[str, str] = {}
    for name in given:
        target = next((c for c in _candidates(name, head, prefix) if c in critic), None)
        if target is not None:
            chosen.setdefault(target, name)
    for target, shape in critic.items():  # the first mismatch in the critic's order
        found = chosen.get(target)
        if found is not None and tuple(given[found]) != tuple(shape):
            raise _refuse(
                source,
                f"tensor {found!r} has shape {tuple(given[found])} but the critic's {target!r} has "
                f"{tuple(shape)}; give a value model of model.path's architecture with one output",
            )
    # A head without a bias (LlamaForSequenceClassification's score): the critic's is zero.
    optional = {"value_head.bias"} if "value_head.weight" in chosen else set()
    missing = [n for n in critic if n not in chosen and n not in optional]
    if missing:
        raise _refuse(
            source,
            f"lacks {len(missing)} of the critic's {len(critic)} tensors (e.g. {missing[0]!r}); it is not "
            "a value model of model.path's architecture",
        )
    return chosen


def critic_shapes(model_config: Any) -> tuple[dict[str, tuple[int, ...]], str]:
    """The critic's tensor names and shapes for a transformers config, and its backbone's
    ``base_model_prefix``: the backbone is built on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModel

    from ppo_trainer.models import hidden_size

    with torch.device("meta"):
        backbone = AutoModel.from_config(model_config)
    shapes = {f"backbone.{k}": tuple(v.shape) for k, v in backbone.state_dict().items()}
    hidden = hidden_size(model_config)
    shapes |= {"value_head.weight": (1, hidden), "value_head.bias": (1,)}
    return shapes, getattr(backbone, "base_model_prefix", "")


def problem(path: str | Path, model_config: Any) -> str | None:
    """One line (naming ``FIELD``) when ``path`` cannot initialise the critic of ``model_config``;
    headers only, for the checks before Ray."""
    try:
        source = find_source(path)
        shapes, prefix = critic_shapes(model_config)
        plan(path, tensor_shapes(source), shapes, prefix)
    except (ValueError, OSError) as exc:
        return str(exc)
    return None


def load_into(critic: CriticModel, path: str | Path) -> ValueSource:
    """The source's value head and backbone into ``critic`` (float32, every tensor; before any
    converter wraps the model). Returns the source it read."""
    import torch
    from safetensors import safe_open

    source = find_source(path)
    own = critic.state_dict()
    prefix = getattr(critic.backbone, "base_model_prefix", "")
    chosen = plan(path, tensor_shapes(source), {k: tuple(v.shape) for k, v in own.items()}, prefix)
    wanted = {name: target for target, name in chosen.items()}
    state = {"value_head.bias": torch.zeros_like(critic.value_head.bias)}
    for file in source.files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in wanted:
                    state[wanted[name]] = f.get_tensor(name).to(own[wanted[name]].dtype)
    critic.load_state_dict(state, strict=True)
    return source
