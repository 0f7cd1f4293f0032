"""The megatron-core backend: GPTModel (local layer spec) with tensor and data parallelism, bf16.

``MegatronTrainer`` runs the same PPO steps as ``TorchTrainer``: both are ``ModelBackend``s of
``ppo_trainer.objective``, which holds every loss, the advantages, the whitening and the metrics. This
module holds what touches the model: the forward passes, the optimizer step, the weights in Hugging
Face names.

- Models: ``GPTModel`` built from the Hugging Face config (Llama, Qwen2), weights converted from the
  transformers model the torch backend would load (``models.load_causal_lm`` / ``load_critic``: same
  files, same seed for a config-only folder), so both backends start from the same numbers. The
  critic is the same trunk with ``output_layer`` swapped for the torch critic's ``Linear(hidden, 1)``
  value head (with its bias and its initial values).
- Precision: megatron's ``Float16Module`` holds bf16 weights; ``DistributedOptimizer`` keeps float32
  main weights, gradients (``grad_reduce_in_fp32``) and Adam moments, sharded over data parallelism.
- Parallelism: ``parallel_state.initialize_model_parallel(tensor_parallel)``; the rest of the world is
  data parallel. Its groups are made through the worker's ``ReloadableProcessGroups``
  (``megatron_groups``), destroyed on sleep and rebuilt on wake; ``after_groups_rebuilt`` rebinds them.
- Tensor-parallel ranks must see the same tokens, while the driver gives every worker rank its own
  share: the ranks of one tensor-parallel group pool their shares (``all_gather_object``), train on
  the union as one data-parallel replica, and each returns the rows of its own samples. The PPO
  reductions (token counts, whitening, metrics) run over megatron's data-parallel group.
- Losses are divided by the global token count already: ``calculate_per_token_loss`` makes megatron's
  DDP sum gradients over data-parallel ranks instead of averaging them.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ppo_lifecycle.process_groups import ReloadableProcessGroups
from ppo_trainer import megatron_convert as mc
from ppo_trainer import objective, token_logprobs
from ppo_trainer.backend_protocol import (
    Batch,
    DataParallel,
    Forward,
    Region,
    evaluating,
    no_region,
    policy_forward,
    scored_model,
)
from ppo_trainer.batch import Samples
from ppo_trainer.checkpoint import megatron_io
from ppo_trainer.config import TrainerConfig
from ppo_trainer.lr_schedule import set_scheduled_lr
from ppo_trainer.megatron_groups import MegatronGroups
from ppo_trainer.models import load_causal_lm, load_critic
from ppo_trainer.packing import PackedMicroBatch

# One MegatronGroups per process: megatron's parallel_state is process-global, so a second trainer
# in the same process (a reference, a test) reuses the groups the first one made.
_PROCESS_GROUPS: dict[int, MegatronGroups] = {}


class ValueHead(nn.Linear):
    """The critic's ``Linear(hidden, 1)``, called the way GPTModel calls its output layer."""

    def forward(  # type: ignore[override]
        self, hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        del weight, runtime_gather_output
        return super().forward(hidden), None


def _hf_config(model_path: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)


def rope_base(hf: Any) -> float:
    """The RoPE base of a Hugging Face config (transformers 4: ``rope_theta``; 5: ``rope_parameters``);
    ``ValueError`` for scaled RoPE (llama3, yarn, ...), which this backend does not convert."""
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(
            f"the megatron backend converts plain RoPE only; this model uses rope_type={kind!r}: "
            "use train.backend='torch'"
        )
    theta = params.get("rope_theta") or getattr(hf, "rope_theta", None) or 10000.0
    return float(theta)


def _transformer_config(hf: Any, shape: mc.ModelShape, tp: int, dtype: torch.dtype, on_cpu: bool) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        # As the transformers model the torch backend trains: Llama and Qwen2 have no dropout outside
        # attention, and apply the config's attention_dropout (0 in their released configs) in training.
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf, "attention_dropout", 0.0) or 0.0),
        tensor_model_parallel_size=tp,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_cpu_initialization=on_cpu,
        attention_softmax_in_fp32=True,
        # The fused kernels need apex or compiled extensions; the local spec runs without them.
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # Every weight is loaded from the converted Hugging Face state right after construction.
        perform_initialization=False,
        # Losses arrive divided by the global token count: DDP must sum, not average.
        calculate_per_token_loss=True,
    )


