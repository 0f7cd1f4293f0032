"""Long-tailed response lengths (``ppo_rollout.testing.long_tail``): the sampler, the rollout function
that forces its lengths through the generate client on the real tiny model, and the decode bound."""

from __future__ import annotations

import concurrent.futures
import statistics
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from ppo_rollout.config import MultiTurnSettings, SamplingConfig, SamplingSettings
from ppo_rollout.engine.core import GenerationCore
from ppo_rollout.generate_client import GenerateClient
from ppo_rollout.rollout_fns import ContextCall, ContextTools, PromptGroup, RolloutContext
from ppo_rollout.runner import ClientSeeds, run_rollout
from ppo_rollout.tasks import get_task, make_tiny_model
from ppo_rollout.testing.long_tail import (
    LongTailRollout,
    RecordedRequest,
    decode_bytes,
    decode_sizes,
    lognormal_lengths,
)


def test_lognormal_lengths_are_seeded_clipped_and_centred_on_the_median() -> None:
    draws = lognormal_lengths(4001, 300.0, 2048, 1.0, seed=7)
    assert draws == lognormal_lengths(4001, 300.0, 2048, 1.0, seed=7)
    assert draws != lognormal_lengths(4001, 300.0, 2048, 1.0, seed=8)
    assert min(draws) >= 1
    assert max(draws) == 2048
    assert 270 <= statistics.median(draws) <= 330
    assert lognormal_lengths(5, 40.0, 2048, 0.0, seed=0) == [40] * 5  # no spread: the median itself


@pytest.mark.parametrize(
    ("median", "longest", "sigma", "field"),
    [(0.0, 10, 1.0, "median=0.0"), (5.0, 0, 1.0, "longest=0"), (5.0, 10, -1.0, "sigma=-1.0")],
)
def test_bad_lognormal_settings_name_the_field(median: float, longest: int, sigma: float, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        lognormal_lengths(3, median, longest, sigma, seed=0)
    with pytest.raises(ValueError, match=field):
        LongTailRollout(median, longest, sigma)


def test_decode_bytes_counts_weights_per_step_and_each_tokens_context() -> None:
    # (prompt 3, 4 new tokens): decode steps attend over 4, 5, 6 columns; (prompt 2, 1 token): none.
    assert decode_bytes(1000, 10, steps=3, workload=[(3, 4), (2, 1)]) == 3 * 1000 + (4 + 5 + 6) * 10


@pytest.mark.parametrize("tied", [False, True])
def test_decode_sizes_read_every_weight_but_an_untied_input_embedding(tied: bool) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())  # a tied weight once
    weights = total if tied else total - 40 * 32
    kv_token = 2 * 3 * 2 * (32 // 4) * 2  # keys and values, 3 layers, 2 kv heads of 8, 2 bytes
    assert decode_sizes(model, itemsize=2) == (weights * 2, kv_token)
    with torch.device("meta"):
        assert decode_sizes(LlamaForCausalLM(config), itemsize=2) == (weights * 2, kv_token)


class LocalEngine:
    """A generation core behind ``submit_generate`` (per-request limits included), calls recorded."""

    def __init__(self, core: GenerationCore) -> None:
        self.core = core
        self.calls: list[tuple[list[list[int]], list[int] | None]] = []
        self.pool = concurrent.futures.ThreadPoolExecutor(1)

    def submit_generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: int,
        *,
        max_new_tokens: Sequence[int] | None = None,
        stop: Any = None,
    ) -> Any:
        limits = None if max_new_tokens is None else list(max_new_tokens)
        self.calls.append(([list(p) for p in prompts], limits))
        future = self.pool.submit(self.core.generate, prompts, sampling, seed, max_new_tokens=limits)
        return lambda timeout_s: future.result(timeout_s)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("guess_digit", tmp_path_factory.mktemp("lt") / "model", seed=3)


@pytest.fixture
def engine(tiny: Path) -> Iterator[LocalEngine]:
    e = LocalEngine(GenerationCore(tiny, max_running=8))
    yield e
    e.pool.shutdown()


def test_each_sample_gets_its_drawn_length_in_one_continuous_call(engine: LocalEngine) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine.core.model.name_or_path)
    task = get_task("guess_digit")
    rows = [task.row(i, 7) for i in range(3)]
    groups = [
        PromptGroup(i, row, row["prompt"], tuple(tokenizer(row["prompt"])["input_ids"]), 4)
        for i, row in enumerate(rows)
    ]
    fn = LongTailRollout(median=6.0, longest=20, sigma=1.0, seed=1)
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=20, n_samples_per_prompt=4, ignore_eos=True)

    def context(client: GenerateClient) -> RolloutContext:
        return RolloutContext(
            client, ContextTools(tokenizer, MultiTurnSettings()), ContextCall(sampling, (0,), step=2)
        )

    run = run_rollout(fn, "long_tail", groups, [engine], context, ClientSeeds(5, 2, 0), timeout_s=120)
    drawn = [n for g in groups for n in fn.lengths(2, g.index, 4)]
    assert len(set(drawn)) > 1  # the samples differ in length
    # One engine call with every request's own limit, in submission order.
    assert engine.calls == [([list(g.prompt_ids) for g in groups for _ in range(4)], drawn)]
    assert engine.core.last_slot_stats is not None
    assert engine.core.last_slot_stats.slots == 8
    assert [len(t.response_tokens) for t in run.trajectories] == drawn
    assert [t.prompt_index for t in run.trajectories] == [g.index for g in groups for _ in range(4)]
    assert fn.requests == [
        RecordedRequest(2, g.index, len(g.prompt_ids), n) for g in groups for n in fn.lengths(2, g.index, 4)
    ]
