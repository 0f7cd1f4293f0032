"""Model families: what ppo-* needs to know of a Hugging Face causal LM's architecture, one entry each.

The torch backend and the engines' decode loop take any transformers causal LM. Four paths need to
know a model's family, and each reads its entry in :data:`FAMILIES`:

- the built-in engine's static decoder (``ppo_rollout.engine.static_decode``): :class:`DecoderSpec`,
  the parts of a decoder layer it computes with its own kernels; None: the decode loop only;
- the megatron backend (``ppo_trainer.megatron_convert``): :class:`MegatronLayout`; None: the backend
  refuses the model in one line, naming ``train.backend: torch``;
- ``ppo-driver import-model``: :class:`GgufHints` (the GGUF ``general.architecture`` and tokenizer)
  and :class:`ChatNotes` (the tokens that end a turn in the family's chat templates).

The rollout and the trainer both import this module (they never import each other), so a family is
one entry here. Pure Python: no torch, no transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "FAMILIES",
    "ChatNotes",
    "DecoderSpec",
    "GgufHints",
    "MegatronLayout",
    "ModelFamily",
    "NormKind",
    "decoder_model_types",
    "family_for",
    "family_of_config",
    "find_family",
    "gguf_family",
    "megatron_family",
]

NormKind = Literal["rms", "rms_one_plus"]
"""``rms``: ``x * rsqrt(mean(x^2) + eps)`` in float32, cast back, times the weight (Llama).
``rms_one_plus``: the same normalisation times ``(1 + weight)``, both in float32, then cast (Gemma)."""


@dataclass(frozen=True)
class DecoderSpec:
    """A family's decoder layer as the static decoder computes it.

    ``norm_classes`` are the transformers RMSNorm classes whose forward is ``norm`` (the decoder fuses
    those, and calls a norm of any other class as it is). ``sandwich_norms``: four norms a layer, one
    on the attention's output (``post_attention_layernorm``) and two around the MLP
    (``pre_feedforward_layernorm``, ``post_feedforward_layernorm``); otherwise ``input_layernorm``
    before attention and ``post_attention_layernorm`` before the MLP. ``qk_norm``: ``self_attn.q_norm``
    and ``k_norm`` over each head before the rotary embedding. The MLP is ``down(act(gate(x)) *
    up(x))`` with ``act`` one of ``activations``, named by the config field ``activation_field``.
    ``embedding_scale``: the embedding module multiplies by ``sqrt(hidden_size)`` (its
    ``embed_scale``). ``query_scale_field``: attention scores scale by that config value ``** -0.5``
    (None: ``head_dim ** -0.5``). ``sliding_window``: layers that ``config.layer_types`` marks
    ``sliding_attention`` attend to the last ``config.sliding_window`` tokens; otherwise a model with
    such layers is refused. ``rope_per_layer_type``: one rotary table per layer type
    (``rotary_emb.<type>_inv_freq``: Gemma 3's local layers use ``rope_local_base_freq``), else one
    (``rotary_emb.inv_freq``). ``refused``: config fields the decoder does not compute, refused when
    set (not None or False), with what each is.
    """

    norm: NormKind
    norm_classes: tuple[str, ...]
    activations: tuple[str, ...] = ("silu",)
    activation_field: str = "hidden_act"
    sandwich_norms: bool = False
    qk_norm: bool = False
    embedding_scale: bool = False
    query_scale_field: str | None = None
    sliding_window: bool = False
    rope_per_layer_type: bool = False
    refused: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class MegatronLayout:
    """How the megatron backend converts the family (``ppo_trainer.megatron_convert``: the Llama layer
    names and layouts). ``qkv_bias``: ``always`` (Qwen2), or only with the config's
    ``attention_bias`` (Llama)."""

    qkv_bias: Literal["always", "attention_bias"]


@dataclass(frozen=True)
class GgufHints:
    """What a GGUF file of the family holds: its ``general.architecture`` and the
    ``tokenizer.ggml.model`` values its files use (``llama``: SentencePiece; ``gpt2``: byte-level BPE)."""

    architecture: str
    tokenizers: tuple[str, ...]


@dataclass(frozen=True)
class ChatNotes:
    """The family's chat templates: ``turn_end``, the tokens that end an assistant turn (an import
    makes the ones the tokenizer's template uses end the engines' responses), and a note for users."""

    turn_end: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class ModelFamily:
    """One model family: its Hugging Face ``model_types`` and ``architectures``, whether
    ``tie_word_embeddings`` is on when a config leaves it out, and what each path knows of it."""

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    tied_embeddings: bool
    decoder: DecoderSpec | None
    megatron: MegatronLayout | None
    gguf: GgufHints | None
    chat: ChatNotes = ChatNotes()


_LLAMA_DECODER = DecoderSpec(norm="rms", norm_classes=("LlamaRMSNorm", "Qwen2RMSNorm"))

FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        name="Llama",
        model_types=("llama",),
        architectures=("LlamaForCausalLM",),
        tied_embeddings=False,
        decoder=_LLAMA_DECODER,
        megatron=MegatronLayout(qkv_bias="attention_bias"),
        gguf=GgufHints(architecture="llama", tokenizers=("llama", "gpt2")),
        chat=ChatNotes(
            note="templates differ by model: Llama 3's ends a turn with <|eot_id|>, SmolLM2's "
            "with <|im_end|>; the tokenizer's own template and eos are kept"
        ),
    ),
    ModelFamily(
        name="Qwen2",
        model_types=("qwen2",),
        architectures=("Qwen2ForCausalLM",),
        tied_embeddings=False,
        decoder=_LLAMA_DECODER,
        megatron=MegatronLayout(qkv_bias="always"),
        gguf=GgufHints(architecture="qwen2", tokenizers=("gpt2",)),
        chat=ChatNotes(turn_end=("<|im_end|>",), note="ChatML: <|im_start|>role ... <|im_end|>"),
    ),
    ModelFamily(
        name="Gemma 3",
        model_types=("gemma3_text",),
        architectures=("Gemma3ForCausalLM",),
        tied_embeddings=True,
        decoder=DecoderSpec(
            norm="rms_one_plus",
            norm_classes=("Gemma3RMSNorm",),
            activations=("gelu_pytorch_tanh",),
            activation_field="hidden_activation",
            sandwich_norms=True,
            qk_norm=True,
            embedding_scale=True,
            query_scale_field="query_pre_attn_scalar",
            sliding_window=True,
            rope_per_layer_type=True,
            refused=(
                ("attn_logit_softcapping", "attention logit soft-capping"),
                ("final_logit_softcapping", "final logit soft-capping"),
                ("use_bidirectional_attention", "bidirectional attention"),
            ),
        ),
        megatron=None,
        gguf=GgufHints(architecture="gemma3", tokenizers=("llama",)),
        chat=ChatNotes(
            turn_end=("<end_of_turn>",),
            note="<start_of_turn>user ... <end_of_turn>; no system role: the template puts a system "
            "message at the start of the first user turn",
        ),
    ),
)
"""Every family, in the order error messages list them."""


def _known() -> str:
    return ", ".join(t for f in FAMILIES for t in f.model_types)


def find_family(
    model_type: str | None, architectures: tuple[str, ...] | list[str] = ()
) -> ModelFamily | None:
    """The family of a ``model_type`` (or, failing that, of one of ``architectures``); None if unknown."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    for family in FAMILIES:
        if set(architectures) & set(family.architectures):
            return family
    return None


