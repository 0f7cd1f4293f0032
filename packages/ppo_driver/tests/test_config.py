"""Config loading, overrides and the cross-field rules."""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ppo_driver.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    dump_config,
    load_config,
    parse_override,
    validate_config,
)
from ppo_driver.preflight import check_yaml_file
from ppo_lifecycle.plan import ResidentSharedCriticWarning

REPO = Path(__file__).resolve().parents[3]


def test_default_is_valid_and_frozen() -> None:
    config = load_config()
    assert config.placement.critic == "shared"
    assert config.algorithm.estimator == "ppo"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.train.steps = 3  # type: ignore[misc]
    with pytest.raises(ValidationError):
        config.train = config.train  # type: ignore[misc]


def test_cpu_default_file_equals_embedded_default() -> None:
    assert load_config(REPO / "configs" / "cpu-default.yaml") == load_config()


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "configs").glob("*.yaml")))
def test_example_configs_validate(name: str) -> None:
    path = REPO / "configs" / f"{name}.yaml"
    check_yaml_file(path)  # what `ppo-driver train --config` checks first: no key twice
    config = load_config(path)
    if name.startswith("2gpu"):
        assert config.placement.device == "cuda"
        assert (
            config.placement.actor_gpus
            + (config.placement.rollout_gpus or 0) * (config.placement.mode == "disaggregate")
            == 2
        )


@pytest.mark.parametrize("name", ["smollm2-ppo-1gpu", "smollm2-grpo-1gpu", "smollm2-dapo-1gpu"])
def test_smollm2_configs_train_the_imported_model_with_its_template(name: str) -> None:
    config = load_config(REPO / "configs" / f"{name}.yaml")
    assert config.model.path == "models/smollm2-135m-instruct"
    assert (config.rollout.task, config.rollout.reward, config.rollout.chat_template) == (
        "arithmetic_1",
        "math_answer",
        True,
    )
    assert (config.placement.device, config.placement.actor_gpus, config.placement.mode) == (
        "cuda",
        1,
        "colocate",
    )
    assert config.algorithm.estimator == ("ppo" if "ppo" in name else "grpo")
    assert config.train.actor_lr <= 1e-5


@pytest.mark.parametrize(
    ("name", "estimator"), [("smollm2-tools-ppo-1gpu", "ppo"), ("smollm2-tools-grpo-1gpu", "grpo")]
)
def test_tool_configs_roll_out_several_turns_with_the_calculator(name: str, estimator: str) -> None:
    config = load_config(REPO / "configs" / f"{name}.yaml")
    r = config.rollout
    assert (r.task, r.resolved_environment, r.resolved_rollout_function) == (
        "tool_arithmetic",
        "calculator",
        "multi_turn",
    )
    assert r.multi_turn.stop == ("</calc>",)
    assert "<calc>" in (r.system_prompt or "")
    assert r.train_response_limit == r.multi_turn.max_response_tokens
    assert config.algorithm.estimator == estimator
    assert config.use_critic == (estimator == "ppo")


def test_real_model_tasks_and_templates_need_a_model_path() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.task='arithmetic_1' needs a real model"):
        load_config(None, ["rollout.task=arithmetic_1"])
    with pytest.raises(ConfigError, match=r"rollout\.chat_template needs a tokenizer with a chat template"):
        load_config(None, ["rollout.chat_template=true"])
    with pytest.raises(ConfigError, match=r"rollout\.system_prompt needs rollout\.chat_template=true"):
        load_config(None, ["rollout.system_prompt=hi"])


def test_overrides_parse_yaml_scalars() -> None:
    assert parse_override("train.actor_lr=1e-3") == (["train", "actor_lr"], 1e-3)
    assert parse_override("offload.enabled=false") == (["offload", "enabled"], False)
    assert parse_override("model.path=null") == (["model", "path"], None)
    assert parse_override("rollout.sampling.stop_token_ids=[1, 2]") == (
        ["rollout", "sampling", "stop_token_ids"],
        [1, 2],
    )
    assert parse_override("a=x=y") == (["a"], "x=y")


@pytest.mark.parametrize("bad", ["train.steps", "=3", "a..b=1", "x=[1,"])
def test_bad_override_syntax(bad: str) -> None:
    with pytest.raises(ConfigError, match="--set"):
        parse_override(bad)


