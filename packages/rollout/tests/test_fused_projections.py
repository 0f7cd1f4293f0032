"""Joined q/k/v and gate/up projections: the model's parameters are views into one buffer per group, so
weight updates and memory release reach the matmuls the decoder runs, and nothing is held twice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from ppo_lifecycle.memory._tracking import storage_key
from ppo_rollout.config import SamplingConfig
from ppo_rollout.engine.builtin import BuiltinEngine
from ppo_rollout.engine.core import GenerationCore, GenerationOutput
from ppo_rollout.engine.decode_fusions import GATE_UP, QKV, FusedLinear
from ppo_rollout.tasks import make_tiny_model
from ppo_weight_sync import checksum

PROMPTS = [[1, 5, 6, 14], [1, 7], [1, 9, 9, 8, 4, 14]]
LIMITS = [9, 5, 12]  # per-prompt limits: the continuous path, on the static decoder (eager on CPU)
GREEDY = SamplingConfig(temperature=0.0, ignore_eos=True)
SAMPLED = SamplingConfig(temperature=1.0, top_k=8, ignore_eos=True)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("copy", tmp_path_factory.mktemp("fused-other") / "model", seed=5)


def _groups(model: Any) -> list[FusedLinear]:
    groups = []
    for layer in model.model.layers:
        for module, names in ((layer.self_attn, QKV), (layer.mlp, GATE_UP)):
            group = FusedLinear.of(module, names)
            assert group is not None
            groups.append(group)
    return groups


def _generate(engine: BuiltinEngine | GenerationCore, sampling: SamplingConfig) -> list[GenerationOutput]:
    return engine.generate(PROMPTS, sampling, seed=11, max_new_tokens=LIMITS)


def _same(a: list[GenerationOutput], b: list[GenerationOutput]) -> None:
    assert [(o.token_ids, o.finish_reason) for o in a] == [(o.token_ids, o.finish_reason) for o in b]
    for x, y in zip(a, b, strict=True):
        assert x.log_probs == pytest.approx(y.log_probs, abs=1e-5)


def test_projections_are_views_into_one_buffer_and_nothing_is_held_twice(tiny_model: Path) -> None:
    core = GenerationCore(tiny_model, decode="static-eager")
    groups = _groups(core.model)
    for group in groups:
        joined = group.joined()
        assert joined is not None
        weight, _ = joined
        assert weight.shape == (sum(group.widths), group.parts[0].in_features)
        # Row blocks of the one buffer, in order: the parameters are the buffer's rows.
        start = 0
        for part, width in zip(group.parts, group.widths, strict=True):
            assert part.weight.data_ptr() == weight[start].data_ptr()
            assert torch.equal(part.weight, weight[start : start + width])
            start += width
    # The model's storages hold exactly its named tensors' bytes: no second copy of any weight.
    tensors = {t.data_ptr(): t for t in core.model.state_dict().values()}.values()
    storages = {storage_key(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    assert sum(storages.values()) == sum(t.numel() * t.element_size() for t in tensors)
    assert len(storages) < len(list(tensors))  # the joined groups share storages


def test_fused_decoding_is_transformers_greedy(tiny_model: Path) -> None:
    core = GenerationCore(tiny_model, decode="static-eager")
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    outs = _generate(core, SamplingConfig(temperature=0.0))  # eos ends a row, as in generate
    for prompt, limit, out in zip(PROMPTS, LIMITS, outs, strict=True):
        with torch.inference_mode():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=limit, do_sample=False)
        expected = ref[0, len(prompt) :].tolist()[: len(out.token_ids)]
        assert out.token_ids == tuple(expected)
        assert out.finish_reason == "stop" or len(out.token_ids) == limit


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_after_a_weight_update_the_engine_is_a_fresh_engine_with_the_new_weights(
    tiny_model: Path, other_model: Path, sampling: SamplingConfig
) -> None:
    engine = BuiltinEngine(tiny_model)
    before = _generate(engine, sampling)  # the decoder and its buffers exist before the update
    new = [(n, t.clone()) for n, t in AutoModelForCausalLM.from_pretrained(other_model).state_dict().items()]
    engine._load_weights(new)
    fresh = BuiltinEngine(other_model)
    after = _generate(engine, sampling)
    _same(after, _generate(fresh, sampling))
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    # The checksum is over the model's own named tensors: the trainer's, and a fresh engine's.
    assert engine.weights_checksum() == checksum(new) == fresh.weights_checksum()
    # Still joined (the update wrote through the views), and still after a release and a resume.
    assert all(g.joined() is not None for g in _groups(engine._core.model))
    assert engine.release_memory_occupation(tags=None).success
    assert engine.resume_memory_occupation(tags=None).success
    assert all(g.joined() is not None for g in _groups(engine._core.model))
    _same(_generate(engine, sampling), after)
    assert engine.weights_checksum() == checksum(new)


def test_a_parameter_replaced_by_its_own_tensor_is_computed_apart(tiny_model: Path) -> None:
    core = GenerationCore(tiny_model, decode="static-eager")
    before = _generate(core, GREEDY)
    attn = core.model.model.layers[0].self_attn
    attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach().clone(), requires_grad=False)
    group = FusedLinear.of(attn, QKV)
    assert group is not None
    assert group.joined() is None  # no stale joined weight: the layer runs its projections one by one
    _same(_generate(core, GREEDY), before)
    attn.k_proj.weight.data.mul_(-1.0)  # the replaced parameter is the one the decoder reads
    assert [o.token_ids for o in _generate(core, GREEDY)] != [o.token_ids for o in before]