def family_for(model_type: str | None, architectures: tuple[str, ...] | list[str] = ()) -> ModelFamily:
    """:func:`find_family`, or ``ValueError`` in one line naming ``model_type`` and the known ones."""
    family = find_family(model_type, architectures)
    if family is None:
        raise ValueError(
            f"model_type {model_type!r} is not a known model family (known: {_known()}); "
            "add one in ppo_weight_sync/families.py"
        )
    return family


def family_of_config(config: Mapping[str, Any] | Any) -> ModelFamily | None:
    """The family of a ``config.json`` mapping or a transformers config, or None."""
    if isinstance(config, Mapping):
        return find_family(config.get("model_type"), config.get("architectures") or ())
    return find_family(getattr(config, "model_type", None), getattr(config, "architectures", None) or ())


def decoder_model_types() -> list[str]:
    """The model types the static decoder computes, sorted."""
    return sorted(t for f in FAMILIES if f.decoder is not None for t in f.model_types)


def megatron_family(config: Mapping[str, Any] | Any) -> ModelFamily:
    """The family of a config whose family has a megatron layout, or ``ValueError`` in one line that
    names the fix."""
    family = family_of_config(config)
    get = config.get if isinstance(config, Mapping) else lambda key: getattr(config, key, None)
    if family is not None and family.megatron is None:
        raise ValueError(
            f"model_type {get('model_type')!r} ({family.name}) is not supported by the megatron backend: "
            "use train.backend: torch"
        )
    if family is None or family.megatron is None:
        names = " and ".join(f.name for f in FAMILIES if f.megatron is not None)
        raise ValueError(
            f"the megatron backend converts {names} models; this config has model_type="
            f"{get('model_type')!r}, architectures={get('architectures') or []!r}; use train.backend='torch'"
        )
    return family


def gguf_family(architecture: str) -> ModelFamily | None:
    """The family whose GGUF files name ``architecture`` as ``general.architecture``, or None."""
    for family in FAMILIES:
        if family.gguf is not None and family.gguf.architecture == architecture:
            return family
    return None
