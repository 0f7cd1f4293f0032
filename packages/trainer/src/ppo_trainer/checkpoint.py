"""Save and load one role's training state to a folder, without pickle on the way in.

Layout of ``<folder>/<role>/``::

    model.safetensors       the trained model (critic: backbone.* and value_head.*), whole tensors
    optimizer.pt            AdamW state dict keyed by parameter name, whole tensors (tensors and
                            numbers only; read with weights_only=True)
    rng_rank<r>.safetensors torch CPU/CUDA generator states; python and numpy states as JSON metadata
    trainer_state.json      role, world size, data parallelism, last step, format version
    hf/                     actor only: save_pretrained output plus the tokenizer files of model_path

The files hold whole tensors whichever data parallelism wrote them, so a checkpoint written by
replicated ranks loads into FSDP2 ranks and back, at any world size. Replicated, rank 0 writes its
model and optimizer; sharded, every rank takes part in gathering them (``torch.distributed.checkpoint``'s
full state dicts) and rank 0 writes; asleep, ``sharded_save`` gathers the ranks' host copies of their
shards to rank 0 instead, into the same files. Every rank writes its RNG state. The group writes into
``<role>.tmp`` and renames it into place, so a crash never leaves a half-written ``<role>/``.

Format 1 keyed the optimizer state by parameter index; it still loads.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import PreTrainedModel

from ppo_lifecycle.memory import HostCopies
from ppo_trainer.backend import TorchTrainer, init_adam_state
from ppo_trainer.backend_protocol import TrainerBackend
from ppo_trainer.errors import NonFiniteWeightsError
from ppo_trainer.models import CriticModel, load_policy_state_into_critic, map_policy_state_to_critic
from ppo_weight_sync import non_finite_names

FORMAT_VERSION = 2
# Whole tensors, gathered to rank 0's host memory (other ranks get empty dicts).
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
# Whole tensors in, each rank keeps its shard; names were checked before (tied aliases are absent).
_SCATTER_PARTIAL = StateDictOptions(full_state_dict=True, strict=False)
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


@dataclass(frozen=True)
class PolicyExport:
    """What ``hf/`` is written from: the policy model (its config and class) and, when the model's own
    tensors cannot be read (sharded, or asleep), the state dict to write instead."""

    model: PreTrainedModel
    state_dict: dict[str, torch.Tensor] | None
    architecture: str | None  # set: record this class name in config.json (FSDP renames the class)
    tokenizer_source: Path


@dataclass(frozen=True)
class ShardState:
    """One rank's part of a checkpoint, captured and ready to be written (``write_shard``).

    Rank 0 carries the model, optimizer and trainer state; every rank its RNG state. Tensors are the
    trainer's own (resident), gathered copies (sharded) or host copies made by a sleep (``capture``
    with ``host``): writing reads them, so the latter stay valid only until the role sleeps again.
    """

    rank: int
    rng: tuple[dict[str, torch.Tensor], dict[str, str]]
    model: dict[str, torch.Tensor] | None = None
    optimizer: dict[str, Any] | None = None
    trainer_state: dict[str, Any] | None = None
    policy: PolicyExport | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the model and optimizer tensors this rank writes."""
        tensors = list((self.model or {}).values())
        for values in (self.optimizer or {}).get("state", {}).values():
            tensors += [v for v in values.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


def private_copy(state: ShardState) -> ShardState:
    """``state`` with every tensor copied into memory of its own (tensors viewing the same bytes,
    tied weights, stay one copy), so that the buffers it was captured from may be reused."""
    memo: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], torch.Tensor] = {}

    def copy(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), t.stride(), t.dtype)
        if key not in memo:
            memo[key] = t.detach().clone()
        return memo[key]

    def tree(d: Mapping[str, Any] | None) -> dict[str, Any] | None:
        return None if d is None else {k: copy(v) for k, v in d.items()}

    optimizer = state.optimizer
    if optimizer is not None:
        optimizer = {**optimizer, "state": {n: tree(v) for n, v in optimizer["state"].items()}}
    policy = state.policy
    if policy is not None and policy.state_dict is not None:
        policy = dataclasses.replace(policy, state_dict=tree(policy.state_dict))
    return dataclasses.replace(state, model=tree(state.model), optimizer=optimizer, policy=policy)


