"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the torch backend, made to survive sleep and wake.

Each rank keeps ``1 / world_size`` of every parameter, gradient and AdamW state as the local shard of a
``DTensor``; a layer's full parameters exist only while it runs. Three things make that work with
the lifecycle, which destroys the role's process groups on every sleep and rebuilds them on wake:

- FSDP2 keeps a reference to the ``ProcessGroup`` it was built with (``FSDPMeshInfo``), so after a
  rebuild it would run its all-gathers on a destroyed communicator. ``rebind_process_groups`` points
  every FSDP parameter group at the live group again. The ``DeviceMesh`` itself finds its groups by
  name, and the rebuilt groups get the names of the old ones because ``ReloadableProcessGroups``
  recreates them in the same order; ``rebind_process_groups`` checks that and fails loudly if not.
- The memory backends move tensors by storage, and a ``DTensor`` has none of its own:
  ``local_tensors`` hands them the local shards, which are views of FSDP's sharded storage.
- The root module keeps its parameters unsharded after a forward pass without backward (FSDP2
  expects the backward to follow); ``reshard`` frees them so nothing untracked stays on the device.

The FSDP internals this touches (``FSDPState``'s parameter groups and their ``mesh_info``) are
private; they are read the same way in torch 2.11 and 2.15, and every path checks what it found.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def shard_model(
    model: nn.Module,
    group: dist.ProcessGroup,
    device_type: str,
    param_dtype: torch.dtype | None,
) -> DeviceMesh:
    """Apply ``fully_shard`` to each transformer block of ``model`` and then to ``model`` itself.

    Blocks are the modules whose class is in a Hugging Face model's ``_no_split_modules`` (the
    decoder layers), found anywhere below ``model``; a model without them is sharded as one unit.
    ``param_dtype``: the dtype parameters are gathered and computed in (None: their own); gradients
    are reduced in float32. Returns the one-dimensional mesh over ``group``.
    """
    mesh = DeviceMesh.from_group(group, device_type)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for module in decoder_blocks(model):
        fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return mesh


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks below ``model``: modules whose class a Hugging Face model found in it
    names in ``_no_split_modules`` (the decoder layers); ``model`` itself is never one of them."""
    names: set[str] = set()
    for module in model.modules():
        declared = getattr(module, "_no_split_modules", None)  # a transformers PreTrainedModel attribute
        if declared:
            names.update(declared)
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


def _fsdp_param_groups(model: nn.Module) -> Iterator[object]:
    """Every FSDP parameter group under ``model`` (torch 2.11 keeps one per module, 2.15 a list)."""
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            single = state._fsdp_param_group
            groups = [] if single is None else [single]
        yield from groups


def rebind_process_groups(model: nn.Module, group: dist.ProcessGroup) -> int:
    """Point FSDP's cached process groups at ``group``, the live one the model was sharded over.

    Call after the groups are rebuilt. Returns the number of parameter groups updated. Raises
    ``RuntimeError`` when the mesh's group name resolves to anything but ``group`` (the groups were
    not rebuilt in their old order), or when a sharded model shows no parameter group (a torch whose
    FSDP internals differ from those this was written against).
    """
    count = 0
    for param_group in _fsdp_param_groups(model):
        for attr in ("mesh_info", "post_forward_mesh_info"):
            info = getattr(param_group, attr, None)
            if info is None:
                continue
            mesh: DeviceMesh = info.mesh
            if mesh.ndim != 1 or getattr(info, "replicate_mesh_dim", None) is not None:
                raise RuntimeError("rebind_process_groups handles one-dimensional (FSDP only) meshes")
            info.shard_process_group = _check_live(mesh, group)
        count += 1
    if count == 0 and any(p.numel() for p in model.parameters()):
        raise RuntimeError(
            "rebind_process_groups: the sharded model shows no FSDP parameter group; this torch "
            f"({torch.__version__}) keeps FSDP's state where ppo_trainer.sharding does not look"
        )
    return count


def _check_live(mesh: DeviceMesh, group: dist.ProcessGroup) -> dist.ProcessGroup:
    # DTensor collectives (gathers for the weight update, the gradient norm) go through the mesh,
    # which looks its group up by name: that name must now lead to the rebuilt group.
    try:
        found = mesh.get_group(0)
    except (RuntimeError, ValueError) as exc:
        found, reason = None, f" ({exc})"
    else:
        reason = ""
    if found is not group:
        raise RuntimeError(
            f"the device mesh's group name no longer leads to the given group{reason}: either the "
            "process groups were not recreated in the order they were first made, or the group given "
            "is not the one the model was sharded over"
        )
    return group


def reshard(model: nn.Module) -> None:
    """Free every unsharded parameter (FSDP leaves the root's gathered after a no-grad forward)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def local_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor, or its local shard when it is a ``DTensor`` (a view: same storage)."""
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def full_tensor(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tensor: a ``DTensor`` is cast locally first, then gathered (collective on its mesh)."""
    if isinstance(tensor, DTensor):
        cast: DTensor = tensor if dtype is None else tensor.to(dtype)  # type: ignore[assignment]
        return cast.full_tensor()
    return tensor if dtype is None else tensor.to(dtype)


def total_grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """The global 2-norm of the gradients (sharded ones reduced over their mesh); 0 without any."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm
