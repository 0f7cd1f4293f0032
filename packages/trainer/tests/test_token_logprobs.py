"""Chunked log-probs and entropy: the same numbers and gradients as the whole-tensor math, and no
float32 logits of more than one chunk kept for the backward."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_trainer import ppo_math as pm
from ppo_trainer import token_logprobs as tl


def whole(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return pm.log_probs_from_logits(logits, targets), pm.entropy_from_logits(logits)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(0, 9),
    vocab=st.integers(2, 13),
    chunk=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_chunked_logit_stats_equal_the_whole_tensor_math(
    rows: int, vocab: int, chunk: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, rows, vocab, generator=g, dtype=torch.float64).float().requires_grad_()
    targets = torch.randint(0, vocab, (2, rows), generator=g)
    weights = torch.randn(2, rows, generator=g)
    lp, ent = tl.chunked_logit_stats(logits, targets, with_entropy=True, chunk=chunk)
    assert ent is not None
    ref_lp, ref_ent = whole(logits, targets)
    # Each position is computed on its own: chunking changes no bit of the values.
    assert torch.equal(lp, ref_lp)
    assert torch.equal(ent, ref_ent)
    (grad,) = torch.autograd.grad(((lp + 0.3 * ent) * weights).sum(), logits, allow_unused=True)
    (ref_grad,) = torch.autograd.grad(((ref_lp + 0.3 * ref_ent) * weights).sum(), logits, allow_unused=True)
    if rows == 0:
        return
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=0)


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_head_log_probs_match_full_logits_and_their_gradients(chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(7, 8, generator=g).requires_grad_()
    targets = torch.randint(0, 11, (7,), generator=g)
    weights = torch.randn(7, generator=g)

    lp, ent = tl.head_log_probs(hidden, head, targets, with_entropy=True, chunk=chunk)
    assert ent is not None
    ref_lp, ref_ent = whole(head(hidden), targets)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-6, atol=1e-6)

    def grads(loss: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.autograd.grad(loss, [hidden, head.weight]))

    got = grads(((lp - 0.1 * ent) * weights).sum())
    want = grads(((ref_lp - 0.1 * ref_ent) * weights).sum())
    for a, b in zip(got, want, strict=True):
        # The head's weight gradient sums over chunks: float32 summation order only.
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_without_entropy_and_without_grad() -> None:
    head = torch.nn.Linear(4, 5)
    hidden = torch.randn(6, 4)
    targets = torch.randint(0, 5, (6,))
    with torch.no_grad():
        lp, ent = tl.head_log_probs(hidden, head, targets, with_entropy=False, chunk=4)
    assert ent is None
    assert lp.shape == (6,)
    assert lp.dtype == torch.float32
    assert not lp.requires_grad
    torch.testing.assert_close(lp, pm.log_probs_from_logits(head(hidden), targets), rtol=1e-6, atol=1e-6)
    empty, empty_ent = tl.head_log_probs(hidden[:0], head, targets[:0], with_entropy=True)
    assert empty.shape == (0,)
    assert empty_ent is not None
    assert empty_ent.shape == (0,)
    with pytest.raises(ValueError, match="chunk=0"):
        tl.head_log_probs(hidden, head, targets, with_entropy=False, chunk=0)


def test_the_backward_keeps_no_logits_larger_than_a_chunk() -> None:
    vocab, tokens, chunk = 64, 40, 8
    head = torch.nn.Linear(16, vocab, bias=False)
    hidden = torch.randn(tokens, 16, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    saved: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = tl.head_log_probs(hidden, head, targets, with_entropy=True, chunk=chunk)
        assert ent is not None
        (lp + ent).sum().backward()
    assert hidden.grad is not None
    assert head.weight.grad is not None
    logits_like = [s for s in saved if len(s) and s[-1] == vocab and s.numel() > chunk * vocab]
    assert not logits_like, f"kept logits of shapes {logits_like} for the backward"
    # The whole-tensor math keeps [tokens, vocab] float32 tensors (the check above would see them).
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pm.entropy_from_logits(head(hidden)).sum().backward()
    assert any(len(s) == 2 and s == (tokens, vocab) for s in saved)
