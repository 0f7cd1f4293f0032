"""``train.compile_layers``: each decoder layer of a torch-backend model run through ``torch.compile``.

Per layer, not the whole model: the layers are where the small kernels are (norms, rotary, SiLU, the
residual adds: inductor fuses them around the matmuls), and compiling them one by one keeps the graph
small, lets FSDP2 shard the same blocks it always does, and leaves the embeddings, the head and the
chunked float32 log-softmax eager. ``dynamic=True``: packed rows change length with every micro-batch,
and one graph with a symbolic length avoids a recompile per length. Compiling costs seconds in each
phase's first call (about 13 s per role at 0.82B on an H200), so it pays for runs of more than a
handful of steps.
"""

from __future__ import annotations

from torch import nn

from ppo_trainer.sharding import decoder_blocks

__all__ = ["compile_decoder_layers"]


def compile_decoder_layers(model: nn.Module) -> int:
    """``torch.compile`` every decoder layer of ``model`` in place; returns how many.

    ``nn.Module.compile`` keeps the module objects (their parameters, hooks and names), so the memory
    backend's tensors, the optimizer and FSDP2's sharding see the same model as without compiling.
    """
    layers = decoder_blocks(model)
    if not layers:
        raise ValueError(
            f"train.compile_layers: {type(model).__name__} has no decoder layers that transformers names "
            "in _no_split_modules; set train.compile_layers=false for this model"
        )
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)
