"""Hugging Face Llama/Qwen2 <-> megatron-core GPTModel (local layer spec): names, layouts, TP shards.

Which families convert is their entry in ``ppo_weight_sync.families`` (a :class:`MegatronLayout`);
a family without one (Gemma 3) is refused in one line that names ``train.backend: torch``.

Pure torch on plain tensors (no megatron import), so CI checks every rule without a GPU.

Layouts (megatron-core 0.19, ``get_gpt_layer_local_spec``):

- ``self_attention.linear_qkv``: Q, K and V fused per query group. With ``g`` query groups (the KV
  heads), ``h`` attention heads and head size ``d``, group ``j``'s rows are its ``h / g`` query heads,
  then its key head, then its value head, ``d`` rows each: ``[g, (h/g + 2) * d, hidden]``. Qwen2's
  Q/K/V biases fuse the same way. Tensor parallelism splits along the groups (column parallel), so a
  rank holds whole groups.
- ``mlp.linear_fc1``: ``cat([gate, up])`` (megatron's gated linear unit chunks it in two). Each
  tensor-parallel rank holds ``cat([gate_r, up_r])`` of its own slices, not a slice of the whole.
- row-parallel ``linear_proj`` and ``linear_fc2`` split their input dimension (dim 1); the word
  embeddings and the output layer split the (padded) vocabulary (dim 0); norms are replicated.

Tied embeddings: megatron's GPTModel has no ``output_layer.weight`` (it reuses the embeddings), while
a Hugging Face state dict lists ``lm_head.weight`` too; :func:`megatron_to_hf` writes it as the
embedding tensor, as ``state_dict()`` of the Hugging Face model would.

The critic (``CriticModel`` of ``models.py``) uses the names ``backbone.<base model name>`` and
``value_head.{weight,bias}``; :func:`hf_to_megatron` / :func:`megatron_to_hf` take ``critic=True``
for those (megatron side: the same trunk, ``output_layer`` is the value head, with a bias).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ppo_weight_sync.families import FAMILIES, megatron_family

Parallel = Literal["column", "row", "vocab", "fc1", "replicated"]

SUPPORTED_ARCHITECTURES = tuple(a for f in FAMILIES if f.megatron is not None for a in f.architectures)
"""The architectures of the families with a megatron layout (``ppo_weight_sync.families``)."""


@dataclass(frozen=True)
class ModelShape:
    """What the conversion needs of a Hugging Face config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | Any) -> ModelShape:
        """From a ``config.json`` mapping or a transformers ``PretrainedConfig`` of a family with a megatron
        layout (``ppo_weight_sync.families``: Llama, Qwen2)."""

        def get(key: str, default: Any = None) -> Any:
            if isinstance(config, Mapping):
                return config.get(key, default)
            return getattr(config, key, default)

        def number(key: str) -> int:
            value = get(key)
            if value is None:
                raise ValueError(f"the model config lacks {key!r}; it is not a {_names()} config")
            return int(value)

        family = megatron_family(config)  # ValueError in one line for a family it does not convert
        assert family.megatron is not None
        heads = number("num_attention_heads")
        hidden = number("hidden_size")
        kv = get("num_key_value_heads")
        head_dim = get("head_dim")
        return cls(
            num_layers=number("num_hidden_layers"),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(kv) if kv is not None else heads,
            head_dim=int(head_dim) if head_dim is not None else hidden // heads,
            intermediate_size=number("intermediate_size"),
            vocab_size=number("vocab_size"),
            tied_embeddings=bool(get("tie_word_embeddings", family.tied_embeddings)),
            # Qwen2 has Q/K/V biases; Llama has them only with attention_bias=true.
            qkv_bias=family.megatron.qkv_bias == "always" or bool(get("attention_bias", False)),
        )

    def check_tensor_parallel(self, tp: int) -> None:
        """``ValueError`` unless ``tp`` divides the heads, the KV heads and the MLP width."""
        for what, n in (
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("intermediate_size", self.intermediate_size),
        ):
            if n % tp:
                raise ValueError(
                    f"train.tensor_parallel={tp} must divide the model's {what}={n}; pick a divisor of it"
                )

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary megatron holds: rounded up to a multiple of ``tp`` (extra rows are zero)."""
        return -(-self.vocab_size // tp) * tp


def _names() -> str:
    return " or ".join(f.name for f in FAMILIES if f.megatron is not None)


def _layer_spec(shape: ModelShape) -> list[tuple[str, tuple[str, ...], Parallel]]:
    attn = "self_attn."
    spec: list[tuple[str, tuple[str, ...], Parallel]] = [
        (
            "self_attention.linear_qkv.weight",
            (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
            "column",
        ),
    ]
    if shape.qkv_bias:
        spec.append(
            (
                "self_attention.linear_qkv.bias",
                (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                "column",
            )
        )
    spec += [
        ("self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row"),
        ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "fc1"),
        ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "row"),
        ("input_layernorm.weight", ("input_layernorm.weight",), "replicated"),
        ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "replicated"),
    ]
    return spec


@dataclass(frozen=True)
class _Entry:
    megatron: str
    hf: tuple[str, ...]
    parallel: Parallel


def _entries(shape: ModelShape, critic: bool) -> list[_Entry]:
    """Every megatron tensor and the HF tensors it is made of, in Hugging Face ``state_dict`` order."""
    base = "backbone." if critic else "model."
    out = [_Entry("embedding.word_embeddings.weight", (base + "embed_tokens.weight",), "vocab")]
    for i in range(shape.num_layers):
        layer = f"{base}layers.{i}."
        for mega, hf, parallel in _layer_spec(shape):
            out.append(_Entry(f"decoder.layers.{i}.{mega}", tuple(layer + n for n in hf), parallel))
    out.append(_Entry("decoder.final_layernorm.weight", (base + "norm.weight",), "replicated"))
    if critic:
        # The value head: [1, hidden] and [1]; never split (every TP rank computes the same value).
        out.append(_Entry("output_layer.weight", ("value_head.weight",), "replicated"))
        out.append(_Entry("output_layer.bias", ("value_head.bias",), "replicated"))
    elif not shape.tied_embeddings:
        out.append(_Entry("output_layer.weight", ("lm_head.weight",), "vocab"))
    return out


def megatron_names(shape: ModelShape, critic: bool = False) -> list[str]:
    """The megatron GPTModel parameter names this converter produces."""
    return [e.megatron for e in _entries(shape, critic)]


def hf_names(shape: ModelShape, critic: bool = False) -> list[str]:
    """The Hugging Face ``state_dict`` names, in its order (``lm_head.weight`` included when tied)."""
    names = [n for e in _entries(shape, critic) for n in e.hf]
    if shape.qkv_bias:
        # transformers registers each projection's weight then its bias: q.w, q.b, k.w, k.b, v.w, v.b.
        for i in range(len(names)):
            if names[i].endswith("q_proj.weight"):
                base = names[i][: -len("q_proj.weight")]
                block = [base + f"{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")]
                names[i : i + 6] = block
    if shape.tied_embeddings and not critic:
        names.append("lm_head.weight")
    return names


# ---------------------------------------------------------------------------------------- fusions
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """Q ``[h*d, ...]``, K and V ``[g*d, ...]`` (weights or biases) to megatron's grouped layout."""
    g, d = shape.num_kv_heads, shape.head_dim
    rest = q.shape[1:]
    qg = q.reshape(g, shape.heads_per_group * d, *rest)
    kg = k.reshape(g, d, *rest)
    vg = v.reshape(g, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv` (also on one TP rank's rows, with ``shape`` narrowed by groups)."""
    d, per = shape.head_dim, shape.heads_per_group
    rest = qkv.shape[1:]
    grouped = qkv.reshape(-1, (per + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return q.reshape(-1, *rest).clone(), k.reshape(-1, *rest).clone(), v.reshape(-1, *rest).clone()


def _check_shape(name: str, tensor: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)} from the model "
            "config; the weights are not of this architecture"
        )


def _hf_shapes(shape: ModelShape, entry: _Entry) -> list[tuple[int, ...]]:
    h, d, f = shape.hidden_size, shape.head_dim, shape.intermediate_size
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    name = entry.megatron
    if name.endswith("linear_qkv.weight"):
        return [(q, h), (kv, h), (kv, h)]
    if name.endswith("linear_qkv.bias"):
        return [(q,), (kv,), (kv,)]
    if name.endswith("linear_proj.weight"):
        return [(h, q)]
    if name.endswith("linear_fc1.weight"):
        return [(f, h), (f, h)]
    if name.endswith("linear_fc2.weight"):
        return [(h, f)]
    if name == "output_layer.weight" and entry.hf == ("value_head.weight",):
        return [(1, h)]
    if name == "output_layer.bias":
        return [(1,)]
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return [(shape.vocab_size, h)]
    return [(h,)]


# ---------------------------------------------------------------------------------------- whole tensors
def hf_to_megatron(
    state: Mapping[str, torch.Tensor], shape: ModelShape, critic: bool = False, strict: bool = True
) -> dict[str, torch.Tensor]:
    """Hugging Face tensors to megatron names and fused layouts (whole, unsplit tensors).

    ``critic``: the critic's names (``backbone.*``, ``value_head.*``); a policy state (``model.*``,
    ``lm_head.*`` ignored) is accepted too, leaving the value head out when absent. ``strict``:
    ``ValueError`` listing missing tensors (the value head may always be missing).
    """
    if critic:
        state = {
            ("backbone." + k[len("model.") :] if k.startswith("model.") else k): v for k, v in state.items()
        }
    out: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for entry in _entries(shape, critic):
        parts = [state.get(n) for n in entry.hf]
        if any(p is None for p in parts):
            if not entry.hf[0].startswith("value_head."):
                missing += [n for n, p in zip(entry.hf, parts, strict=True) if p is None]
            continue
        tensors = [p for p in parts if p is not None]
        for n, t, expected in zip(entry.hf, tensors, _hf_shapes(shape, entry), strict=True):
            _check_shape(n, t, expected)
        if len(tensors) == 3:
            out[entry.megatron] = fuse_qkv(tensors[0], tensors[1], tensors[2], shape)
        elif len(tensors) == 2:
            out[entry.megatron] = torch.cat(tensors, dim=0)
        else:
            out[entry.megatron] = tensors[0]
    if missing and strict:
        raise ValueError(
            f"the Hugging Face state lacks {len(missing)} tensors of this architecture "
            f"(e.g. {', '.join(missing[:5])})"
        )
    return out


def megatron_to_hf(
    state: Mapping[str, torch.Tensor], shape: ModelShape, critic: bool = False
) -> dict[str, torch.Tensor]:
    """Megatron whole tensors back to Hugging Face names and layouts, in ``state_dict`` order."""
    out: dict[str, torch.Tensor] = {}
    for entry in _entries(shape, critic):
        if entry.megatron not in state:
            raise ValueError(f"megatron state lacks {entry.megatron!r}")
        tensor = state[entry.megatron]
        if len(entry.hf) == 3:
            for n, t in zip(entry.hf, split_qkv(tensor, shape), strict=True):
                out[n] = t
        elif len(entry.hf) == 2:
            gate, up = torch.chunk(tensor, 2, dim=0)
            out[entry.hf[0]], out[entry.hf[1]] = gate.clone(), up.clone()
        else:
            out[entry.hf[0]] = tensor
    if shape.tied_embeddings and not critic:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return {name: out[name] for name in hf_names(shape, critic)}


# ---------------------------------------------------------------------------------------- tensor parallel
def parallel_kind(megatron_name: str, critic: bool = False) -> Parallel:
    """How tensor parallelism splits a megatron tensor."""
    if critic and megatron_name.startswith("output_layer."):
        return "replicated"
    if megatron_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "vocab"
    for suffix, kind in (
        ("linear_qkv.weight", "column"),
        ("linear_qkv.bias", "column"),
        ("linear_fc1.weight", "fc1"),
        ("linear_proj.weight", "row"),
        ("linear_fc2.weight", "row"),
    ):
        if megatron_name.endswith(suffix):
            return kind  # type: ignore[return-value]
    return "replicated"


def split_for_tp(
    name: str, tensor: torch.Tensor, tp: int, shape: ModelShape, critic: bool = False
) -> list[torch.Tensor]:
    """One whole megatron tensor to its ``tp`` rank shards (vocabulary padded with zero rows)."""
    kind = parallel_kind(name, critic)
    if kind == "replicated":
        return [tensor] * tp
    if kind == "vocab":
        padded = shape.padded_vocab(tp)
        if padded != tensor.shape[0]:
            extra = tensor.new_zeros(padded - tensor.shape[0], *tensor.shape[1:])
            tensor = torch.cat([tensor, extra], dim=0)
        return [c.clone() for c in torch.chunk(tensor, tp, dim=0)]
    if kind == "column":
        # Whole query groups per rank: the grouped layout is group-major, so plain chunks are groups.
        return [c.clone() for c in torch.chunk(tensor, tp, dim=0)]
    if kind == "row":
        return [c.clone() for c in torch.chunk(tensor, tp, dim=1)]
    gate, up = torch.chunk(tensor, 2, dim=0)
    return [torch.cat([g, u], dim=0) for g, u in zip(torch.chunk(gate, tp), torch.chunk(up, tp), strict=True)]


def gather_from_tp(
    name: str, shards: Sequence[torch.Tensor], shape: ModelShape, critic: bool = False
) -> torch.Tensor:
    """Inverse of :func:`split_for_tp`: the whole tensor (vocabulary padding dropped)."""
    kind = parallel_kind(name, critic)
    if kind == "replicated":
        return shards[0]
    if kind == "vocab":
        return torch.cat(list(shards), dim=0)[: shape.vocab_size]
    if kind == "column":
        return torch.cat(list(shards), dim=0)
    if kind == "row":
        return torch.cat(list(shards), dim=1)
    halves = [torch.chunk(s, 2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
