"""Stop strings in multi-turn rollouts: the built-in engine stops at their token sequences, the rollout
cuts at the string in the decoded text, and the trajectories are the ones the cut alone gives."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from ppo_rollout.config import MultiTurnSettings, SamplingConfig, SamplingSettings
from ppo_rollout.engine.core import GenerationCore, GenerationOutput
from ppo_rollout.environment import Action, StepResult
from ppo_rollout.generate_client import GenerateClient
from ppo_rollout.observation import ObservationRenderer
from ppo_rollout.rollout_fns import (
    ContextCall,
    ContextEnvironment,
    ContextTools,
    PromptGroup,
    RolloutContext,
    cut_at_stop,
    multi_turn,
)
from ppo_rollout.runner import ClientSeeds, run_rollout
from ppo_rollout.stops import RequestStop, stop_token_sequences
from ppo_rollout.tasks import get_task
from ppo_rollout.trajectory import Trajectory


class CountingEngine:
    """A generation core behind ``submit_generate``, always on its continuous path (per-request limits,
    so runs with and without stops decode alike), counting what it generated."""

    def __init__(self, core: GenerationCore) -> None:
        self.core = core
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.outputs: list[GenerationOutput] = []
        self.stops: list[RequestStop | None] = []
        self.decode_steps = 0

    def submit_generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: int,
        *,
        max_new_tokens: Sequence[int] | None = None,
        stop: Sequence[RequestStop] | None = None,
    ) -> Any:
        limits = list(max_new_tokens or [sampling.max_new_tokens] * len(prompts))
        sequences = None if stop is None else [[list(s) for s in r.token_ids] for r in stop]

        def call() -> list[GenerationOutput]:
            outs = self.core.generate(prompts, sampling, seed, max_new_tokens=limits, stop=sequences)
            stats = self.core.last_slot_stats
            assert stats is not None
            self.decode_steps += stats.steps
            self.outputs += outs
            per_prompt = list(stop) if stop is not None else [None] * len(prompts)
            self.stops += [per_prompt[o.prompt_position] for o in outs]
            return outs

        future = self.pool.submit(call)
        return lambda timeout_s: future.result(timeout_s)

    @property
    def tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


class Never:
    def reset(self, row: Mapping[str, Any]) -> None:
        pass

    def step(self, action: Action) -> StepResult:
        return StepResult(observation="+", reward=0.5)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


GREEDY = SamplingSettings(temperature=0.0, max_new_tokens=12, n_samples_per_prompt=2, ignore_eos=True)


def _rollout(
    tiny: Path, tokenizer: Any, stop: tuple[str, ...], *, engine_stops: bool
) -> tuple[list[Trajectory], CountingEngine]:
    engine = CountingEngine(GenerationCore(tiny, decode="static-eager", max_running=4, refill_every=2))
    task = get_task("guess_digit")
    groups = [
        PromptGroup(i, row, row["prompt"], tuple(tokenizer(row["prompt"])["input_ids"]), 2)
        for i, row in enumerate(task.row(i, 7) for i in range(4))
    ]
    limits = MultiTurnSettings(max_turns=3, max_response_tokens=200, stop=stop)
    renderer = ObservationRenderer(tokenizer, chat_template=False, max_tokens=limits.max_observation_tokens)
    pool = concurrent.futures.ThreadPoolExecutor(4)

    def context(client: GenerateClient) -> RolloutContext:
        seat = ContextEnvironment(Never, "never", pool=pool)
        tools = ContextTools(tokenizer, limits, renderer, seat, engine_stops=engine_stops)
        return RolloutContext(client, tools, ContextCall(GREEDY, (7,)))

    try:
        run = run_rollout(multi_turn, "multi_turn", groups, [engine], context, ClientSeeds(1, 0, 0), 120)
    finally:
        pool.shutdown(wait=False)
        engine.pool.shutdown()
    return run.trajectories, engine


def _decode(tokenizer: Any) -> Any:
    return lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True))


def test_engine_side_stops_give_the_same_trajectories_with_fewer_tokens(
    tiny_model: Path, tokenizer: Any
) -> None:
    plain, _ = _rollout(tiny_model, tokenizer, (), engine_stops=False)
    # A stop string the model writes: two characters from the middle of a first turn's text.
    text = _decode(tokenizer)(plain[0].segments[0].token_ids)
    assert len(text) >= 6
    stop = (text[3:5],)

    cut_only, slow = _rollout(tiny_model, tokenizer, stop, engine_stops=False)
    stopped, fast = _rollout(tiny_model, tokenizer, stop, engine_stops=True)

    assert slow.stops
    assert all(s is None for s in slow.stops)
    assert all(s is not None and s.strings == stop and s.token_ids for s in fast.stops)
    assert len(stopped) == len(cut_only) == 8
    for a, b in zip(stopped, cut_only, strict=True):
        assert a.response_tokens == b.response_tokens
        assert a.loss_mask == b.loss_mask
        assert a.turn_ids == b.turn_ids
        assert (a.status, a.finish_reason, a.num_turns) == (b.status, b.finish_reason, b.num_turns)
        assert a.rollout_log_probs == pytest.approx(b.rollout_log_probs, abs=1e-5)
    # Fewer tokens generated and fewer decode steps run for the same trajectories.
    assert fast.tokens < slow.tokens
    assert fast.decode_steps < slow.decode_steps
    # Every turn the engine ended at a stop sequence holds the stop string, ending at its last token.
    decode = _decode(tokenizer)
    engine_stopped = [o for o in fast.outputs if o.finish_reason == "stop"]
    assert engine_stopped
    for out in engine_stopped:
        cut = cut_at_stop(out.token_ids, stop, decode)
        assert cut is not None
        assert cut == len(out.token_ids)  # no token past the stop was generated


# -- stop strings that a tokenizer writes differently inside text --------------------------------------
def _bpe_tokenizer() -> Any:
    """A byte-level BPE tokenizer that writes "ab" as one token alone and as " ab" (one token) after
    a word, and has "abc" as a token of its own: the three ways a stop string can meet a tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges = [("a", "b"), ("Ġ", "ab"), ("ab", "c")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_stop_sequences_cover_the_in_context_tokenization() -> None:
    tok = _bpe_tokenizer()
    decode = _decode(tok)
    ab, space_ab, abc = (tok.convert_tokens_to_ids(t) for t in ("ab", "Ġab", "abc"))
    assert tok.encode("ab", add_special_tokens=False) == [ab]
    assert tok.encode("x ab", add_special_tokens=False)[-1] == space_ab  # differs in context

    sequences = stop_token_sequences(["ab"], lambda s: tok.encode(s, add_special_tokens=False), decode)
    assert (ab,) in sequences
    assert (space_ab,) in sequences
    for seq in sequences:  # a match always means the string is there
        assert "ab" in decode(seq)

    # The rollout's cut is the exact rule: it finds the stop written in context ...
    out = tok.encode("x ab y", add_special_tokens=False)
    assert cut_at_stop(out, ["ab"], decode) == out.index(space_ab) + 1
    # ... and inside a token no sequence matches (the engine decodes on; the cut still ends there).
    out = tok.encode("xabc y", add_special_tokens=False)
    assert abc in out
    assert not any(tuple(out[i : i + len(s)]) == s for s in sequences for i in range(len(out)))
    assert cut_at_stop(out, ["ab"], decode) == out.index(abc) + 1


def test_an_empty_stop_string_is_refused() -> None:
    tok = _bpe_tokenizer()
    with pytest.raises(ValueError, match="empty string"):
        stop_token_sequences(["ab", ""], lambda s: tok.encode(s, add_special_tokens=False), _decode(tok))
