"""Log-probs and entropy of chosen tokens, a chunk of positions at a time.

A ``[tokens, vocabulary]`` float32 logits tensor is the largest thing a policy forward makes (65 536
response tokens of a 49 152-token vocabulary: 12.9 GB, and as much again for its gradient). Here the
float32 softmax math, and with :func:`head_log_probs` the LM head's matmul too, runs on ``chunk``
positions at a time. Under autograd each chunk is checkpointed: its backward recomputes the chunk's
logits instead of keeping them, so no more than one chunk's logits exist at once in either direction.

The per-chunk formulas are ``ppo_math``'s (:func:`ppo_math.log_probs_from_logits`,
:func:`ppo_math.entropy_from_logits`): a position's result does not depend on the chunking, and the
gradient is the one of the unchunked expression up to the summation order of the head's weight
gradient over chunks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from ppo_trainer import ppo_math as pm

Head = Callable[[torch.Tensor], torch.Tensor]
"""Hidden states ``[n, hidden]`` to logits ``[n, vocabulary]`` (a model's output embedding)."""

DEFAULT_CHUNK = 4096


def logit_stats(
    logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(z)[target]`` and (``with_entropy``) the entropy per position, in float32."""
    log_probs = pm.log_probs_from_logits(logits, targets)
    return log_probs, pm.entropy_from_logits(logits) if with_entropy else None


def chunked_logit_stats(
    logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool, chunk: int = DEFAULT_CHUNK
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`logit_stats` over logits of any leading shape ``[..., V]`` (``targets``: ``[...]``), the
    float32 copies made ``chunk`` positions at a time; results have the leading shape."""
    flat = logits.reshape(-1, logits.shape[-1])
    log_probs, entropy = _chunked(lambda rows: flat[rows], targets.reshape(-1), with_entropy, chunk)
    shape = targets.shape
    return log_probs.reshape(shape), None if entropy is None else entropy.reshape(shape)


def head_log_probs(
    hidden: torch.Tensor, head: Head, targets: torch.Tensor, with_entropy: bool, chunk: int = DEFAULT_CHUNK
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` (``[n]``) and entropies from final hidden states ``[n, hidden]``: the
    head and the float32 softmax math run ``chunk`` positions at a time. Returns two ``[n]`` tensors."""
    return _chunked(lambda rows: head(hidden[rows]), targets, with_entropy, chunk)


def _chunked(
    logits_of: Callable[[slice], torch.Tensor], targets: torch.Tensor, with_entropy: bool, chunk: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1 (positions per chunk of the log-prob computation)")
    n = targets.shape[0]
    log_probs: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    # No position at all still runs one empty chunk: the result stays connected to the graph.
    for start in range(0, max(n, 1), chunk):
        rows = slice(start, min(start + chunk, n))

        def stats(t: torch.Tensor, rows: slice = rows) -> tuple[torch.Tensor, ...]:
            lp, ent = logit_stats(logits_of(rows), t, with_entropy)
            return (lp,) if ent is None else (lp, ent)

        if torch.is_grad_enabled():
            # Non-reentrant: the backward recomputes this chunk's logits under the autocast state of
            # the forward; only the chunk's input stays alive between the two.
            out = checkpoint(stats, targets[rows], use_reentrant=False)
        else:
            out = stats(targets[rows])
        log_probs.append(out[0])
        if with_entropy:
            entropies.append(out[1])
    return torch.cat(log_probs), torch.cat(entropies) if with_entropy else None
