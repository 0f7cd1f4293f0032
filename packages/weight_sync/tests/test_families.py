"""The model-family table: lookups by model type, architecture and GGUF architecture, and the
one-line refusals that name what is known and the fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ppo_weight_sync.families import (
    FAMILIES,
    decoder_model_types,
    family_for,
    family_of_config,
    find_family,
    gguf_family,
    megatron_family,
)


def test_each_model_type_architecture_and_gguf_name_belongs_to_one_family() -> None:
    for field in ("model_types", "architectures"):
        names = [n for f in FAMILIES for n in getattr(f, field)]
        assert len(names) == len(set(names)), field
    gguf = [f.gguf.architecture for f in FAMILIES if f.gguf is not None]
    assert len(gguf) == len(set(gguf))


def test_lookups() -> None:
    assert family_for("llama").name == "Llama"
    assert find_family(None, ["Qwen2ForCausalLM"]) is family_for("qwen2")
    gemma = family_of_config({"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]})
    assert gemma is not None
    assert gemma.name == "Gemma 3"
    assert gguf_family("gemma3") is gemma
    assert gguf_family("gpt2") is None
    assert decoder_model_types() == ["gemma3_text", "llama", "qwen2"]
    assert gemma.tied_embeddings
    assert gemma.chat.turn_end == ("<end_of_turn>",)


def test_an_unknown_model_type_is_refused_in_one_line_naming_the_known_ones() -> None:
    with pytest.raises(ValueError) as caught:
        family_for("gpt2")
    message = str(caught.value)
    assert message == (
        "model_type 'gpt2' is not a known model family (known: llama, qwen2, gemma3_text); "
        "add one in ppo_weight_sync/families.py"
    )
    assert find_family("gpt2", ["GPT2LMHeadModel"]) is None


def test_the_megatron_backend_takes_llama_and_qwen2_and_refuses_the_rest() -> None:
    assert megatron_family({"model_type": "llama"}).megatron is not None
    qwen2 = megatron_family({"model_type": "qwen2"}).megatron
    assert qwen2 is not None
    assert qwen2.qkv_bias == "always"
    with pytest.raises(
        ValueError, match=r"^model_type 'gemma3_text' \(Gemma 3\) is not supported by the megatron"
    ):
        megatron_family({"model_type": "gemma3_text"})
    with pytest.raises(
        ValueError, match=r"converts Llama and Qwen2 models; this config has model_type='gpt2'"
    ):
        megatron_family({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_the_table_itself_needs_no_torch() -> None:
    # The module imports nothing heavy (its package's __init__ does import torch: the table is read
    # where torch is loaded anyway, or imported inside the function that needs it).
    code = (
        "import importlib.util, sys; "
        "spec = importlib.util.spec_from_file_location('families', sys.argv[1]); "
        "m = importlib.util.module_from_spec(spec); sys.modules['families'] = m; spec.loader.exec_module(m); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    import ppo_weight_sync.families as families

    subprocess.run([sys.executable, "-c", code, families.__file__], check=True)