def build_gpt(
    hf: Any,
    shape: mc.ModelShape,
    tp: int,
    critic: bool,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | None = None,
    packed: bool = False,
) -> nn.Module:
    """GPTModel for a Hugging Face config, weights uninitialised (load them with ``load_hf_into``).

    ``device`` None: the current CUDA device; CPU builds (float32) serve the layout tests. ``packed``:
    its attention also takes samples packed back to back (``megatron_packing``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from ppo_trainer.megatron_packing import PackedRotaryEmbedding, packed_layer_spec

    where = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    on_cpu = where.type == "cpu"
    config = _transformer_config(hf, shape, tp, dtype, on_cpu)
    model = GPTModel(
        config=config,
        transformer_layer_spec=(
            packed_layer_spec() if packed else get_gpt_layer_local_spec(normalization="RMSNorm")
        ),
        vocab_size=shape.padded_vocab(tp),
        max_sequence_length=int(hf.max_position_embeddings),
        pre_process=True,
        post_process=True,
        # Whole logits on every TP rank: ppo_math's log-softmax and entropy run on them unchanged.
        parallel_output=False,
        share_embeddings_and_output_weights=shape.tied_embeddings and not critic,
        position_embedding_type="rope",
        rotary_base=rope_base(hf),  # annotated int; used as a number
    )
    if critic:
        model.output_layer = ValueHead(shape.hidden_size, 1, dtype=dtype, device=where)
    if packed:
        model.rotary_pos_emb = PackedRotaryEmbedding(model.rotary_pos_emb)
    # The local spec's norms are torch.nn.RMSNorm (megatron's WrappedTorchNorm), made without a device:
    # on the CPU, whatever use_cpu_initialization says. megatron's DDP copies a trained model's
    # parameters into its device buffers and so hid it; the reference is not wrapped in DDP and kept
    # CPU norms (the KL-loss crash in input_layernorm). Every tensor goes to the model's device here.
    model.to(where)
    return model


def held_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every tensor ``module`` computes with: parameters, buffers, and tensors its submodules keep as
    plain attributes (megatron's RoPE ``inv_freq``), each storage once. A memory backend must move all
    of them: torch_memory_saver keeps only the tracked contents of a region it pauses."""
    out: dict[int, torch.Tensor] = {}
    for p in module.parameters():
        out.setdefault(id(p), p.data)
    for b in module.buffers():
        out.setdefault(id(b), b)
    for sub in module.modules():
        for value in vars(sub).values():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                out.setdefault(id(value), value)
    return list(out.values())


def misplaced_tensors(modules: Mapping[str, nn.Module], device: torch.device) -> list[str]:
    """``<model>.<tensor>`` for every parameter and buffer of ``modules`` not on ``device`` (a
    forward would fail on it, and no memory backend would move it)."""
    out: list[str] = []
    for label, module in modules.items():
        named = [*module.named_parameters(), *module.named_buffers()]
        out += [f"{label}.{_unwrap_name(n)} ({t.device})" for n, t in named if t.device != device]
        for sub_name, sub in module.named_modules():
            for attr, value in vars(sub).items():
                if isinstance(value, torch.Tensor) and value.device != device:
                    where = f"{_unwrap_name(sub_name)}." if sub_name else ""
                    out.append(f"{label}.{where}{attr} ({value.device})")
    return out


