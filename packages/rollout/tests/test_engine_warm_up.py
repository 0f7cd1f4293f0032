"""The engine's start-up warm-up (``GenerationCore.warm_up``): one throwaway call that leaves the
decode buffers (and on CUDA the captured graphs) the run's batch calls reuse, and changes nothing any
later call returns. On CPU the static path runs eagerly over the same kept buffers; the graphs are
captured over them the same way on CUDA (ppo-driver's ``benchmarks/startup_gpu.sh`` compares a run's
first step with and without warm-up there)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ppo_rollout.config import SamplingConfig
from ppo_rollout.engine.builtin import BuiltinEngine
from ppo_rollout.engine.core import GenerationCore
from ppo_rollout.engine.static_decode import round_up

PROMPTS = [[1, 5, 6], [1, 7, 8, 9, 14], [1, 4]]


@pytest.mark.parametrize("max_prompt_tokens", [5, 100])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_warmed_core_returns_what_a_fresh_one_returns(
    tiny_model: Path, max_prompt_tokens: int, temperature: float
) -> None:
    s = SamplingConfig(temperature=temperature, max_new_tokens=8, n_samples_per_prompt=2, seed=3)
    fresh = GenerationCore(tiny_model, decode="static").generate(PROMPTS, s, seed=11)

    core = GenerationCore(tiny_model, decode="static")
    torch.manual_seed(0)
    rng = torch.get_rng_state()
    assert core.warm_up(len(PROMPTS) * 2, max_prompt_tokens, s)
    assert torch.equal(torch.get_rng_state(), rng)  # the process's random state is not read
    assert core._graphs is not None
    kept = core._graphs.buffers
    assert kept is not None
    assert kept.batch == 8  # 6 rows: the bucket of 8
    # The capacity a prompt of max_prompt_tokens needs, within the model's positions (64 here).
    assert core.max_positions is not None
    assert kept.capacity == min(round_up(max_prompt_tokens + 8 - 1, 64), round_up(core.max_positions - 1, 64))
    assert core.generate(PROMPTS, s, seed=11) == fresh  # tokens, log-probs, finish reasons: exactly
    assert core._graphs.buffers is kept  # the real call ran on the warmed buffers
    assert core.generate(PROMPTS, s, seed=11) == fresh


def test_warm_buffers_larger_than_the_first_call_needs_change_nothing(tmp_path: Path) -> None:
    """A prompt limit of 300 tokens: the warmed cache holds 320 columns where the real call alone
    would allocate 64; its attention still spans the same KV buckets, and the outputs are the same."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    folder = tmp_path / "llama"
    LlamaForCausalLM(config).save_pretrained(folder)
    s = SamplingConfig(temperature=1.0, max_new_tokens=12, n_samples_per_prompt=2, seed=5)
    fresh_core = GenerationCore(folder, decode="static")
    fresh = fresh_core.generate(PROMPTS, s)
    assert fresh_core._graphs is not None
    assert fresh_core._graphs.buffers is not None
    assert fresh_core._graphs.buffers.capacity == 64
    core = GenerationCore(folder, decode="static")
    assert core.warm_up(6, 300, s)
    assert core._graphs is not None
    assert core._graphs.buffers is not None
    assert core._graphs.buffers.capacity == 320
    assert core.generate(PROMPTS, s) == fresh


def test_the_decode_loop_has_nothing_to_warm(tiny_model: Path) -> None:
    s = SamplingConfig(max_new_tokens=4)
    assert not GenerationCore(tiny_model, decode="loop").warm_up(4, 8, s)
    engine = BuiltinEngine(tiny_model, "cpu")  # "auto" on CPU: the decode loop
    assert engine.warm_up(4, 8, s) == {"warm_up_s": 0.0}
    with pytest.raises(ValueError, match="rows >= 1"):
        GenerationCore(tiny_model, decode="static").warm_up(0, 8, s)


def test_warm_up_needs_the_weights(tiny_model: Path) -> None:
    engine = BuiltinEngine(tiny_model, "cpu")
    engine.release_memory_occupation(tags=["weights"])
    with pytest.raises(RuntimeError, match="before warm_up"):
        engine.warm_up(4, 8, SamplingConfig(max_new_tokens=4))
