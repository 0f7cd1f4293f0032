"""The torch backend's checkpoint: one role's state captured and written, and loaded back.

The files are ``checkpoint.format``'s. Replicated, rank 0 writes its model and optimizer; sharded,
every rank takes part in gathering them (``torch.distributed.checkpoint``'s full state dicts) and rank 0
writes; asleep, ``checkpoint.sharded`` gathers the ranks' host copies of their shards to rank 0
instead, into the same files. Every rank writes its RNG state.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, load_model, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from transformers import PreTrainedModel

from ppo_lifecycle.memory.protocol import HostCopies
from ppo_trainer.backend_protocol import TrainerBackend
from ppo_trainer.checkpoint import format as fmt
from ppo_trainer.checkpoint import torch_optimizer
from ppo_trainer.checkpoint.protocol import TorchCheckpointable
from ppo_trainer.converters import lora
from ppo_trainer.errors import NonFiniteWeightsError
from ppo_trainer.models import CriticModel, load_policy_state_into_critic, map_policy_state_to_critic
from ppo_weight_sync import non_finite_names

# Whole tensors in, each rank keeps its shard; names were checked before (tied aliases are absent).
_SCATTER_PARTIAL = StateDictOptions(full_state_dict=True, strict=False)


@dataclass(frozen=True)
class PolicyExport:
    """What ``hf/`` is written from: the policy model (its config and class) and, when the model's own
    tensors cannot be read (sharded, or asleep), the state dict to write instead."""

    model: PreTrainedModel
    state_dict: dict[str, torch.Tensor] | None
    architecture: str | None  # set: record this class name in config.json (FSDP renames the class)
    tokenizer_source: Path
    # LoRA: adapter_config.json's content and the adapter tensors in PEFT's names (``hf_adapter/``)
    adapter: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None


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
    if policy is not None and policy.adapter is not None:
        adapter_config, adapter_tensors = policy.adapter
        policy = dataclasses.replace(policy, adapter=(adapter_config, tree(adapter_tensors) or {}))
    return dataclasses.replace(state, model=tree(state.model), optimizer=optimizer, policy=policy)


def capture(trainer: TorchCheckpointable, step: int | None, host: HostCopies | None = None) -> ShardState:
    """This rank's checkpoint state. Sharded, a collective (every rank gathers).

    ``host``: the trainer is asleep and its tensors are read from the host copies its sleep made
    (replicated only: a sharded role gathers over process groups that are gone while it sleeps;
    ``checkpoint.sharded`` writes an asleep sharded role over a group of its own).
    """
    if host is not None and trainer.sharded:
        raise ValueError(
            "capture(host=...): a sharded role gathers its state over its process group; wake it, "
            "or write it with ppo_trainer.checkpoint.sharded"
        )
    rank = trainer.dp.rank
    rng = fmt.rng_state()
    model_state: Mapping[str, Any] = {}
    optimizer_state: dict[str, Any] = {}
    if trainer.sharded:
        model_state = get_model_state_dict(trainer.model, options=torch_optimizer.GATHER)  # collective
        optimizer_state = torch_optimizer.named_state(trainer.model, trainer.optimizer, sharded=True)
    elif rank == 0:
        model_state = trainer.model.state_dict()
        optimizer_state = torch_optimizer.named_state(trainer.model, trainer.optimizer, sharded=False)
        if host is not None:
            # A shared base (train.lora.share_base) stays resident and frozen: read as it is.
            kept = {k: v for k, v in model_state.items() if _in_shared_base(trainer, v)}
            rest = {k: v for k, v in model_state.items() if k not in kept}
            rest, optimizer_state = from_host(rest, optimizer_state, host)
            model_state = {k: kept[k] if k in kept else rest[k] for k in model_state}
    if rank != 0:
        return ShardState(rank=rank, rng=rng)
    return whole_state(trainer, step, rng, model_state, optimizer_state, given=host is not None)


def _in_shared_base(trainer: TorchCheckpointable, value: Any) -> bool:
    shared = trainer.shared_base
    return shared is not None and isinstance(value, torch.Tensor) and shared.holds(value)


def whole_state(
    trainer: TorchCheckpointable,
    step: int | None,
    rng: tuple[dict[str, torch.Tensor], dict[str, str]],
    model_state: Mapping[str, Any],
    optimizer_state: dict[str, Any],
    *,
    given: bool,
) -> ShardState:
    """Rank 0's ``ShardState`` from whole tensors in the trainer's names (what ``capture`` gathered or
    read; ``checkpoint.sharded`` assembles them from a sharded role's host copies). ``given``:
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
        converter = trainer.lora
        exported: dict[str, torch.Tensor] | None = dict(model_state) if as_given else None
        adapter = None
        if converter is not None:
            # hf/ holds the merged weights under the base's names; hf_adapter/ the adapters alone.
            exported = trainer.export_state(model_state)
            adapter = lora.peft_adapter(converter, model_state, trainer.config.model_path)
        policy = PolicyExport(
            model=cast(PreTrainedModel, trainer.model),  # the actor's model is a causal LM
            state_dict=exported,
            architecture=trainer.architecture if trainer.sharded else None,
            tokenizer_source=Path(trainer.config.model_path),
            adapter=adapter,
        )
    return ShardState(
        rank=rank,
        rng=rng,
        model=drop_tied_aliases(trainer.model, model_state),
        optimizer=optimizer_state,
        trainer_state={
            "format_version": fmt.FORMAT_VERSION,
            "role": trainer.config.role,
            "world_size": trainer.dp.world_size,
            "data_parallel": "fsdp2" if trainer.sharded else "replicate",
            "step": step,
        },
        policy=policy,
    )


def from_host(
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
    fmt.write_rng(folder, state.rank, state.rng)
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
        fmt.copy_tokenizer(policy.tokenizer_source, hf)
        if policy.adapter is not None:
            adapter_config, adapter_tensors = policy.adapter
            peft = folder / "hf_adapter"
            peft.mkdir()
            (peft / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
            save_file(adapter_tensors, str(peft / "adapter_model.safetensors"))


def save_shard(trainer: TrainerBackend, folder: Path, step: int | None) -> None:
    """Write this rank's part of the checkpoint into ``folder`` (the temporary ``<role>.tmp``)."""
    write_shard(capture(_torch_trainer(trainer), step), folder)


def _torch_trainer(trainer: TrainerBackend) -> TorchCheckpointable:
    # save_shard/load_shard satisfy backend_protocol.CheckpointIO, typed for any backend.
    if not isinstance(trainer, TorchCheckpointable) or trainer.config.backend != "torch":
        raise TypeError(
            f"checkpoint.torch_io saves the torch backend; this is {trainer.config.backend!r} "
            "(use ppo_trainer.checkpoint.megatron_io)"
        )
    return trainer


def _parameter_names(model: nn.Module) -> list[list[str]]:
    """Every name of each parameter: one name, or several for tied weights."""
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    return list(names_of.values())


def drop_tied_aliases(model: nn.Module, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
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


def load_shard(trainer: TrainerBackend, folder: Path) -> int | None:
    """Restore model, optimizer and this rank's RNG from ``folder`` (a ``<role>/`` folder); returns the step.

    A critic accepts an actor's ``model.safetensors`` (a policy checkpoint): its backbone loads and the
    value head stays fresh; the optimizer state is then not loaded (it belongs to another model).
    """
    return _load(_torch_trainer(trainer), folder)


def _load(trainer: TorchCheckpointable, folder: Path) -> int | None:
    model_file, saved = fmt.read_saved(folder, trainer.config.role)
    saved_role = saved.get("role", trainer.config.role)
    with trainer.region(trainer.WEIGHTS_TAG):
        if isinstance(trainer.model, CriticModel) and saved_role != "critic":
            _load_policy_into_critic(trainer, model_file)
            return None
        if saved_role != trainer.config.role:
            raise ValueError(f"{folder} holds a {saved_role} checkpoint; it cannot be loaded into the actor")
        _load_model(trainer, model_file)
    optimizer_file = folder / "optimizer.pt"
    if optimizer_file.is_file():
        location = torch.device("cpu") if trainer.sharded else trainer.device
        trainer.load_hf_optimizer_state(torch.load(optimizer_file, map_location=location, weights_only=True))
    if not fmt.restore_rng(folder, trainer.dp.rank):
        # Resuming with more ranks than were saved: the new ranks start from the configured seed.
        torch.manual_seed(trainer.config.seed + trainer.dp.rank)
    return fmt.saved_step(saved)


def _load_policy_into_critic(trainer: TorchCheckpointable, model_file: Path) -> None:
    """A policy checkpoint's backbone into the critic (its value head stays)."""
    assert isinstance(trainer.model, CriticModel)
    if trainer.sharded:
        mapped, _ = map_policy_state_to_critic(trainer.model, load_file(str(model_file)))
        set_model_state_dict(trainer.model, dict(mapped), options=_SCATTER_PARTIAL)
    elif trainer.shared_base is not None:
        # The policy's base tensors are the actor's to write into the shared base (it loads them too).
        mapped, _ = map_policy_state_to_critic(
            trainer.model, load_file(str(model_file), device=str(trainer.device))
        )
        own = trainer.model.state_dict(keep_vars=True)
        trainer.model.load_state_dict(
            {k: v for k, v in mapped.items() if not trainer.maps_shared(own[k])}, strict=False
        )
    else:
        state = load_file(str(model_file), device=str(trainer.device))
        load_policy_state_into_critic(trainer.model, state)


def _load_with_shared_base(trainer: TorchCheckpointable, model_file: Path) -> tuple[list[str], list[str]]:
    """``model.safetensors`` into a model whose frozen base is shared (``train.lora.share_base``; its
    tensors are views into one buffer, which safetensors' ``load_model`` refuses). The actor, the
    owner, writes the base; the critic leaves it to the owner (the actor loads the same bytes from its
    own file) and checks each of its tensors bit for bit."""
    state = load_file(str(model_file), device=str(trainer.device))
    missing, unexpected = _compare_names(trainer.model, state)
    own = trainer.model.state_dict(keep_vars=True)
    rest = {}
    for name, tensor in state.items():
        held = own.get(name)
        if held is not None and trainer.maps_shared(held):
            if not torch.equal(held.detach().view(torch.uint8), tensor.view(torch.uint8)):
                raise ValueError(
                    f"{model_file}: {name} differs from the actor's shared base; the checkpoint is of "
                    "another base model: resume with train.lora.share_base=false or from its own run"
                )
        else:
            rest[name] = tensor
    trainer.model.load_state_dict(rest, strict=False)
    return missing, unexpected


def _load_model(trainer: TorchCheckpointable, model_file: Path) -> None:
    """``model.safetensors`` of this role into the model; ``ValueError`` when the names differ."""
    if trainer.sharded:
        # Every rank reads the whole file and keeps its shard (the folder is shared, as for saving).
        state = load_file(str(model_file))
        missing, unexpected = _compare_names(trainer.model, state)
        if not (missing or unexpected):
            set_model_state_dict(trainer.model, dict(state), options=_SCATTER_PARTIAL)
    elif trainer.shared_base is not None:
        missing, unexpected = _load_with_shared_base(trainer, model_file)
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
