"""``optimizer.pt`` in Hugging Face names (``optimizer_format``), on CPU.

The moment tensors take the weights' layout conversion: a moment's element stays with its weight's
element through the fused QKV / gate-up layouts and the tensor-parallel shards (hypothesis over
shapes), and the round trip is bit exact. The dict the megatron backend writes loads into the torch
backend's AdamW as its own (same hyperparameters, same next step), and a file either checkpoint
module writes resumes through the other with the optimizer state intact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_fields, save_tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_trainer.backend import TorchTrainer
from ppo_trainer.batch import Samples
from ppo_trainer.checkpoint import megatron_io, torch_io
from ppo_trainer.checkpoint import optimizer_format as of
from ppo_trainer.checkpoint.torch_optimizer import state_by_name
from ppo_trainer.config import AlgorithmConfig, TrainerConfig
from ppo_trainer.megatron_convert import (
    ModelShape,
    _entries,
    _hf_shapes,
    gather_from_tp,
    hf_to_megatron,
    split_for_tp,
)


def _shape(
    kv: int, per_group: int, head_dim: int, vocab: int, ffn: int, tied: bool, bias: bool
) -> ModelShape:
    heads = kv * per_group
    return ModelShape(
        num_layers=2, hidden_size=heads * head_dim + 1, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        intermediate_size=ffn, vocab_size=vocab, tied_embeddings=tied, qkv_bias=bias,
    )  # fmt: skip


def _hf_tensors(shape: ModelShape, critic: bool, generator: torch.Generator) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for entry in _entries(shape, critic):
        for name, dims in zip(entry.hf, _hf_shapes(shape, entry), strict=True):
            out[name] = torch.randn(dims, generator=generator)
    return out


@settings(max_examples=60, deadline=None)
@given(
    kv=st.sampled_from([1, 2, 4]),
    per_group=st.integers(1, 3),
    head_dim=st.integers(1, 4),
    vocab=st.integers(1, 23),
    ffn=st.sampled_from([4, 8, 12]),
    tp=st.sampled_from([1, 2, 4]),
    tied=st.booleans(),
    bias=st.booleans(),
    critic=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_moments_follow_their_weights_through_every_layout(
    kv: int,
    per_group: int,
    head_dim: int,
    vocab: int,
    ffn: int,
    tp: int,
    tied: bool,
    bias: bool,
    critic: bool,
    seed: int,
) -> None:
    """exp_avg = 3 * weight elementwise in HF layout stays so in megatron's fused layouts and on every
    TP shard (vocabulary padding included: zero weight, zero moment); the round trip is bit exact."""
    if kv % tp or ffn % tp:
        return
    shape = _shape(kv, per_group, head_dim, vocab, ffn, tied, bias)
    weights = _hf_tensors(shape, critic, torch.Generator().manual_seed(seed))
    names = of.optimizer_names(shape, critic)
    assert set(names) == set(weights), "one optimizer entry per trainable parameter, no tied alias"
    moments = {name: 3 * weights[name] for name in names}
    squares = {name: weights[name] ** 2 for name in names}

    mega_w = hf_to_megatron(weights, shape, critic=critic)
    mega_m = of.moments_to_megatron(moments, shape, critic)
    mega_s = of.moments_to_megatron(squares, shape, critic)
    assert list(mega_m) == list(mega_w)
    for name, w in mega_w.items():
        assert torch.equal(mega_m[name], 3 * w), name
        for rank, (ws, ms) in enumerate(
            zip(
                split_for_tp(name, w, tp, shape, critic),
                split_for_tp(name, mega_m[name], tp, shape, critic),
                strict=True,
            )
        ):
            assert torch.equal(ms, 3 * ws), (name, rank)

    gathered = {
        n: gather_from_tp(n, split_for_tp(n, t, tp, shape, critic), shape, critic) for n, t in mega_s.items()
    }
    back = of.moments_to_hf(gathered, shape, critic)
    assert list(back) == names
    for name in names:
        assert torch.equal(back[name], squares[name]), name


def test_flat_data_parallel_shards_reassemble_bit_for_bit() -> None:
    """What ``MegatronTrainer`` does per parameter over its data-parallel ranks: each rank places its
    flat shard into zeros and the int32 views are summed, which keeps every bit (a float sum would
    turn -0.0 into 0.0)."""
    whole = torch.tensor([1.5, -0.0, float("1e-45"), -3.25, 7.0, -0.0, 2.0])
    ranges = [(0, 2), (2, 5), (5, 7)]  # arbitrary cuts, as megatron's buffer ranges fall
    parts = []
    for start, end in ranges:
        flat = torch.zeros(whole.numel())
        flat[start:end] = whole[start:end]
        parts.append(flat.view(torch.int32))
    merged = torch.stack(parts).sum(0, dtype=torch.int32).view(torch.float32)
    assert torch.equal(merged.view(torch.int32), whole.view(torch.int32))
    float_sum = torch.stack([p.view(torch.float32) for p in parts]).sum(0)
    assert not torch.equal(float_sum.view(torch.int32), whole.view(torch.int32))


# ---------------------------------------------------------------------------------------- the file format
def _trainer(model: Path, role: str = "actor", lr: float = 1e-2) -> TorchTrainer:
    config = TrainerConfig(
        role=role,  # type: ignore[arg-type]
        model_path=str(model),
        algorithm=AlgorithmConfig(num_mini_batches=1),
        micro_batch_size=4,
        actor_lr=lr,
        weight_decay=0.01,
    )
    return TorchTrainer(config)


def _train(trainer: TorchTrainer, seed: int) -> dict[str, float]:
    samples = Samples.from_fields(make_fields(8, seed=seed))
    return trainer.train_actor(samples, torch.zeros_like(samples.response_mask))


def _adam(trainer: TorchTrainer) -> dict[str, dict[str, torch.Tensor]]:
    state = state_by_name(trainer.model, trainer.optimizer.state_dict())["state"]
    return {n: {k: v.clone() for k, v in s.items()} for n, s in state.items()}


def _same_adam(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert set(a[name]) == set(b[name]) == {"step", "exp_avg", "exp_avg_sq"}, name
        for key in a[name]:
            assert a[name][key].dtype == b[name][key].dtype, (name, key)
            assert torch.equal(a[name][key], b[name][key]), (name, key)


@pytest.mark.parametrize("tied", [False, True])
def test_megatron_format_loads_into_torch_adamw_as_its_own(tmp_path: Path, tied: bool) -> None:
    """A dict built as the megatron backend builds it (moments by name, ``adam_param_group``) gives
    the torch backend the same AdamW, state and hyperparameters, so the next step is the same."""
    model = save_tiny_llama(tmp_path / "model", tie_word_embeddings=tied)
    source = _trainer(model)
    _train(source, seed=3)
    _train(source, seed=4)
    shape = ModelShape.from_hf_config(source.model.config)
    names = of.optimizer_names(shape, critic=False)
    assert names == [n for n, p in source.model.named_parameters() if p.requires_grad]
    adam = of.read_adam_state(source.hf_optimizer_state(), names, source="source")
    assert adam.step == 2
    group = of.adam_param_group(names, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    built = of.adam_state_dict(adam.moments, adam.step, group)

    resumed = _trainer(model, lr=0.5)  # the file's hyperparameters win, as for the torch backend's own
    resumed.load_hf_state_dict(source.hf_state_dict())
    resumed.load_hf_optimizer_state(built)
    _same_adam(_adam(resumed), _adam(source))
    ours = {k: v for k, v in resumed.optimizer.param_groups[0].items() if k != "params"}
    theirs = {k: v for k, v in source.optimizer.param_groups[0].items() if k != "params"}
    ours.pop("foreach"), theirs.pop("foreach")  # None in the file: torch picks foreach on its own
    assert ours == theirs
    a, b = _train(source, seed=5), _train(resumed, seed=5)
    assert a == b
    for (name, x), (_, y) in zip(
        source.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        assert torch.equal(x, y), name


def test_either_checkpoint_module_resumes_the_other_with_its_optimizer(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "model")
    source = _trainer(model)
    _train(source, seed=3)
    expected = _adam(source)

    megatron_io.save_shard(source, tmp_path / "a" / "actor", step=1)
    saved = torch.load(tmp_path / "a" / "actor" / "optimizer.pt", weights_only=True)
    assert set(saved["state"]) == set(expected)
    resumed = _trainer(model)
    assert torch_io.load_shard(resumed, tmp_path / "a" / "actor") == 1
    _same_adam(_adam(resumed), expected)

    torch_io.save_shard(source, tmp_path / "b" / "actor", step=1)
    again = _trainer(model)
    assert megatron_io.load_shard(again, tmp_path / "b" / "actor") == 1
    _same_adam(_adam(again), expected)
    assert _train(again, seed=4) == _train(source, seed=4)


def test_read_adam_state_names_what_is_wrong() -> None:
    names = ["a.weight", "b.weight"]
    group = of.adam_param_group(names, lr=1.0, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    moments = {k: {n: torch.ones(2) for n in names} for k in of.ADAM_MOMENTS}
    good = of.adam_state_dict(moments, 5, group)
    assert of.read_adam_state(good, names, "f").step == 5
    with pytest.raises(ValueError, match="f: not an optimizer state dict"):
        of.read_adam_state({"state": {}}, names, "f")
    by_index = {"state": {0: good["state"]["a.weight"]}, "param_groups": [{**group, "params": [0]}]}
    with pytest.raises(ValueError, match=r"keyed by parameter index .* resume it on train.backend='torch'"):
        of.read_adam_state(by_index, names, "f")
    with pytest.raises(
        ValueError, match=r"does not match this model: missing \['c.weight'\], unknown \['b.weight'\]"
    ):
        of.read_adam_state(good, ["a.weight", "c.weight"], "f")
    uneven = {
        **good,
        "state": {**good["state"], "b.weight": {**good["state"]["b.weight"], "step": torch.tensor(4.0)}},
    }
    with pytest.raises(ValueError, match="different Adam steps"):
        of.read_adam_state(uneven, names, "f")
    no_moment = {**good, "state": {**good["state"], "a.weight": {"step": torch.tensor(5.0)}}}
    with pytest.raises(ValueError, match=r"'a.weight' lacks \['exp_avg', 'exp_avg_sq'\]"):
        of.read_adam_state(no_moment, names, "f")
    with pytest.raises(ValueError, match="no exp_avg_sq for 1 parameters"):
        of.adam_state_dict(
            {"exp_avg": moments["exp_avg"], "exp_avg_sq": {"a.weight": torch.ones(2)}}, 1, group
        )