def capture(trainer: TorchTrainer, step: int | None, host: HostCopies | None = None) -> ShardState:
    """This rank's checkpoint state. Sharded, a collective (every rank gathers).

    ``host``: the trainer is asleep and its tensors are read from the host copies its sleep made
    (replicated only: a sharded role gathers over process groups that are gone while it sleeps;
    ``ppo_trainer.sharded_save`` writes an asleep sharded role over a group of its own).
    """
    if host is not None and trainer.sharded:
        raise ValueError(
            "capture(host=...): a sharded role gathers its state over its process group; wake it, "
            "or write it with ppo_trainer.sharded_save"
        )
    rank = trainer.dp.rank
    rng = _rng_state()
    model_state: Mapping[str, Any] = {}
    optimizer_state: dict[str, Any] = {}
    if trainer.sharded:
        model_state = get_model_state_dict(trainer.model, options=_GATHER)  # collective
        # torch.distributed.checkpoint fills an empty optimizer state by taking a step with lr 0,
        # which would count as Adam's first step: an empty state (never since the state is made at
        # setup, kept for optimizers without that) has nothing to gather anyway.
        if trainer.optimizer.state:
            optimizer_state = _compact(
                dict(get_optimizer_state_dict(trainer.model, trainer.optimizer, options=_GATHER))
            )
        else:
            optimizer_state = optimizer_state_by_name(trainer.model, trainer.optimizer.state_dict())
    elif rank == 0:
        model_state = trainer.model.state_dict()
        optimizer_state = optimizer_state_by_name(trainer.model, trainer.optimizer.state_dict())
        if host is not None:
            model_state, optimizer_state = _from_host(model_state, optimizer_state, host)
    if rank != 0:
        return ShardState(rank=rank, rng=rng)
    return whole_state(trainer, step, rng, model_state, optimizer_state, given=host is not None)


def whole_state(
    trainer: TorchTrainer,
    step: int | None,
    rng: tuple[dict[str, torch.Tensor], dict[str, str]],
    model_state: Mapping[str, Any],
    optimizer_state: dict[str, Any],
    *,
    given: bool,
) -> ShardState:
    """Rank 0's ``ShardState`` from whole tensors in the trainer's names (what ``capture`` gathered or
    read; ``ppo_trainer.sharded_save`` assembles them from a sharded role's host copies). ``given``:
    the model's own tensors cannot be read for ``hf/`` (asleep), so it is written from ``model_state``.
    Raises ``NonFiniteWeightsError`` for a non-finite weight."""
    rank = trainer.dp.rank
    # Per tensor, before anything is written: a checkpoint never holds non-finite weights (the
    # staging folder is never committed, so no COMPLETE checkpoint does either).
    bad = non_finite_names([(k, v) for k, v in model_state.items() if isinstance(v, torch.Tensor)])
    if bad:
        raise NonFiniteWeightsError(trainer.config.role, rank, bad, "save")
    policy = None
    if trainer.config.role == "actor":
        as_given = trainer.sharded or given
        policy = PolicyExport(
            model=cast(PreTrainedModel, trainer.model),  # the actor's model is a causal LM
            state_dict=dict(model_state) if as_given else None,
            architecture=trainer.architecture if trainer.sharded else None,
            tokenizer_source=Path(trainer.config.model_path),
        )
    return ShardState(
        rank=rank,
        rng=rng,
        model=_drop_tied_aliases(trainer.model, model_state),
        optimizer=optimizer_state,
        trainer_state={
            "format_version": FORMAT_VERSION,
            "role": trainer.config.role,
            "world_size": trainer.dp.world_size,
            "data_parallel": "fsdp2" if trainer.sharded else "replicate",
            "step": step,
        },
        policy=policy,
    )


