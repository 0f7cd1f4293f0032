"""Per-request limits and stops, and continuous batching, in the built-in engine's generation core."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch

from ppo_rollout.config import SamplingConfig
from ppo_rollout.engine import continuous
from ppo_rollout.engine import core as core_module
from ppo_rollout.engine.builtin import BuiltinEngine
from ppo_rollout.engine.continuous import GenerationRequest, idle_share, prefill_groups, row_seed
from ppo_rollout.engine.core import GenerationCore, GenerationOutput, first_token
from ppo_rollout.engine.sglang import _per_prompt_limits
from ppo_rollout.generate_client import GenerateClient, Generated


@pytest.fixture(scope="module")
def core(tiny_model: Path) -> GenerationCore:
    return GenerationCore(tiny_model, decode="static-eager", max_running=3, refill_every=2)


def _requests(count: int, seed: int = 0) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (count,), generator=g).tolist()
    limits = torch.randint(1, 14, (count,), generator=g).tolist()
    return [
        GenerationRequest(tuple(torch.randint(3, 20, (n,), generator=g).tolist()), m, seed=100 + i)
        for i, (n, m) in enumerate(zip(lengths, limits, strict=True))
    ]


def _alone(core: GenerationCore, request: GenerationRequest, sampling: SamplingConfig) -> GenerationOutput:
    """The request generated on its own: a one-prompt call of the static batch path."""
    one = SamplingConfig(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        max_new_tokens=request.max_new_tokens,
        ignore_eos=sampling.ignore_eos,
    )
    return core.generate([list(request.prompt)], one, seed=request.seed)[0]


def _same(a: GenerationOutput, b: GenerationOutput) -> None:
    assert a.token_ids == b.token_ids
    assert a.finish_reason == b.finish_reason
    assert a.log_probs == pytest.approx(b.log_probs, abs=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_continuous_batching_gives_each_request_its_own_output(
    core: GenerationCore, temperature: float
) -> None:
    requests = _requests(9)
    sampling = SamplingConfig(temperature=temperature, top_k=12, ignore_eos=True)
    outs = core.generate_requests(requests, sampling)
    assert core.last_slot_stats is not None
    assert core.last_slot_stats.slots == 4 < len(requests)
    for request, out in zip(requests, outs, strict=True):
        assert len(out.token_ids) == request.max_new_tokens  # per-request limits, exactly
        assert out.finish_reason == "length"
        _same(out, _alone(core, request, sampling))
    # Another slot count and refill interval: the same outputs (nothing depends on the slot or wave).
    again = core.generate_requests(list(reversed(requests)), sampling, max_running=2, refill_every=5)
    for out, other in zip(outs, reversed(again), strict=True):
        _same(out, other)


def test_greedy_is_transformers_greedy(core: GenerationCore) -> None:
    requests = _requests(5, seed=3)
    outs = core.generate_requests(requests, SamplingConfig(temperature=0.0, ignore_eos=True))
    for request, out in zip(requests, outs, strict=True):
        ids = torch.tensor([request.prompt])
        with torch.inference_mode():
            ref = core.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=request.max_new_tokens,
                min_new_tokens=request.max_new_tokens,
                do_sample=False,
                pad_token_id=core.pad_token_id,
            )
        assert list(out.token_ids) == ref[0, ids.shape[1] :].tolist()


def test_stop_sequences_end_a_row_with_the_stop_included(core: GenerationCore) -> None:
    sampling = SamplingConfig(temperature=1.0, ignore_eos=True)
    base = GenerationRequest((5, 6, 7), 12, seed=7)
    full = _alone(core, base, sampling).token_ids
    # A two-token sequence first seen at positions 3..4 ends the row after position 4.
    stop = (full[3], full[4])
    first = next(end for end in range(2, len(full) + 1) if full[end - 2 : end] == stop)
    other = GenerationRequest((9, 4), 6, seed=8)
    outs = core.generate_requests(
        [GenerationRequest(base.prompt, 12, seed=7, stop=(stop, (10_000,))), other], sampling
    )
    assert outs[0].token_ids == full[:first]
    assert outs[0].finish_reason == "stop"
    _same(outs[1], _alone(core, other, sampling))  # the other row is unaffected
    # A stop on the last allowed token is a stop, not a length finish (SGLang's order).
    at_limit = core.generate_requests([GenerationRequest(base.prompt, first, seed=7, stop=(stop,))], sampling)
    assert at_limit[0].token_ids == full[:first]
    assert at_limit[0].finish_reason == "stop"


def test_eos_and_stop_token_ids_end_rows(core: GenerationCore) -> None:
    sampling = SamplingConfig(temperature=1.0, ignore_eos=True)
    request = GenerationRequest((5, 6, 7), 12, seed=7)
    full = _alone(core, request, sampling).token_ids
    token = full[2]
    outs = core.generate_requests(
        [request], SamplingConfig(temperature=1.0, ignore_eos=True, stop_token_ids=(token,))
    )
    assert outs[0].token_ids == full[: full.index(token) + 1]
    assert outs[0].finish_reason == "stop"


def test_generate_with_per_prompt_limits_and_stops(core: GenerationCore) -> None:
    sampling = SamplingConfig(temperature=1.0, n_samples_per_prompt=2, ignore_eos=True)
    prompts = [[5, 6], [7, 8, 9]]
    outs = core.generate(prompts, sampling, seed=11, max_new_tokens=[3, 9], stop=[[], [[10_000]]])
    assert [o.prompt_position for o in outs] == [0, 0, 1, 1]
    assert [len(o.token_ids) for o in outs] == [3, 3, 9, 9]
    for row, out in enumerate(outs):
        request = GenerationRequest(tuple(prompts[row // 2]), len(out.token_ids), seed=row_seed(11, row))
        _same(out, _alone(core, request, sampling))


def test_idle_share_of_a_scripted_case(core: GenerationCore) -> None:
    # Two slots, lengths 2, 5, 3, refill every step: slot 0 runs request 0 (1 step) then request 2
    # (2 steps); slot 1 runs request 1 (4 steps). 4 steps x 2 slots, 1 + 4 + 2 = 7 of them busy.
    requests = [GenerationRequest((5, 6), n, seed=i) for i, n in enumerate((2, 5, 3))]
    core.generate_requests(
        requests, SamplingConfig(temperature=0.0, ignore_eos=True), max_running=2, refill_every=1
    )
    stats = core.last_slot_stats
    assert stats is not None
    assert (stats.slots, stats.steps, stats.busy_slot_steps) == (2, 4, 7)
    assert stats.idle_share == pytest.approx(1 / 8)
    assert idle_share([2, 5, 3], slots=2, steps=4) == pytest.approx(1 / 8)
    # Static batches of two: [2, 5] takes 4 steps, [3] alone (bucket 1) 2 steps.
    assert idle_share([2, 5], slots=2, steps=4) == pytest.approx(3 / 8)


def _prompts(lengths: Sequence[int], limit: int = 6) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(sum(lengths))
    return [
        GenerationRequest(tuple(torch.randint(3, 20, (n,), generator=g).tolist()), limit + i % 3, seed=40 + i)
        for i, n in enumerate(lengths)
    ]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_refill_prefills_prompts_of_different_lengths_in_one_forward(
    core: GenerationCore, temperature: float
) -> None:
    requests = _prompts([5, 1, 8, 3, 2, 7, 4])
    sampling = SamplingConfig(temperature=temperature, top_k=12, ignore_eos=True)
    together = core.generate_requests(requests, sampling, max_running=8, refill_every=3)
    stats = core.last_slot_stats
    assert stats is not None
    assert stats.prefills == 1  # one refill, one forward over the seven prompts
    alone = core.generate_requests(requests, sampling, max_running=1, refill_every=3)
    assert core.last_slot_stats is not None
    assert core.last_slot_stats.prefills == len(requests)  # each prefilled on its own
    for request, out, one in zip(requests, together, alone, strict=True):
        _same(out, one)
        _same(out, _alone(core, request, sampling))


def test_a_refill_over_the_token_cap_splits_into_several_forwards(
    core: GenerationCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = _prompts([3, 5, 2, 7, 4, 1, 10])
    sampling = SamplingConfig(temperature=1.0, ignore_eos=True)
    whole = core.generate_requests(requests, sampling, max_running=8)
    assert core.last_slot_stats is not None
    assert core.last_slot_stats.prefills == 1
    monkeypatch.setattr(
        core_module, "generate_in_slots", partial(continuous.generate_in_slots, prefill_tokens=8)
    )
    split = core.generate_requests(requests, sampling, max_running=8)
    stats = core.last_slot_stats
    assert stats is not None
    # Sorted 1 2 | 3 4 | 5 | 7 | 10: at most 8 padded tokens a forward, the 10-token prompt alone.
    assert stats.prefills == 5
    for a, b in zip(whole, split, strict=True):
        _same(a, b)


def test_prefill_groups_pack_sorted_prompts_under_the_cap() -> None:
    assert prefill_groups([3, 5, 2, 7, 4, 1, 10], 8) == [[5, 2], [0, 4], [1], [3], [6]]
    assert prefill_groups([4, 4, 4], 12) == [[0, 1, 2]]
    assert prefill_groups([], 8) == []
    with pytest.raises(ValueError, match="max_tokens >= 1"):
        prefill_groups([1], 0)


def test_a_batched_prefill_fills_arbitrary_slots_and_leaves_padding_invalid(core: GenerationCore) -> None:
    decoder = core._continuous_decoder()
    guard = contextlib.nullcontext
    requests = _prompts([5, 2, 4])
    sampling = SamplingConfig(temperature=0.0)
    b = decoder.allocate(4, 16, 4, per_row=True)
    with torch.inference_mode():
        placed = continuous._prefill(
            decoder, b, [(3, 0), (1, 1), (0, 2)], requests, sampling, guard, first_token
        )
        assert sorted(placed) == [0, 1, 3]
        for s, i in ((3, 0), (1, 1), (0, 2)):
            one = decoder.allocate(1, 16, 4, per_row=True)
            continuous._prefill(decoder, one, [(0, i)], requests, sampling, guard, first_token)
            n = len(requests[i].prompt)
            assert placed[s].prompt_len == n
            assert b.valid[s].tolist() == [c < n for c in range(16)]  # padding columns stay invalid
            assert (b.pos[s], b.col[s], b.step[s], b.limits[s]) == (n, n, 1, requests[i].max_new_tokens)
            assert b.tokens_out[s, 0] == one.tokens_out[0, 0]
            assert float(b.logps_out[s, 0]) == pytest.approx(float(one.logps_out[0, 0]), abs=1e-5)
            for big, small in zip(b.keys + b.values, one.keys + one.values, strict=True):
                torch.testing.assert_close(big[s, :, :n], small[0, :, :n], atol=1e-5, rtol=0)
        for cache in b.keys + b.values:
            assert not cache[2].any()  # the slot no request took is untouched


def test_bad_input_names_the_field(core: GenerationCore, tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        GenerationRequest((1, 2), -1)
    with pytest.raises(ValueError, match=r"stop\[1\] is an empty token sequence"):
        GenerationRequest((1, 2), 4, stop=((3,), ()))
    with pytest.raises(ValueError, match="prompt is empty"):
        GenerationRequest((), 4)
    sampling = SamplingConfig()
    with pytest.raises(ValueError, match="prompt 1: max_new_tokens must be >= 1"):
        core.generate([[1], [2]], sampling, max_new_tokens=[3, 0])
    with pytest.raises(ValueError, match=r"prompt 0: stop\[0\] is an empty"):
        core.generate([[1]], sampling, stop=[[[]]])
    with pytest.raises(ValueError, match="max_new_tokens needs one entry per prompt"):
        core.generate([[1], [2]], sampling, max_new_tokens=[3])
    with pytest.raises(ValueError, match="max_running must be >= 1"):
        core.generate_requests([GenerationRequest((1,), 2)], sampling, max_running=0)
    with pytest.raises(ValueError, match="refill_every must be >= 1"):
        GenerationCore(tiny_model, refill_every=0)


class _RecordingEngine:
    """A generation core behind ``submit_generate`` (the client's engine seam), every call recorded."""

    def __init__(self, core: GenerationCore) -> None:
        self.core = core
        self.calls: list[tuple[int, list[int] | None]] = []

    def submit_generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: int,
        *,
        max_new_tokens: Sequence[int] | None = None,
    ) -> Callable[[float], list[GenerationOutput]]:
        self.calls.append((len(prompts), None if max_new_tokens is None else list(max_new_tokens)))
        outs = self.core.generate(prompts, sampling, seed, max_new_tokens=max_new_tokens)
        return lambda timeout_s: outs


