"""The torch backend's model converters: the order they run in, what each one does to a model, and
the export chain ``named_weights`` runs the weights through."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForCausalLM

from ppo_trainer import converters
from ppo_trainer.backend import TorchTrainer
from ppo_trainer.config import LoraSettings, TrainerConfig
from ppo_trainer.converters.attention import PackedAttentionConverter
from ppo_trainer.converters.compile import CompileConverter
from ppo_trainer.converters.lora import LoRAConverter, LoRALinear
from ppo_trainer.models import load_critic
from ppo_trainer.sharding import decoder_blocks


def _names(found: list[converters.ModelConverter]) -> list[str]:
    return [c.name for c in found]


def test_the_converters_run_in_order_and_the_reference_gets_no_adapters(
    tiny_model: Path, one_rank_group: dist.ProcessGroup
) -> None:
    config = TrainerConfig(
        role="actor",
        model_path=str(tiny_model),
        pack_sequences=True,
        compile_layers=True,
        lora=LoraSettings(),
    )
    trained = converters.for_model(
        config, trained=True, shard_group=None, device_type="cpu", param_dtype=None
    )
    reference = converters.for_model(
        config, trained=False, shard_group=None, device_type="cpu", param_dtype=None
    )
    assert _names(trained) == ["attention", "lora", "compile"]
    assert _names(reference) == ["attention", "compile"]
    plain = TrainerConfig(role="critic", model_path=str(tiny_model))
    sharded = converters.for_model(
        plain, trained=True, shard_group=one_rank_group, device_type="cpu", param_dtype=None
    )
    assert _names(sharded) == ["sharding"]
    assert (
        converters.for_model(plain, trained=True, shard_group=None, device_type="cpu", param_dtype=None) == []
    )


def test_packed_attention_converter_sets_the_kernel(tiny_model: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    before = model.config._attn_implementation
    out = PackedAttentionConverter("flex_attention").convert(model)
    assert out is model
    assert model.config._attn_implementation == "flex_attention" != before


def test_compile_converter_compiles_every_decoder_layer_and_keeps_the_names(tiny_model: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    names = [n for n, _ in model.named_parameters()]
    CompileConverter().convert(model)
    layers = decoder_blocks(model)
    assert len(layers) == 2
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert [n for n, _ in model.named_parameters()] == names


def test_lora_converter_keeps_the_base_names_and_the_critics_head_trainable(tiny_model: Path) -> None:
    critic = load_critic(tiny_model, seed=1)
    plain_names = list(critic.state_dict())
    converter = LoRAConverter(
        LoraSettings(rank=2, target_modules=("o_proj",)), keep_trainable=("value_head",)
    )
    converter.convert(critic)
    assert sorted(converter.scales) == [f"backbone.layers.{i}.self_attn.o_proj" for i in (0, 1)]
    assert all(isinstance(critic.get_submodule(p), LoRALinear) for p in converter.scales)
    names = list(critic.state_dict())
    assert set(plain_names) <= set(names)  # every base tensor under its own name
    trainable = sorted(n for n, p in critic.named_parameters() if p.requires_grad)
    assert trainable == sorted(
        [f"backbone.layers.{i}.self_attn.o_proj.lora_{m}.weight" for i in (0, 1) for m in "AB"]
        + ["value_head.bias", "value_head.weight"]
    )
    exported = dict(converter.export(iter(critic.state_dict().items()), None))
    assert sorted(exported) == sorted(plain_names)  # merged under the base's names, no adapter tensor


class _Suffix:
    """Renames every tensor on export (a converter that only changes names)."""

    name: ClassVar[str] = "suffix"

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix

    def convert(self, model: nn.Module) -> nn.Module:
        return model

    def export(
        self, weights: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            yield name + self.suffix, tensor


def test_export_undoes_the_last_conversion_first() -> None:
    chain: list[converters.ModelConverter] = [_Suffix(".first"), _Suffix(".second")]
    out = list(converters.export(chain, iter([("w", torch.zeros(1))]), None))
    assert [name for name, _ in out] == ["w.second.first"]


def test_a_trainer_without_converters_exports_its_state_dict(tiny_model: Path) -> None:
    t = TorchTrainer(TrainerConfig(role="actor", model_path=str(tiny_model)))
    assert t.converters == []
    assert t.lora is None
    own = t.model.state_dict()
    exported = dict(t.named_weights(torch.bfloat16))
    assert list(exported) == list(own)
    for name, tensor in exported.items():
        assert torch.equal(tensor, own[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("rank", [1, 3])
def test_lora_scale_is_alpha_over_rank(tiny_model: Path, rank: int) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    converter = LoRAConverter(LoraSettings(rank=rank, alpha=6.0))
    converter.convert(model)
    assert set(converter.scales.values()) == {6.0 / rank}
    layer = model.get_submodule("model.layers.0.mlp.up_proj")
    assert isinstance(layer, LoRALinear)
    with torch.no_grad():
        layer.lora_B.weight.fill_(0.5)
    expected = layer.weight + (6.0 / rank) * layer.lora_B.weight @ layer.lora_A.weight
    torch.testing.assert_close(layer.merged_weight(), expected)