def _compact(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """The state with each tensor in storage of its own size. A gathered tensor whose rows did not
    split evenly is a view of the gather's padded buffer on CPU (``.cpu()`` compacts it on a GPU), and
    ``torch.save`` writes a tensor's whole storage: the file would then depend on the device and on how
    it was gathered (``sharded_save`` assembles compact tensors)."""

    def own(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.untyped_storage().nbytes() != v.numel() * v.element_size():
            return v.clone()
        return v

    if "state" not in optimizer_state:  # ranks other than 0 gather nothing
        return optimizer_state
    state = {n: {k: own(v) for k, v in values.items()} for n, values in optimizer_state["state"].items()}
    return {**optimizer_state, "state": state}


def _from_host(
    model_state: Mapping[str, Any], optimizer_state: dict[str, Any], host: HostCopies
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both states with each tensor replaced by its host copy (other values as they are).

    One ``host_copies`` call for all of them: the backend indexes every host copy it holds on each
    call, so a call per parameter grows with the square of the tensor count."""
    slots: list[tuple[str | None, str]] = []  # (optimizer parameter name or None for the model, key)
    tensors: list[torch.Tensor] = []
    for key, value in model_state.items():
        if isinstance(value, torch.Tensor):
            slots.append((None, key))
            tensors.append(value)
    for name, values in optimizer_state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                slots.append((name, key))
                tensors.append(value)
    model = dict(model_state)
    state = {name: dict(values) for name, values in optimizer_state["state"].items()}
    for (name, key), copy in zip(slots, host.host_copies(tensors), strict=True):
        if name is None:
            model[key] = copy
        else:
            state[name][key] = copy
    return model, {**optimizer_state, "state": state}


def write_shard(state: ShardState, folder: Path) -> None:
    """Write a captured ``ShardState`` into ``folder`` (the temporary ``<role>.tmp``)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors, meta = state.rng
    save_file(tensors, str(folder / f"rng_rank{state.rank}.safetensors"), metadata=meta)
    if state.model is None or state.optimizer is None or state.trainer_state is None:
        return
    save_file(state.model, str(folder / "model.safetensors"))
    torch.save(state.optimizer, folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps(state.trainer_state, indent=2))
    if state.policy is not None:
        policy = state.policy
        hf = folder / "hf"
        if policy.state_dict is not None:
            policy.model.save_pretrained(hf, state_dict=policy.state_dict, safe_serialization=True)
        else:
            policy.model.save_pretrained(hf, safe_serialization=True)
        if policy.architecture is not None:
            _name_architecture(hf / "config.json", policy.architecture)
        for name in _TOKENIZER_FILES:
            if (policy.tokenizer_source / name).is_file():
                shutil.copy2(policy.tokenizer_source / name, hf / name)


def save_shard(trainer: TrainerBackend, folder: Path, step: int | None) -> None:
    """Write this rank's part of the checkpoint into ``folder`` (the temporary ``<role>.tmp``)."""
    write_shard(capture(_torch_trainer(trainer), step), folder)


def _torch_trainer(trainer: TrainerBackend) -> TorchTrainer:
    # save_shard/load_shard satisfy backend_protocol.CheckpointIO, typed for any backend.
    if not isinstance(trainer, TorchTrainer) or trainer.config.backend != "torch":
        raise TypeError(
            f"ppo_trainer.checkpoint saves the torch backend; this is {trainer.config.backend!r} "
            "(use ppo_trainer.megatron_checkpoint)"
        )
    return trainer


def _parameter_names(model: nn.Module) -> list[list[str]]:
    """Every name of each parameter: one name, or several for tied weights."""
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    return list(names_of.values())


def _drop_tied_aliases(model: nn.Module, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``state`` with one name per tied parameter (safetensors refuses shared tensors).

    The name kept is the tie's source (``model.embed_tokens.weight``, not ``lm_head.weight``, which
    transformers lists in ``_tied_weights_keys``): a critic built from this checkpoint looks its
    backbone's embedding up by that name. Without such a list, the alphabetically first is kept.
    """
    derived = set(getattr(model, "_tied_weights_keys", None) or ())  # a list or {derived: source}
    aliases: set[str] = set()
    for names in _parameter_names(model):
        keep = sorted(names, key=lambda n: (n in derived, n))[0]
        aliases.update(n for n in names if n != keep)
    return {name: t.detach().contiguous() for name, t in state.items() if name not in aliases}


def _compare_names(model: nn.Module, state: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """The model's names the file lacks (a tied alias counts as present) and the file's extra names."""
    expected = set(model.state_dict())
    alias_of = {name: set(names) for names in _parameter_names(model) for name in names}
    missing = [n for n in expected if n not in state and not (alias_of.get(n, set()) & state.keys())]
    return missing, [n for n in state if n not in expected]


def _name_architecture(config_file: Path, architecture: str) -> None:
    # FSDP wraps the model in a class of its own ("FSDPLlamaForCausalLM"), which save_pretrained
    # would record; engines pick their implementation by this name.
    config = json.loads(config_file.read_text())
    config["architectures"] = [architecture]
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _trainable_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def _keyed_by_name(state: dict[str, Any]) -> bool:
    # The param groups list every parameter even before the first step, when "state" is empty.
    return any(isinstance(p, str) for group in state["param_groups"] for p in group["params"])


def optimizer_state_by_name(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """An ``optimizer.state_dict()`` (keyed by parameter index) keyed by parameter name instead, the
    layout ``torch.distributed.checkpoint`` uses for full state dicts. A named one is returned as is."""
    if _keyed_by_name(state):
        return state
    names = _trainable_names(model)
    by_index = {i: names[i] for i in range(len(names))}
    return {
        "state": {by_index[int(k)]: v for k, v in state["state"].items()},
        "param_groups": [
            {**g, "params": [by_index[int(i)] for i in g["params"]]} for g in state["param_groups"]
        ],
    }


def optimizer_state_by_index(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The inverse of ``optimizer_state_by_name``, for ``optimizer.load_state_dict``."""
    if not _keyed_by_name(state):
        return state
    index = {name: i for i, name in enumerate(_trainable_names(model))}
    unknown = sorted(set(state["state"]) - set(index))
    if unknown:
        raise ValueError(f"optimizer state names parameters this model lacks: {unknown[:5]}")
    return {
        "state": {index[k]: v for k, v in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
    }


def _into_previous_tensors(optimizer: torch.optim.Optimizer, before: Mapping[Any, Mapping[str, Any]]) -> None:
    """Copy the loaded state into the tensors the optimizer held before the load, where they match.

    The memory backend keeps a host buffer per tracked storage (allocated at setup): new storages
    would need new buffers in the next sleep. Tensors read from a file may also share a storage that
    cannot be resized; the others get their own copies so the backend can release them.
    """
    for param, state in optimizer.state.items():
        old = before.get(param, {})
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            previous = old.get(key)
            if (
                isinstance(previous, torch.Tensor)
                and type(previous) is type(value)
                and previous.shape == value.shape
                and previous.dtype == value.dtype
                and previous.device == value.device
            ):
                previous.copy_(value)
                state[key] = previous
            else:
                state[key] = value.clone()


def load_optimizer_state(trainer: TorchTrainer, state: Mapping[str, Any]) -> None:
    """An ``optimizer.pt`` dict (keyed by index or by name; either backend's) into ``trainer``'s AdamW,
    in the tensors it holds (the memory backend tracks them). Every rank passes the whole dict."""
    whole = dict(state)
    with trainer.region(trainer.OPTIMIZER_TAG):
        before = {p: dict(s) for p, s in trainer.optimizer.state.items()}
        named = optimizer_state_by_name(trainer.model, whole)
        if trainer.sharded and named["state"]:
            set_optimizer_state_dict(
                trainer.model, trainer.optimizer, named, options=StateDictOptions(full_state_dict=True)
            )
        else:  # also an empty state into sharded ranks (see save_shard): no tensors to shard
            trainer.optimizer.load_state_dict(optimizer_state_by_index(trainer.model, whole))
        _into_previous_tensors(trainer.optimizer, before)
        init_adam_state(trainer.optimizer)  # a checkpoint written before any step may hold none


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


def load_shard(trainer: TrainerBackend, folder: Path) -> int | None:
    """Restore model, optimizer and this rank's RNG from ``folder`` (a ``<role>/`` folder); returns the step.

    A critic accepts an actor's ``model.safetensors`` (a policy checkpoint): its backbone loads and the
    value head stays fresh; the optimizer state is then not loaded (it belongs to another model).
    """
    trainer = _torch_trainer(trainer)
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
            if trainer.sharded:
                mapped, _ = map_policy_state_to_critic(trainer.model, load_file(str(model_file)))
                set_model_state_dict(trainer.model, dict(mapped), options=_SCATTER_PARTIAL)
            else:
                state = load_file(str(model_file), device=str(trainer.device))
                load_policy_state_into_critic(trainer.model, state)
            return None
        if saved_role != trainer.config.role:
            raise ValueError(f"{folder} holds a {saved_role} checkpoint; it cannot be loaded into the actor")
        if trainer.sharded:
            # Every rank reads the whole file and keeps its shard (the folder is shared, as for saving).
            state = load_file(str(model_file))
            missing, unexpected = _compare_names(trainer.model, state)
            if not (missing or unexpected):
                set_model_state_dict(trainer.model, dict(state), options=_SCATTER_PARTIAL)
        else:
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
        location = torch.device("cpu") if trainer.sharded else trainer.device
        load_optimizer_state(trainer, torch.load(optimizer_file, map_location=location, weights_only=True))
    rng_file = folder / f"rng_rank{trainer.dp.rank}.safetensors"
    if rng_file.is_file():
        _set_rng_state(rng_file)
    else:
        # Resuming with more ranks than were saved: the new ranks start from the configured seed.
        torch.manual_seed(trainer.config.seed + trainer.dp.rank)
    step = saved.get("step")
    return int(step) if step is not None else None
