"""``train.lora`` on the torch backend: adapters beside a frozen base, the reference as the base with
the adapters off, merged export to engines and ``hf/``, PEFT's adapter folder, bitwise resume."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import lora_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from ppo_trainer.backend import TorchTrainer
from ppo_trainer.batch import Samples
from ppo_trainer.checkpoint import torch_io
from ppo_trainer.config import AlgorithmConfig, LoraSettings, TrainerConfig, TrainSettings
from ppo_trainer.converters import lora
from ppo_weight_sync import checksum
from ppo_weight_sync.testing.engine import TensorEngine

LLAMA_LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def trainer(
    model: Path, role: str = "actor", lora_settings: LoraSettings | None = None, **kwargs: Any
) -> TorchTrainer:
    if lora_settings is not None:
        kwargs["lora"] = lora_settings
    return TorchTrainer(lora_config(model, role, **kwargs))


def _trained_actor(model: Path, fields_factory: Callable, **kwargs: Any) -> tuple[TorchTrainer, Samples]:
    samples = Samples.from_fields(fields_factory(8, seed=9))
    t = trainer(model, micro_batch_size=4, **kwargs)
    t.train_actor(samples, torch.zeros(len(samples), samples.max_response))
    return t, samples


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens[None]).logits[0]


def test_zero_initialised_b_leaves_the_logits_unchanged(tiny_model: Path, fields_factory: Callable) -> None:
    t = trainer(tiny_model)
    base = AutoModelForCausalLM.from_pretrained(tiny_model).float().eval()
    t.model.eval()
    tokens = Samples.from_fields(fields_factory(2, seed=1)).tokens[0]
    adapted = [m for _, m in lora.lora_modules(t.model)]
    assert len(adapted) == 2 * 7  # two layers, seven linear layers each
    assert all(m.lora_B.weight.abs().sum() == 0 and m.lora_A.weight.abs().sum() > 0 for m in adapted)
    torch.testing.assert_close(_logits(t.model, tokens), _logits(base, tokens), atol=0, rtol=0)


def test_merged_and_unmerged_outputs_agree(tiny_model: Path, fields_factory: Callable) -> None:
    t, samples = _trained_actor(tiny_model, fields_factory)
    assert any(m.lora_B.weight.abs().sum() > 0 for _, m in lora.lora_modules(t.model))
    merged = AutoModelForCausalLM.from_pretrained(tiny_model).float().eval()
    exported = dict(t.named_weights())
    assert set(exported) == set(merged.state_dict())  # Hugging Face names, no adapter tensor
    merged.load_state_dict(exported)
    t.model.eval()
    for tokens in samples.tokens[:3]:
        torch.testing.assert_close(_logits(t.model, tokens), _logits(merged, tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_the_reference_is_the_base_with_adapters_off_and_no_copy(
    tiny_model: Path, fields_factory: Callable, packed: bool
) -> None:
    samples = Samples.from_fields(fields_factory(8, seed=8, samples_per_prompt=4))
    alg = AlgorithmConfig(num_mini_batches=1, estimator="grpo", use_kl_loss=True, kl_loss_coef=0.1)
    t = trainer(tiny_model, algorithm=alg, micro_batch_size=4, pack_sequences=packed)
    assert t.reference is None
    assert t.has_reference
    base_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters())
    adapters = sum(p.numel() for p in t.params)
    held = sum(p.numel() for p in t.model.parameters())
    assert held == base_params + adapters  # one model: no second copy for the reference
    first = t.train_actor(samples, None)
    assert first["ref_kl"] == pytest.approx(0.0, abs=1e-7)
    second = t.train_actor(samples, None)
    assert second["ref_kl"] > 0.0
    # The reference's log-probs are still the untrained model's.
    plain = trainer(tiny_model, algorithm=alg, micro_batch_size=4, pack_sequences=packed)
    from ppo_trainer import objective

    torch.testing.assert_close(
        objective.score(t, samples, reference=True), plain.compute_log_probs(samples), atol=1e-6, rtol=1e-6
    )
    assert all(m.adapters_enabled for _, m in lora.lora_modules(t.model))  # back on after scoring


def test_a_lora_critic_with_reward_kl_holds_a_full_reference(
    tiny_model: Path, fields_factory: Callable
) -> None:
    """The critic's backbone has no LM head, so reward-level KL keeps a separate reference policy."""
    samples = Samples.from_fields(fields_factory(8, seed=21))
    alg = AlgorithmConfig(lam=1.0, gamma=1.0, kl_coef=0.5, kl_estimator="k1", num_mini_batches=1)
    critic = trainer(tiny_model, role="critic", algorithm=alg, micro_batch_size=4)
    assert critic.reference is not None
    assert not any(isinstance(m, lora.LoRALinear) for m in critic.reference.modules())
    plain = TorchTrainer(TrainerConfig(role="critic", model_path=str(tiny_model), algorithm=alg))
    with_lora, _ = critic.token_rewards(samples)
    without, _ = plain.token_rewards(samples)
    torch.testing.assert_close(with_lora, without, atol=0, rtol=0)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_only_adapters_and_the_value_head_train(
    tiny_model: Path, fields_factory: Callable, role: str
) -> None:
    samples = Samples.from_fields(fields_factory(8, seed=6))
    t = trainer(tiny_model, role=role, micro_batch_size=4)
    trainable = {n for n, p in t.model.named_parameters() if p.requires_grad}
    expected = set(lora.adapter_state(t.model))
    if role == "critic":
        expected |= {"value_head.weight", "value_head.bias"}
    assert trainable == expected
    frozen = {n: p.detach().clone() for n, p in t.model.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}
    if role == "critic":
        t.train_critic(samples)
    else:
        t.train_actor(samples, torch.zeros(len(samples), samples.max_response))
    state = t.hf_optimizer_state()["state"]
    assert set(state) == expected  # AdamW's moments for the trained tensors only
    for name, p in t.model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name  # base bytes unchanged
    assert all(
        not torch.equal(dict(t.model.named_parameters())[n], v) for n, v in before.items() if "lora_B" in n
    )


