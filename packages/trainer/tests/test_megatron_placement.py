"""What the megatron backend checks and tracks of its models, on plain torch modules (CI: no megatron).

``misplaced_tensors`` names every tensor a rank would compute with off its device (the reference's
CPU norms behind the KL-loss crash); ``held_tensors`` is what the memory backend moves, plain tensor
attributes included (megatron's RoPE frequencies), which torch_memory_saver would otherwise discard.
"""

from __future__ import annotations

import torch
from torch import nn

from ppo_trainer.megatron_backend import held_tensors, misplaced_tensors


class _Rope(nn.Module):
    """Keeps its frequencies as a plain attribute, as megatron's RotaryEmbedding does."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.inv_freq = torch.arange(4, dtype=torch.float32, device=device)


class _Model(nn.Module):
    """A linear layer, a norm, RoPE and a buffer, each on the device asked for."""

    def __init__(self, linear: torch.device, norm: torch.device, rope: torch.device) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, device=linear)
        self.input_layernorm = nn.RMSNorm(8, device=norm)
        self.rope = _Rope(rope)
        self.mask: torch.Tensor
        self.register_buffer("mask", torch.ones(2, device=linear))


def _model(linear: torch.device, norm: torch.device, rope: torch.device) -> _Model:
    return _Model(linear, norm, rope)


def test_misplaced_tensors_names_the_stray_norm_and_attribute() -> None:
    meta, cpu = torch.device("meta"), torch.device("cpu")
    stray = misplaced_tensors({"reference": _model(meta, cpu, cpu)}, meta)
    assert stray == ["reference.input_layernorm.weight (cpu)", "reference.rope.inv_freq (cpu)"]
    assert misplaced_tensors({"model": _model(meta, meta, meta)}, meta) == []


def test_held_tensors_covers_parameters_buffers_and_plain_attributes_once() -> None:
    model = _model(torch.device("cpu"), torch.device("cpu"), torch.device("cpu"))
    model.alias = model.rope.inv_freq  # the same tensor reached twice is tracked once
    held = held_tensors(model)
    expected = [
        model.proj.weight,
        model.proj.bias,
        model.input_layernorm.weight,
        model.mask,
        model.rope.inv_freq,
    ]
    assert len(held) == len(expected)
    for tensor in expected:
        assert any(h.data_ptr() == tensor.data_ptr() and h.shape == tensor.shape for h in held)
    # Parameters come as their .data (the memory backend swaps storages, not autograd leaves).
    assert not any(isinstance(h, nn.Parameter) for h in held)
