"""Weights read back from an SGLang server (``/get_weights_by_name``), and the checksum both sides compute.

SGLang v0.5.17 (``sglang/srt/entrypoints/http_server.py`` route ``/get_weights_by_name``, GET or POST;
``managers/io_struct.py`` ``GetWeightsByNameReqInput``: ``name`` (a Hugging Face name), ``truncate_size``
(default 100); ``models/llama.py`` ``LlamaForCausalLM.get_weights_by_name``):

- the answer is the parameter as ``tensor.cpu().to(torch.float32).numpy().tolist()[:truncate_size]``: nested
  lists of float32 values, the first ``truncate_size`` rows (of a 1-D tensor, its first elements);
- ``q_proj``/``k_proj``/``v_proj`` are read from the fused ``qkv_proj`` and ``gate_proj``/``up_proj`` from
  ``gate_up_proj`` (``stacked_params_mapping``), each its own rows of the fused parameter;
- ``lm_head.weight`` of a model with ``tie_word_embeddings`` is ``model.embed_tokens.weight``;
- a name it cannot read answers 400 ``{"error": {"message": "Get parameter by name failed"}}``
  (``_create_error_response``); with ``dp_size`` 1 the body is the list itself.

The values are float32 copies of the server's weights (bf16 or fp16, exact in float32): cast back to the
dtype the actor sends (:func:`tensor_from_reply`) they are the bytes the actor holds, so
:func:`rows_checksum` of the server's answers equals :func:`rows_checksum` of the actor's weights exactly
when the weights are equal. SGLang's own ``/weights_checker`` (``utils/weight_checker.py``) hashes its
fused, sharded parameters with its own ``tensor_hash``: nothing the actor holds hashes the same, so it is
not used here. Reading a 135M-parameter model as JSON floats moves about 17 bytes a value:
``rows`` (``rollout.sglang.check_rows``) limits both sides to each tensor's first rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ppo_weight_sync.buckets import checksum

__all__ = ["head_rows", "rows_checksum", "tensor_from_reply", "weights_request"]


def _check_rows(rows: int | None) -> None:
    if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 1):
        raise ValueError(f"rows must be an int >= 1 or None (every row), got {rows!r}")


def head_rows(named: Iterable[tuple[str, torch.Tensor]], rows: int | None) -> list[tuple[str, torch.Tensor]]:
    """Each tensor's first ``rows`` rows (None: the whole tensor), as SGLang's ``[:truncate_size]`` cuts."""
    _check_rows(rows)
    return [(n, t if rows is None or t.dim() == 0 else t[:rows]) for n, t in named]


def rows_checksum(named: Iterable[tuple[str, torch.Tensor]], rows: int | None = None) -> str:
    """``ppo_weight_sync.checksum`` of each tensor's first ``rows`` rows (None: of the whole tensors, the
    same value as ``checksum(named)``)."""
    return checksum(head_rows(named, rows))


def weights_request(name: str, shape: Sequence[int], rows: int | None) -> dict[str, Any]:
    """The ``/get_weights_by_name`` body for ``name``: every row unless ``rows`` (SGLang's default
    ``truncate_size`` is 100, so it is always given)."""
    _check_rows(rows)
    total = int(shape[0]) if len(shape) else 1
    return {"name": name, "truncate_size": total if rows is None else min(rows, total)}


def tensor_from_reply(
    name: str, body: Any, shape: Sequence[int], rows: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """The answer to :func:`weights_request` as a tensor of ``dtype`` and the truncated ``shape``;
    ValueError naming the tensor when the answer is not that (another shape, no values)."""
    want = list(shape)
    if want and rows is not None:
        want[0] = min(rows, want[0])
    if not isinstance(body, list):
        raise ValueError(f"/get_weights_by_name {name}: expected a list of values, got {str(body)[:200]}")
    try:
        values = torch.tensor(body, dtype=torch.float32)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"/get_weights_by_name {name}: not a nested list of numbers ({exc})") from exc
    if list(values.shape) != want:
        raise ValueError(
            f"/get_weights_by_name {name}: the server returned shape {list(values.shape)}, expected {want} "
            "(another model on the server, or a tensor-parallel shard?)"
        )
    return values.to(dtype)