def test_a_bfloat16_run_stores_the_frozen_base_in_bfloat16(
    tiny_model: Path, fields_factory: Callable
) -> None:
    samples = Samples.from_fields(fields_factory(8, seed=6))
    t = trainer(tiny_model, role="critic", dtype="bfloat16", micro_batch_size=4)
    dtypes = {p.dtype for p in t.model.parameters() if not p.requires_grad}
    assert dtypes == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in t.params)
    assert {n for n, p in t.model.named_parameters() if p.requires_grad} >= {"value_head.weight"}
    losses = [t.train_critic(samples)[0]["value_loss"] for _ in range(4)]
    assert losses[-1] < losses[0]
    actor = trainer(tiny_model, dtype="bfloat16")
    exported = dict(actor.named_weights())
    base = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert exported[name].dtype == torch.bfloat16
    assert torch.equal(exported[name], base[name].to(torch.bfloat16))  # B = 0: the base, rounded


def test_engine_holds_the_merged_weights_with_the_trainers_checksum(
    tiny_model: Path, fields_factory: Callable
) -> None:
    t, _ = _trained_actor(tiny_model, fields_factory)
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    spec = {name: ("float32", list(p.shape)) for name, p in base.state_dict().items()}
    engine = TensorEngine(spec, seed=3)
    sent = [(n, w.to(torch.float32, copy=True)) for n, w in t.named_weights()]
    engine.load(sent)
    assert engine.checksum() == checksum(t.named_weights(torch.float32))
    nbytes = sum(w.numel() * w.element_size() for _, w in sent)
    assert nbytes == sum(p.numel() * 4 for p in base.state_dict().values())  # merged: the whole model


def test_resume_is_bitwise_and_exports_merged_and_peft_folders(
    tiny_model: Path, fields_factory: Callable, tmp_path: Path
) -> None:
    t, samples = _trained_actor(tiny_model, fields_factory)
    torch_io.save_shard(t, tmp_path / "actor", step=3)
    resumed = trainer(tiny_model, micro_batch_size=4)
    assert torch_io.load_shard(resumed, tmp_path / "actor") == 3
    for (name, a), (_, b) in zip(
        t.model.state_dict().items(), resumed.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    values = torch.zeros(len(samples), samples.max_response)
    torch.manual_seed(0)
    t.train_actor(samples, values)
    torch.manual_seed(0)
    resumed.train_actor(samples, values)
    for (name, a), (_, b) in zip(
        t.model.state_dict().items(), resumed.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name  # optimizer state resumed too: the next step is the same
    # hf/: the merged weights, loadable as a plain causal LM
    saved = load_file(str(tmp_path / "actor" / "model.safetensors"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "actor" / "hf")
    exported = t.export_state(saved)
    for name, tensor in merged.state_dict().items():
        assert torch.equal(tensor, exported[name]), name
    # hf_adapter/: PEFT's files and key names
    adapter = tmp_path / "actor" / "hf_adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["target_modules"] == LLAMA_LINEAR
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert len(tensors) == 2 * 7 * 2
    assert torch.equal(
        tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"],
        saved["model.layers.1.mlp.down_proj.lora_B.weight"],
    )


def test_an_invalid_target_module_is_refused_naming_the_linear_layers(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="c_attn") as caught:
        trainer(tiny_model, lora_settings=LoraSettings(target_modules=("q_proj", "c_attn")))
    assert str(LLAMA_LINEAR) in str(caught.value)


def test_target_modules_choose_the_adapted_layers(tiny_model: Path) -> None:
    t = trainer(tiny_model, lora_settings=LoraSettings(rank=2, target_modules=("q_proj", "v_proj")))
    assert sorted(p for p, _ in lora.lora_modules(t.model)) == [
        f"model.layers.{i}.self_attn.{n}" for i in (0, 1) for n in ("q_proj", "v_proj")
    ]
    # rank 2 on q (32 -> 32) and v (32 -> 32), two layers
    assert sum(p.numel() for p in t.params) == 2 * 2 * (2 * (32 + 32))


def test_roles_leave_the_other_role_fully_trained(tiny_model: Path) -> None:
    t = trainer(tiny_model, role="critic", lora_settings=LoraSettings(roles=("actor",)))
    assert t.lora is None
    assert all(p.requires_grad for p in t.model.parameters())


def test_megatron_and_fsdp2_refuse_lora() -> None:
    with pytest.raises(ValueError, match=r"train\.lora is a torch-backend option"):
        TrainSettings(backend="megatron", lora=LoraSettings())
    with pytest.raises(ValueError, match="data_parallel='replicate'"):
        TrainSettings(data_parallel="fsdp2", lora=LoraSettings())
