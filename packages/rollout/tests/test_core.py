"""The generation core without Ray: determinism, padding, log-probs, stopping, sampling filters, bad input."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_rollout.config import SamplingConfig
from ppo_rollout.engine.core import GenerationCore, sample_tokens

PROMPTS = [[1, 5, 6], [1, 7, 8, 9, 14], [1, 4]]


@pytest.fixture(scope="module")
def core(tiny_model: Path) -> GenerationCore:
    return GenerationCore(tiny_model)


def test_same_seed_same_tokens_other_seed_other_tokens(core: GenerationCore) -> None:
    s = SamplingConfig(max_new_tokens=8, n_samples_per_prompt=3, seed=11)
    a = core.generate(PROMPTS, s)
    b = core.generate(PROMPTS, s)
    c = core.generate(PROMPTS, s, seed=12)
    assert a == b
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    assert [o.prompt_position for o in a] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # n samples of one prompt are different draws
    assert len({a[0].token_ids, a[1].token_ids, a[2].token_ids}) > 1


def test_log_probs_match_a_full_forward_for_padded_rows(core: GenerationCore) -> None:
    s = SamplingConfig(temperature=0.7, max_new_tokens=8, seed=3)
    outs = core.generate(PROMPTS, s)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        full = torch.tensor([prompt + list(out.token_ids)])
        logits = core.model(full).logits[0].float() / 0.7
        logp = torch.log_softmax(logits, -1)
        ref = [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(out.token_ids)]
        assert out.log_probs == pytest.approx(ref, abs=1e-5)


def test_greedy_matches_transformers_generate(core: GenerationCore) -> None:
    s = SamplingConfig(temperature=0.0, max_new_tokens=6)
    outs = core.generate(PROMPTS, s)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = core.model.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert list(out.token_ids) == ref[: len(out.token_ids)]


def test_stop_tokens_end_samples_and_are_kept(core: GenerationCore) -> None:
    free = core.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=6))
    stop = free[0].token_ids[2]
    outs = core.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=6, stop_token_ids=(stop,)))
    first = outs[0]
    assert first.finish_reason == "stop"
    assert first.token_ids[-1] == stop
    assert stop not in first.token_ids[:-1]
    assert len(first.log_probs) == len(first.token_ids)
    for out in outs:
        if out.finish_reason == "length":
            assert len(out.token_ids) == 6
            assert stop not in out.token_ids


def test_ignore_eos_samples_past_the_eos_token_until_max_new_tokens(core: GenerationCore) -> None:
    eos = core.eos_token_ids[0]
    # Without ignore_eos some of these samples stop at the eos token (checked, so the test can fail).
    s = SamplingConfig(temperature=1.0, max_new_tokens=48, n_samples_per_prompt=4, seed=7)
    stopped = [o for o in core.generate(PROMPTS, s) if o.finish_reason == "stop"]
    assert stopped, "no sample hit the eos token within 48 tokens; pick another seed"
    outs = core.generate(PROMPTS, dataclasses.replace(s, ignore_eos=True))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 48 for o in outs)
    assert any(eos in o.token_ids for o in outs)  # it was sampled and did not stop the sample


def test_top_k_one_is_greedy(core: GenerationCore) -> None:
    greedy = core.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=5))
    topk1 = core.generate(PROMPTS, SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=5, seed=5))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk1]


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 8),
    st.floats(0.05, 1.0),
    st.integers(0, 2**31),
    st.lists(st.floats(-5, 5), min_size=8, max_size=8),
)
def test_sampled_tokens_respect_top_k_and_top_p(
    top_k: int, top_p: float, seed: int, row: list[float]
) -> None:
    logits = torch.tensor([row, row[::-1]])
    s = SamplingConfig(temperature=1.0, top_k=top_k, top_p=top_p)
    gen = torch.Generator().manual_seed(seed)
    tokens, logp = sample_tokens(logits, s, gen)
    probs = torch.softmax(logits, -1)
    for b in range(2):
        tok = int(tokens[b])
        rank = int((probs[b] > probs[b, tok]).sum())
        assert rank < top_k  # within the top k
        sorted_p = probs[b].sort(descending=True).values
        assert float(sorted_p[:rank].sum()) < top_p + 1e-6  # the mass before it was below top_p
        assert float(logp[b]) == pytest.approx(float(torch.log_softmax(logits[b], -1)[tok]), abs=1e-6)


def test_bad_prompts_give_clear_errors(core: GenerationCore) -> None:
    s = SamplingConfig(max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        core.generate([[1, 5], []], s)
    with pytest.raises(ValueError, match="at least one prompt"):
        core.generate([], s)
    with pytest.raises(ValueError, match="prompt 0 is too long: 62 tokens"):
        core.generate([[1] * 62], s)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        core.generate([[1, 999]], s)


def test_sampling_config_validation() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingConfig(max_new_tokens=0)
    assert SamplingConfig(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)  # type: ignore[arg-type]