def test_override_does_not_edit_its_input() -> None:
    data = {"train": {"steps": 5}}
    out = apply_overrides(data, ["train.steps=7", "train.seed=3"])
    assert data == {"train": {"steps": 5}}
    assert out == {"train": {"steps": 7, "seed": 3}}
    with pytest.raises(ConfigError, match=r"train\.steps is a value"):
        apply_overrides(out, ["train.steps.x=1"])


def test_file_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 5\n  seed: 9\n")
    config = load_config(path, ["train.steps=6"])
    assert (config.train.steps, config.train.seed) == (6, 9)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")


def test_unknown_field_suggests_the_close_name() -> None:
    with pytest.raises(ConfigError, match=r"unknown field 'train.stpes'; did you mean 'steps'"):
        load_config(None, ["train.stpes=3"])


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("algorithm.gama", "unknown field 'algorithm.gama'; did you mean 'gamma'"),
        ("rollout.sampling.max_new_token", "did you mean 'max_new_tokens'"),
        ("train.actor_rl", "did you mean 'actor_lr'"),
        ("rollout.eval_intervall", "did you mean 'eval_interval'"),
        ("rollout.sampling.seed", "unknown field 'rollout.sampling.seed'"),
    ],
)
def test_unknown_field_in_a_package_section(key: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(None, [f"{key}=1"])


def test_sections_are_the_packages_settings() -> None:
    """Each setting has one default: the package's."""
    from ppo_rollout.config import RolloutSettings, SamplingSettings
    from ppo_trainer.config import AlgorithmConfig, TrainSettings

    config = load_config()
    assert config.algorithm == AlgorithmConfig()
    assert config.rollout.sampling == SamplingSettings()
    # A section set in part keeps the other defaults.
    part = load_config(None, ["rollout.sampling.temperature=0.5", "algorithm.gamma=0.9"])
    assert dataclasses.replace(part.rollout.sampling, temperature=1.0) == SamplingSettings()
    assert dataclasses.replace(part.algorithm, gamma=1.0) == AlgorithmConfig()
    assert isinstance(config.rollout, RolloutSettings)
    assert isinstance(config.train, TrainSettings)
    for name in TrainSettings.__dataclass_fields__:
        assert getattr(config.train, name) == getattr(TrainSettings(), name)


def test_shared_critic_without_offload_needs_the_debug_flag() -> None:
    with pytest.raises(ConfigError, match=r"offload\.allow_resident_shared_critic"):
        load_config(None, ["offload.enabled=false"])
    # One warning, from ppo-lifecycle's rule, at load; the plan the loop uses is the one built then.
    with pytest.warns(ResidentSharedCriticWarning, match="allow_resident_shared_critic") as caught:
        config = load_config(None, ["offload.enabled=false", "offload.allow_resident_shared_critic=true"])
    assert len(caught) == 1
    assert not config.offload.enabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from ppo_driver import build

        assert build.offload_plan(config).table["critic_train"] == {"actor", "critic", "rollout"}


def test_reward_kl_is_accepted_under_every_critic_placement() -> None:
    for placement in (
        [],
        ["placement.mode=disaggregate"],
        ["placement.critic=dedicated", "placement.mode=disaggregate"],
    ):
        config = load_config(None, ["algorithm.kl_coef=0.05", *placement])
        assert config.algorithm.kl_coef == 0.05


def test_one_step_off_needs_disaggregation_and_a_tis_cap() -> None:
    with pytest.raises(ConfigError, match=r"set placement.mode=disaggregate, or train.async=off"):
        load_config(None, ["train.async=one_step_off", "algorithm.tis_cap=2"])
    with pytest.raises(ConfigError, match=r"set algorithm.tis_cap"):
        load_config(None, ["train.async=one_step_off", "placement.mode=disaggregate"])
    with pytest.raises(ConfigError, match=r"train.async"):
        load_config(None, ["train.async=two_steps_off"])
    config = load_config(
        None, ["train.async=one_step_off", "placement.mode=disaggregate", "algorithm.tis_cap=2"]
    )
    assert config.train.async_ == "one_step_off"
    assert load_config(None, ["train.async=off"]).train.async_ == "off"  # YAML reads `off` as false
    assert "async: one_step_off" in dump_config(config)  # the YAML name, and it loads back
    assert validate_config(yaml.safe_load(dump_config(config))) == config


def test_a_critic_of_another_size_is_checked_before_the_run() -> None:
    # 4 prompts x 3 samples over 3 critic ranks: the sample count divides, but a prompt's samples would
    # be split; refused by validate, naming the field.
    with pytest.raises(ConfigError, match=r"divisible by placement.critic_gpus \(3\)"):
        load_config(
            None,
            [
                "placement.critic=dedicated",
                "placement.mode=disaggregate",
                "placement.critic_gpus=3",
                "rollout.prompts_per_step=4",
                "rollout.sampling.n_samples_per_prompt=3",
                "algorithm.num_mini_batches=1",
                "train.micro_batch_size=1",
            ],
        )
    config = load_config(
        None, ["placement.critic=dedicated", "placement.mode=disaggregate", "placement.critic_gpus=2"]
    )
    assert config.placement.critic_gpus == 2


def test_a_token_budget_replaces_the_micro_batch_size_check() -> None:
    # 256 samples / 4 mini-batches = 64 per mini-batch: 3 samples per micro-batch does not divide it,
    # but a token budget sizes the micro-batches itself.
    config = load_config(
        None,
        ["train.micro_batch_size=3", "train.max_tokens_per_micro_batch=512", "train.pack_sequences=true"],
    )
    assert config.train.max_tokens_per_micro_batch == 512
    assert config.train.pack_sequences


def test_grpo_without_critic() -> None:
    config = load_config(None, ["algorithm.estimator=grpo", "placement.critic=none"])
    assert not config.use_critic


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["placement.critic=shared", "algorithm.estimator=grpo"], "algorithm.estimator"),
        (["placement.critic=none"], "algorithm.estimator"),
        (["train.micro_batch_size=3"], "train.micro_batch_size"),
        (["placement.actor_gpus=3"], "placement.actor_gpus"),
        (["train.global_batch_size=10"], "train.global_batch_size"),
        (["algorithm.num_mini_batches=3"], "algorithm.num_mini_batches"),
        (["train.num_critic_only_steps=120"], "train.num_critic_only_steps"),
        (["placement.rollout_gpus=2"], "placement.rollout_gpus"),
        (["rollout.engine=sglang"], "rollout.engine"),
        (["offload.backend=pinned"], "offload.backend"),
        (["placement.critic=dedicated"], "placement.critic"),
        (["model.tiny.num_heads=3"], "model.tiny.num_heads"),
        (["rollout.dataset=x.jsonl"], "rollout.task"),
        (["rollout.task=nope"], "rollout.task"),
        (["placement.critic_gpus=2"], "placement.critic_gpus"),
        (
            ["algorithm.estimator=grpo", "placement.critic=none", "algorithm.normalize_advantages=true"],
            "algorithm.normalize_advantages",
        ),
        (["algorithm.norm_adv_by_std_in_grpo=false"], "algorithm.norm_adv_by_std_in_grpo"),
        (["algorithm.loss_scale_factor=16"], "algorithm.loss_scale_factor"),
        (["algorithm.loss_aggregation=seq_sum"], "algorithm.loss_aggregation"),
    ],
)
def test_rules_name_the_field(overrides: list[str], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert field in str(info.value)


def test_lora_reaches_both_roles_and_megatron_refuses_it() -> None:
    from ppo_driver import build

    config = load_config(None, ["train.lora.rank=4", "train.lora.target_modules=[q_proj,v_proj]"])
    actor = build.actor_trainer_config(config, "model")
    critic = build.critic_trainer_config(actor, config)
    assert actor.lora is not None
    assert (actor.lora.rank, actor.lora.target_modules) == (4, ("q_proj", "v_proj"))
    assert actor.lora_applies
    assert critic.lora_applies
    with pytest.raises(ConfigError, match=r"train.lora"):
        load_config(None, ["train.lora.rank=4", "train.backend=megatron"])


def test_a_lora_actor_sends_the_builtin_engine_its_adapters_and_sglang_merged_weights_unless_asked(
    tmp_path: Path,
) -> None:
    from ppo_driver import build
    from ppo_rollout.config import AdapterUpdates

    config = load_config(None, ["train.lora.rank=4", "train.lora.alpha=8"])
    actor = build.actor_trainer_config(config, "model")
    assert actor.lora is not None
    assert actor.lora.update == "adapters"  # unset: the built-in engine merges the adapters itself
    assert build.rollout_config(config, "model").lora == AdapterUpdates(rank=4, alpha=8.0)
    merged = load_config(None, ["train.lora.rank=4", "train.lora.update=merged"])
    assert build.actor_trainer_config(merged, "model").lora.update == "merged"  # type: ignore[union-attr]
    assert build.rollout_config(merged, "model").lora is None
    critic_only = load_config(None, ["train.lora.rank=4", "train.lora.roles=[critic]"])
    assert build.rollout_config(critic_only, "model").lora is None
    sglang = [
        "rollout.engine=sglang",
        "train.check_weights=false",
        "placement.device=cuda",
        f"model.path={tmp_path}",
        "train.lora.rank=4",
        "train.lora.target_modules=[q_proj,v_proj]",
    ]
    assert build.rollout_config(load_config(None, sglang), "model").lora is None  # unset: merged
    adapters = load_config(None, [*sglang, "train.lora.update=adapters"])
    assert build.actor_trainer_config(adapters, "model").lora.update == "adapters"  # type: ignore[union-attr]
    assert build.rollout_config(adapters, "model").lora == AdapterUpdates(
        rank=4, alpha=32.0, target_modules=("q_proj", "v_proj")
    )
    with pytest.raises(ConfigError, match=r"train.lora.update='adapters' with SGLang.*gpus_per_engine"):
        load_config(
            None,
            [*sglang, "train.lora.update=adapters", "placement.actor_gpus=2", "placement.gpus_per_engine=2"],
        )


def test_grpo_and_dr_grpo_settings_reach_the_trainer() -> None:
    from ppo_driver import build

    grpo = ["algorithm.estimator=grpo", "placement.critic=none"]
    config = load_config(None, grpo)
    assert config.algorithm.normalize_advantages is False  # null resolves to no second whitening
    assert load_config(None).algorithm.normalize_advantages is True  # the PPO default as before
    dr_grpo = [
        *grpo,
        "algorithm.norm_adv_by_std_in_grpo=false",
        "algorithm.loss_aggregation=seq_mean_token_sum_norm",
        "algorithm.use_kl_loss=true",
        "algorithm.kl_loss_coef=0.01",
        "algorithm.kl_estimator=abs",
    ]
    alg = build.actor_trainer_config(load_config(None, dr_grpo), "/m").algorithm
    assert (alg.norm_adv_by_std_in_grpo, alg.loss_aggregation, alg.kl_estimator) == (
        False,
        "seq_mean_token_sum_norm",
        "abs",
    )
    # Dr. GRPO's constant: the rollout's longest response unless set.
    assert alg.loss_scale_factor == load_config(None).rollout.sampling.max_new_tokens
    fixed = build.actor_trainer_config(load_config(None, [*dr_grpo, "algorithm.loss_scale_factor=512"]), "/m")
    assert fixed.algorithm.loss_scale_factor == 512


def test_dump_round_trips(tmp_path: Path) -> None:
    config = load_config(None, ["train.steps=7", "rollout.sampling.stop_token_ids=[3]"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(config))
    assert load_config(path) == config


def test_critic_config_is_a_copy_with_its_own_lr() -> None:
    from ppo_driver import build

    config = load_config(None, ["algorithm.kl_coef=0.1", "algorithm.tis_cap=2"])
    actor = build.actor_trainer_config(config, "/m")
    critic = build.critic_trainer_config(actor, config)
    assert (actor.role, actor.algorithm.kl_coef, actor.algorithm.tis_cap) == ("actor", 0.1, 2.0)
    assert (critic.role, critic.lr) == ("critic", config.train.critic_lr)
    assert critic.algorithm == actor.algorithm  # the critic shapes the rewards with the same kl_coef
    assert critic.algorithm.reference_for("critic")
    assert not actor.algorithm.reference_for("actor")


def test_translations_build() -> None:
    from ppo_driver import build

    config = load_config(None, ["placement.mode=disaggregate", "placement.rollout_gpus=2"])
    spec = build.placement_spec(config)
    assert (spec.actor_gpus, spec.rollout_gpus, spec.colocate, spec.use_gpus) == (1, 2, False, False)
    rollout = build.rollout_config(config, "/m")
    assert (rollout.num_engines, rollout.gpus_per_engine, rollout.task) == (2, 0, "copy_small")
    assert rollout.sampling.n_samples_per_prompt == config.rollout.sampling.n_samples_per_prompt


@pytest.mark.parametrize(
    ("name", "overrides", "backend", "colocated", "dtype"),
    [
        ("2gpu-disaggregate", [], "nccl", (), "bfloat16"),
        ("2gpu-disaggregate", ["model.dtype=float32"], "nccl", (), "float32"),
        # Colocated, two actor ranks: each sends to the engine on its own GPU over CUDA IPC.
        ("2gpu-colocate", [], "nccl", ((0,), (1,)), "bfloat16"),
        ("cpu-default", [], "gloo", (), "float32"),
    ],
)
def test_the_actor_sends_what_the_engines_accept(
    name: str, overrides: list[str], backend: str, colocated: tuple[tuple[int, ...], ...], dtype: str
) -> None:
    from ppo_driver import build

    config = load_config(REPO / "configs" / f"{name}.yaml", overrides)
    actor = build.actor_trainer_config(config, "/m")
    rollout = build.rollout_config(config, "/m")
    assert actor.weight_sync_backend == backend
    assert actor.weight_sync_colocated == colocated
    assert actor.weight_sync_dtype == rollout.dtype == dtype


@settings(deadline=None, max_examples=60)
@given(
    prompts=st.integers(1, 16),
    samples=st.integers(1, 8),
    dp=st.integers(1, 4),
    micro=st.integers(1, 8),
)
def test_batch_divisibility_is_exactly_the_rule(prompts: int, samples: int, dp: int, micro: int) -> None:
    overrides = [
        f"rollout.prompts_per_step={prompts}",
        f"rollout.sampling.n_samples_per_prompt={samples}",
        f"placement.actor_gpus={dp}",
        f"train.micro_batch_size={micro}",
        "algorithm.num_mini_batches=1",
    ]
    total = prompts * samples
    ok = prompts % dp == 0 and (total // dp) % micro == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if ok:
            assert isinstance(load_config(None, overrides), RunConfig)
        else:
            fields = r"placement\.actor_gpus|train\.micro_batch_size|rollout\.prompts_per_step"
            with pytest.raises(ConfigError, match=fields):
                load_config(None, overrides)


@pytest.mark.parametrize(
    ("name", "overrides", "ranks", "state_share", "shards"),
    [
        # auto shards a large model on CUDA with 2 ranks, not a small one.
        ("2gpu-colocate", [], 2, 0.5, True),
        ("2gpu-colocate", [], 2, 0.1, False),
        ("2gpu-colocate", ["train.data_parallel=replicate"], 2, 0.5, False),
        ("2gpu-colocate", ["train.data_parallel=fsdp2"], 2, 0.0, True),
        ("2gpu-disaggregate", [], 1, 0.5, False),  # one actor rank: nothing to shard over
        ("cpu-default", [], 2, 0.5, False),  # auto never shards on CPU
        ("cpu-default", ["train.data_parallel=fsdp2"], 2, 0.0, True),
    ],
)
def test_data_parallel_reaches_both_roles(
    name: str, overrides: list[str], ranks: int, state_share: float, shards: bool
) -> None:
    from ppo_driver import build

    config = load_config(REPO / "configs" / f"{name}.yaml", overrides)
    actor = build.actor_trainer_config(config, "/m")
    critic = build.critic_trainer_config(actor, config)
    assert actor.shards(ranks, state_share) is shards
    assert critic.shards(ranks, state_share) is shards


def test_share_base_is_refused_without_a_shared_critic() -> None:
    with pytest.raises(ValueError, match=r"share_base=true .* placement.critic='dedicated'"):
        load_config(None, ["placement.critic=dedicated", "train.lora.share_base=true"])