def test_the_client_batches_requests_that_differ_only_in_max_new_tokens(core: GenerationCore) -> None:
    engine = _RecordingEngine(core)

    async def go() -> list[list[Generated]]:
        client = GenerateClient([engine], seed=1, step=0, stream=0, timeout_s=60.0)
        try:
            sampling = SamplingConfig(temperature=1.0, ignore_eos=True)
            asks = [
                client.generate([5, 6, k], replace(sampling, max_new_tokens=n))
                for k, n in enumerate((3, 7, 5))
            ]
            return list(await asyncio.gather(*asks))
        finally:
            client.close()

    results = asyncio.run(go())
    assert engine.calls == [(3, [3, 7, 5])]  # one engine call, a limit per request
    assert [len(r[0].token_ids) for r in results] == [3, 7, 5]


def test_builtin_engine_and_sglang_take_per_prompt_limits(tiny_model: Path) -> None:
    engine = BuiltinEngine(tiny_model)
    sampling = SamplingConfig(temperature=0.0, ignore_eos=True)
    outs = engine.generate([[5, 6], [7]], sampling, seed=2, max_new_tokens=[2, 6], stop=[[], [[10_000]]])
    assert [len(o.token_ids) for o in outs] == [2, 6]
    assert _per_prompt_limits([[1], [2]], sampling, [4, 9]) == [4, 9]
    assert _per_prompt_limits([[1]], sampling, None) == [sampling.max_new_tokens]
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        _per_prompt_limits([[1]], sampling, [0])
    with pytest.raises(ValueError, match="one entry per prompt"):
        _per_prompt_limits([[1], [2]], sampling, [3])