def _unwrap_name(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def load_hf_into(
    module: nn.Module,
    hf_state: Mapping[str, torch.Tensor],
    shape: mc.ModelShape,
    tp: int,
    tp_rank: int,
    critic: bool,
    strict_value_head: bool = True,
) -> None:
    """Copy TP rank ``tp_rank``'s slice of the converted Hugging Face tensors into ``module``'s
    parameters (a GPTModel, possibly wrapped). ``strict_value_head`` False: a policy state into a
    critic keeps the critic's value head."""
    mega = mc.hf_to_megatron(hf_state, shape, critic=critic)
    params = {_unwrap_name(n): p for n, p in module.named_parameters()}
    expected = set(mc.megatron_names(shape, critic))
    if set(params) != expected:
        raise RuntimeError(
            f"megatron GPTModel parameters {sorted(set(params) ^ expected)[:6]} differ from the "
            "converter's; this megatron-core version lays the model out differently"
        )
    missing = [
        n for n in expected if n not in mega and (strict_value_head or not n.startswith("output_layer."))
    ]
    if missing:
        raise ValueError(f"the Hugging Face state lacks {missing[:5]}")
    with torch.no_grad():
        for name, param in params.items():
            if name in mega:
                shard = mc.split_for_tp(name, mega[name], tp, shape, critic)[tp_rank]
                param.copy_(shard.to(device=param.device, dtype=param.dtype))


class MegatronTrainer:
    """One rank of the actor or the critic on megatron-core (see the module docstring)."""

    WEIGHTS_TAG = "weights"
    OPTIMIZER_TAG = "optimizer"

    def __init__(
        self, config: TrainerConfig, groups: ReloadableProcessGroups, region: Region | None = None
    ) -> None:
        from megatron.core import parallel_state as mpu
        from megatron.core import tensor_parallel

        if config.device != "cuda":
            raise ValueError("train.backend='megatron' needs placement.device='cuda'")
        if not dist.is_initialized():
            raise RuntimeError(
                "MegatronTrainer needs torch.distributed initialised by ReloadableProcessGroups"
            )
        self.config = config
        self.region = region or no_region
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.tp = config.tensor_parallel
        world = dist.get_world_size()
        if world % self.tp:
            raise ValueError(f"train.tensor_parallel={self.tp} must divide the role's {world} GPUs")
        self._groups = _model_parallel_groups(groups, self.tp)
        tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
        self.tp_rank = mpu.get_tensor_model_parallel_rank()
        self.dp = DataParallel(
            rank=mpu.get_data_parallel_rank(),
            world_size=mpu.get_data_parallel_world_size(),
            sum_fn=self._dp_sum,
        )
        self.hf_config = _hf_config(config.model_path)
        self.shape = mc.ModelShape.from_hf_config(self.hf_config)
        self.shape.check_tensor_parallel(self.tp)
        self.critic = config.role == "critic"
        # True with TP > 1: named_weights gathers each tensor over the TP group (every rank calls it).
        self.sharded = self.tp > 1
        self.architecture = (self.hf_config.architectures or ["LlamaForCausalLM"])[0]
        started = time.perf_counter()
        hf_state = self._source_state()
        with self.region(self.WEIGHTS_TAG):
            # megatron's DDP (typed Any: megatron-core ships no type information).
            self.ddp: Any = self._build_model(hf_state)
            self.model = self.ddp
            self.reference = self._build_reference()
        self._require_on_device()
        built = time.perf_counter()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer_config = _optimizer_config(config)
        with self.region(self.OPTIMIZER_TAG):
            self.optimizer = self._build_optimizer()
        # The float32 main weights start as the checkpoint's own values, not as their bf16 rounding
        # (what megatron copies from the bf16 weights). From a point of bf16's grid a step smaller
        # than half a bf16 spacing changes no weight: at lr 1e-5 Adam's first steps moved almost no
        # weight of SmolLM2-135M (log-probs 8x less than the torch backend's float32 weights under
        # autocast; benchmarks/backend_parity.py) and the run learnt ~10 steps later.
        with torch.no_grad():
            self._optimizer_shards().scatter(
                "param", mc.hf_to_megatron(hf_state, self.shape, critic=self.critic)
            )
        # What the worker reports of its start-up: the models (megatron's layout), the optimizer.
        self.setup_seconds = {"model": built - started, "optimizer": time.perf_counter() - built}

    def _source_state(self) -> dict[str, torch.Tensor]:
        """The float32 weights of the transformers model the torch backend would load (same files,
        same seeded init), in Hugging Face names."""
        config = self.config
        source = (
            load_critic(config.model_path, config.seed)
            if self.critic
            else load_causal_lm(config.model_path, config.seed)
        )
        return {k: v.detach() for k, v in source.state_dict().items()}

    def _build_model(self, hf_state: Mapping[str, torch.Tensor]) -> Any:
        """The trained GPTModel in bf16 (``Float16Module``) under megatron's DDP, holding ``hf_state``
        (rounded)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.transformer.module import Float16Module

        gpt = build_gpt(self.hf_config, self.shape, self.tp, self.critic, packed=self.config.pack_sequences)
        module = Float16Module(gpt.config, gpt)
        self._load_into(module, hf_state, strict_value_head=True)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=True,
        )
        return DistributedDataParallel(gpt.config, ddp_config, module)

    def _build_reference(self) -> nn.Module | None:
        """The frozen bf16 reference policy, when this role needs it (as the torch backend's)."""
        from megatron.core.transformer.module import Float16Module

        config = self.config
        if not config.algorithm.reference_for(config.role):
            return None
        ref_state = {
            k: v.detach() for k, v in load_causal_lm(config.model_path, config.seed).state_dict().items()
        }
        gpt = build_gpt(self.hf_config, self.shape, self.tp, critic=False, packed=self.config.pack_sequences)
        ref = Float16Module(gpt.config, gpt)
        self._load_into(ref, ref_state, strict_value_head=False, critic=False)
        ref.eval()
        ref.requires_grad_(False)
        return ref

    def _build_optimizer(self) -> Any:
        """megatron's ``DistributedOptimizer`` over the model, its Adam state made now."""
        from megatron.core.optimizer import get_megatron_optimizer

        optimizer = get_megatron_optimizer(self.optimizer_config, [self.model], use_gloo_process_groups=False)
        # Adam's moments would appear in the first step; made here (zeros, step 0, as the step
        # makes them), the memory backend tracks them from setup and the pinned one allocates
        # their host buffers at track(), not in the first sleep. The step is unchanged.
        megatron_io.init_optimizer_state(megatron_io.chained(optimizer))
        return optimizer

    def _modules(self) -> dict[str, nn.Module]:
        """The models this rank computes with: the trained one and, with a KL term, the reference."""
        out: dict[str, nn.Module] = {"model": self.ddp.module}
        if self.reference is not None:
            out["reference"] = self.reference
        return out

    def _require_on_device(self) -> None:
        """``RuntimeError`` naming any tensor of the models that is not on this rank's GPU: the step
        would fail on it (a device mismatch deep in megatron) and no memory backend would move it."""
        stray = misplaced_tensors(self._modules(), self.device)
        if stray:
            raise RuntimeError(
                f"{self.config.role}: {len(stray)} megatron tensors are not on {self.device} "
                f"(e.g. {', '.join(stray[:4])}); this megatron-core version places its modules "
                "differently from what build_gpt expects"
            )

    # ------------------------------------------------------------------ weights in and out
    def _load_into(
        self,
        module: nn.Module,
        hf_state: Mapping[str, torch.Tensor],
        strict_value_head: bool,
        critic: bool | None = None,
    ) -> None:
        critic = self.critic if critic is None else critic
        load_hf_into(module, hf_state, self.shape, self.tp, self.tp_rank, critic, strict_value_head)

    def _megatron_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Whole megatron tensors (gathered over the TP group: collective when TP > 1)."""
        return {
            _unwrap_name(name): self._whole_over_tp(_unwrap_name(name), param.detach())
            for name, param in module.named_parameters()
        }

    def _whole_over_tp(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's TP slice of megatron tensor ``name`` made whole (collective when TP > 1)."""
        from megatron.core import parallel_state as mpu

        kind = mc.parallel_kind(name, self.critic)
        if self.tp > 1 and kind != "replicated":
            parts = [torch.empty_like(tensor) for _ in range(self.tp)]
            dist.all_gather(parts, tensor.contiguous(), group=mpu.get_tensor_model_parallel_group())
            return mc.gather_from_tp(name, parts, self.shape, self.critic)
        if kind == "vocab":
            return tensor[: self.shape.vocab_size]
        return tensor

    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Hugging Face names and layouts, whole tensors, in ``dtype`` (None: bf16 as held)."""
        hf = mc.megatron_to_hf(self._megatron_state(self.model), self.shape, critic=self.critic)
        cast: dict[int, torch.Tensor] = {}
        for name, tensor in hf.items():
            key = id(tensor)  # tied weights: one cast, the same tensor under both names
            if key not in cast:
                cast[key] = tensor.to(dtype) if dtype is not None else tensor
            yield name, cast[key]

    def trainable_weights(self, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
        raise ValueError(
            "train.lora.update='adapters' needs train.lora, a torch-backend option; set train.backend='torch'"
        )

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The float32 main weights (what the optimizer steps; the bf16 weights are their rounding)
        in Hugging Face names, whole CPU tensors. Every rank calls it: the data-parallel shards and
        the tensor-parallel slices are gathered by collectives."""
        return mc.megatron_to_hf(self._optimizer_shards().gathered("param"), self.shape, critic=self.critic)

    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Whole Hugging Face tensors (either backend's checkpoint) into the bf16 weights (rounded) and
        the optimizer's float32 main weights (exact); a critic accepts a policy state (its value head
        stays)."""
        with self.region(self.WEIGHTS_TAG):
            self._load_into(self.ddp.module, state, strict_value_head=False)
        mega = mc.hf_to_megatron(state, self.shape, critic=self.critic)
        with torch.no_grad():
            self._optimizer_shards().scatter("param", mega)

    # ------------------------------------------------------------------ optimizer state in HF names
    # The conversion is checkpoint.megatron_io's (OptimizerShards); this rank supplies its parts.
    def _optimizer_shards(self) -> megatron_io.OptimizerShards:
        """This rank's ``DistributedOptimizer`` shards, the trained parameters by megatron name and
        its tensor-parallel slicing (read now: the groups are rebound after a wake)."""
        return megatron_io.OptimizerShards(
            optimizers=self._optimizers(),
            params=[(_unwrap_name(n), p) for n, p in self.ddp.module.named_parameters() if p.requires_grad],
            device=self.device,
            shape=self.shape,
            critic=self.critic,
            whole_over_tp=self._whole_over_tp,
            tp_slice=self._tp_slice,
        )

    def _tp_slice(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's tensor-parallel slice of whole megatron tensor ``name``."""
        return mc.split_for_tp(name, whole, self.tp, self.shape, self.critic)[self.tp_rank]

    def hf_optimizer_state(self) -> dict[str, Any]:
        """The ``DistributedOptimizer``'s Adam state as the torch backend's ``optimizer.pt`` dict
        (``megatron_io.hf_optimizer_state``). Every rank calls it and gets the whole dict."""
        eps = self.optimizer_config.adam_eps
        return megatron_io.hf_optimizer_state(self._optimizer_shards(), self.config, eps)

    def load_hf_optimizer_state(self, state: Mapping[str, Any]) -> None:
        """An ``optimizer.pt`` dict (either backend's) into this rank's shards of the Adam moments and
        the step count, in the tensors the optimizer holds (the memory backend tracks them)."""
        with self.region(self.OPTIMIZER_TAG), torch.no_grad():
            megatron_io.load_hf_optimizer_state(self._optimizer_shards(), state, self.config.role)

    # ------------------------------------------------------------------ tensors the lifecycle moves
    def _optimizers(self) -> list[Any]:
        return megatron_io.chained(self.optimizer)

    def optimizer_state_entries(self) -> int:
        return len(self.optimizer.state)

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the trained model and the reference (``held_tensors``: the bf16 weights,
        RoPE's frequencies) and DDP's gradient buffers (the memory backend moves whole buffers).

        The gradient buffers go with the weights, not the optimizer state: DDP allocates both buffers
        in its constructor, inside the weights region, and torch_memory_saver pauses a region whole.
        All on this rank's GPU (checked at setup): nothing the step computes with stays behind.
        """
        out = [t for m in self._modules().values() for t in held_tensors(m)]
        out += [b.grad_data for b in self._ddp_buffers() if b.grad_data is not None]
        return out

    def optimizer_tensors(self) -> list[torch.Tensor]:
        """The float32 main weights and Adam moments (this rank's data-parallel shards)."""
        out: list[torch.Tensor] = []
        for opt in self._optimizers():
            inner = opt.optimizer
            for group in inner.param_groups:
                out += [p.data for p in group["params"]]
            for state in inner.state.values():
                out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return [t for t in out if t.device.type == "cuda"]

    def _ddp_buffers(self) -> list[Any]:
        """DDP's contiguous parameter-and-gradient buffers (``_ParamAndGradBuffer``)."""
        return [*self.ddp.buffers, *self.ddp.expert_parallel_buffers]

    def after_groups_rebuilt(self) -> None:
        """Swap the destroyed groups megatron holds for the rebuilt ones (lifecycle post-wake hook)."""
        assert self._groups is not None
        self._groups.rebind(self.model, self.optimizer, self.reference)

    def release_gathered(self) -> None:
        """Nothing is gathered outside the tracked buffers (no-op; kept for the interface)."""

    @property
    def layout(self) -> str:
        return f"megatron tp={self.tp} dp={self.dp.world_size}"

    # ------------------------------------------------------------------ collectives
    def _dp_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state as mpu

        if mpu.get_data_parallel_world_size() == 1:
            return tensor
        on_device = tensor.to(self.device)
        dist.all_reduce(on_device, group=mpu.get_data_parallel_group())
        return on_device.to(tensor.device)

    # ------------------------------------------------------------------ the objective's ModelBackend
    @property
    def has_reference(self) -> bool:
        return self.reference is not None

    def forward(self, mb: Batch, *, reference: bool = False, entropy: bool = False) -> Forward:
        """The actor's (or the reference's) log-probs and entropy, or the critic's values, over ``mb``."""
        if isinstance(mb, PackedMicroBatch):
            return self._packed_forward(mb, reference, entropy)
        model = self._scored(reference)
        length = mb.input_ids.shape[1]
        position_ids = torch.arange(length, device=self.device).unsqueeze(0).expand_as(mb.input_ids)
        # Right padding: the causal mask alone keeps padding out of every real position. The logits
        # stay bf16 (Float16Module's fp32_output=False): the float32 softmax runs on the response
        # positions a chunk at a time, never on a float32 copy of all of them (the cast is exact).
        out = model(mb.input_ids, position_ids, None, fp32_output=False)
        if self.critic and not reference:
            return Forward(values=out.squeeze(-1).float().gather(1, mb.logit_positions))
        # the TP vocabulary padding dropped; the float32 softmax a chunk of positions at a time
        return policy_forward(
            out[..., : self.shape.vocab_size], mb, entropy, self.config.logprob_chunk_tokens
        )

    def _packed_forward(self, mb: PackedMicroBatch, reference: bool, entropy: bool) -> Forward:
        """``forward`` over samples packed back to back (megatron's thd format): no compute on padding.
        The output layer still makes the row's whole logits, in bf16 (GPTModel computes them itself);
        the float32 softmax runs on the response positions' rows, a chunk at a time."""
        from ppo_trainer.megatron_packing import packed_positions, packed_seq_params

        model = self._scored(reference)
        with packed_positions(model, mb.position_ids[0]):
            out = model(
                mb.input_ids,
                mb.position_ids,
                None,
                packed_seq_params=packed_seq_params(mb),
                fp32_output=False,
            )
        picked = out[0].index_select(0, mb.response_index)  # [K, V padded] (or [K, 1]: values)
        if self.critic and not reference:
            return Forward(values=mb.scatter(picked[:, 0].float()))
        log_probs, entropies = token_logprobs.chunked_logit_stats(
            picked[:, : self.shape.vocab_size], mb.targets, entropy, self.config.logprob_chunk_tokens
        )
        return Forward(
            log_probs=mb.scatter(log_probs), entropy=None if entropies is None else mb.scatter(entropies)
        )

    @contextlib.contextmanager
    def inference(self, reference: bool = False) -> Iterator[None]:
        with evaluating(self._scored(reference)):
            yield

    def _scored(self, reference: bool) -> nn.Module:
        return scored_model(self.model, self.reference, reference, self.config.role)

    def train_mode(self) -> None:
        self.model.train()

    def backward(self, loss: torch.Tensor) -> None:
        # DDP sums the gradients over data parallelism (calculate_per_token_loss): no scale here.
        loss.backward()

    def set_step(self, step: int) -> float:
        """The learning rate of training step ``step`` (``lr_schedule``) into every param group of
        megatron's optimizers (no ``OptimizerParamScheduler``: the step's rate is set here, once)."""
        groups = [group for opt in self._optimizers() for group in opt.optimizer.param_groups]
        return set_scheduled_lr(self.config, step, groups)

    def optimizer_step(self) -> float:
        """Reduce gradients over data parallelism, clip, step (main weights -> bf16 weights), clear."""
        self.ddp.finish_grad_sync()
        with self.region(self.OPTIMIZER_TAG):
            ok, grad_norm, _ = self.optimizer.step()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        if not ok:
            raise RuntimeError(
                f"{self.config.role}: megatron's optimizer skipped the step (non-finite gradients)"
            )
        return float(grad_norm or 0.0)

    # ------------------------------------------------------------------ tensor-parallel sample pooling
    def _pool(
        self, samples: Samples, *extra: torch.Tensor | None
    ) -> tuple[Samples, list[torch.Tensor | None], slice, int]:
        """The TP group's samples (and extra ``[N, R]`` tensors) in TP-rank order; this rank's rows."""
        if self.tp == 1:
            return samples, list(extra), slice(0, len(samples)), samples.max_response
        from megatron.core import parallel_state as mpu

        mine = (samples, [None if e is None else e.cpu() for e in extra])
        gathered: list[Any] = [None] * self.tp
        dist.all_gather_object(gathered, mine, group=mpu.get_tensor_model_parallel_group())
        start = sum(len(s) for s, _ in gathered[: self.tp_rank])
        pooled = concat_samples([s for s, _ in gathered])
        width = pooled.max_response
        extras: list[torch.Tensor | None] = []
        for i in range(len(extra)):
            parts = [e[i] for _, e in gathered]
            extras.append(
                None if any(p is None for p in parts) else torch.cat([_widen(p, width) for p in parts])
            )
        return pooled, extras, slice(start, start + len(samples)), samples.max_response

    # ------------------------------------------------------------------ the PPO steps (objective)
    # Over the TP group's pooled samples (megatron's forward passes are collectives within a TP group
    # only, so ranks of different replicas may hold different counts); each rank keeps its own rows.
    def compute_log_probs(self, samples: Samples) -> torch.Tensor:
        pooled, _, rows, width = self._pool(samples)
        return objective.score(self, pooled)[rows, :width]

    def compute_values(self, samples: Samples) -> torch.Tensor:
        pooled, _, rows, width = self._pool(samples)
        return objective.score(self, pooled)[rows, :width]

    def token_rewards(self, samples: Samples) -> tuple[torch.Tensor, dict[str, float]]:
        pooled, _, rows, width = self._pool(samples)
        rewards, metrics = objective.token_rewards(self, pooled)
        return rewards[rows, :width], metrics

    def train_critic(
        self, samples: Samples, policy_log_probs: torch.Tensor | None = None
    ) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        pooled, (pl,), rows, width = self._pool(samples, policy_log_probs)
        metrics, values, rewards = objective.train_critic(self, pooled, pl)
        return metrics, values[rows, :width], rewards[rows, :width]

    def train_actor(
        self, samples: Samples, values: torch.Tensor | None, rewards: torch.Tensor | None = None
    ) -> dict[str, float]:
        pooled, (pv, pr), _, _ = self._pool(samples, values, rewards)
        return objective.train_actor(self, pooled, pv, pr)


def _model_parallel_groups(groups: ReloadableProcessGroups, tp: int) -> MegatronGroups:
    """The process's ``MegatronGroups``: megatron's model-parallel groups made through the worker's
    ``groups`` on first use (``parallel_state`` is process-global), the same object after that."""
    from megatron.core import parallel_state as mpu

    made = _PROCESS_GROUPS.get(id(groups))
    if made is None:
        made = MegatronGroups(groups)
        with made.recording():
            mpu.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
        _PROCESS_GROUPS[id(groups)] = made
    return made


def _optimizer_config(config: TrainerConfig) -> Any:
    """megatron's ``OptimizerConfig`` for the role: Adam with decoupled weight decay (AdamW, as the
    torch backend), float32 main weights and moments over bf16 model weights, global-norm clipping."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=config.lr,
        weight_decay=config.weight_decay,
        adam_beta1=config.betas[0],
        adam_beta2=config.betas[1],
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
        # Clip at grad_clip; "no clipping" still measures the norm (reported as grad_norm).
        clip_grad=config.grad_clip if config.grad_clip > 0 else math.inf,
    )


def _widen(x: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(x, (0, width - x.shape[1]))


def concat_samples(parts: list[Samples]) -> Samples:
    """Several ranks' samples as one batch, response-space tensors re-padded to the widest."""
    width = max(p.max_response for p in parts)

    def cat(field: str) -> torch.Tensor:
        return torch.cat([_widen(getattr(p, field), width) for p in parts])

    return Samples(
        tokens=tuple(t for p in parts for t in p.tokens),
        response_lengths=torch.cat([p.response_lengths for p in parts]),
        response_mask=cat("response_mask"),
        loss_mask=cat("loss_mask"),
        reward=torch.cat([p.reward for p in parts]),
        rollout_log_probs=cat("rollout_log_probs"),
        prompt_index=torch.cat([p.prompt_index for p in parts]),
        turn_rewards=cat("turn_rewards"),
        turn_ids=cat("turn_ids"),
    )


__all__ = ["MegatronTrainer", "ValueHead", "concat_samples"]
