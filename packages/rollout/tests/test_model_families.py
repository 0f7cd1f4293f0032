"""Each model family the static decoder knows (ppo_weight_sync.families), on a tiny random model: the
engine's greedy tokens are ``transformers`` ``generate``'s and its log-probs those of generate's logits,
in float32, on every decode path (the loop, static batches with matmul and SDPA attention, continuous
slots; the ranged kernel under Triton's interpreter; CUDA graphs on a GPU). Gemma 3's sliding window
is 3 tokens over prompts of up to 10, so a decoder that ignored it would give other tokens (checked)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
)

from ppo_rollout.config import SamplingConfig
from ppo_rollout.engine.core import GenerationCore
from ppo_rollout.engine.decode_fusions import RmsNorm
from ppo_rollout.engine.model_spec import LayerPlan, unsupported_reason
from ppo_rollout.engine.static_decode import StaticDecoder

PROMPTS = [[2, 5, 6, 7, 8, 9, 10, 11, 12, 13], [2, 7, 8], [2, 9, 10, 11, 12, 13]]
NEW_TOKENS = 12
FAMILIES = ["llama", "gemma3"]


def tiny_family_model(kind: str, layers: int = 7, window: int = 3) -> Any:
    """A float32 model of ``kind`` with random norm weights (fresh ones are ones or zeros, which would
    hide a weight applied the wrong way). Gemma 3: layers 0-4 and 6 slide over ``window`` tokens."""
    torch.manual_seed(0)
    shape: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 128,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
    }
    if kind == "llama":
        model: Any = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    else:
        config = Gemma3TextConfig(
            **shape,
            sliding_window=window,
            query_pre_attn_scalar=24,  # not head_dim: a wrong attention scale shows
            rope_theta=10_000.0,
            rope_local_base_freq=100.0,  # local and global rotary tables differ
        )
        model = Gemma3ForCausalLM(config)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.normal_()
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    folder = tmp_path_factory.mktemp(request.param) / "model"
    tiny_family_model(request.param).save_pretrained(folder)
    return request.param, folder


def reference(folder: Path, device: str = "cpu") -> list[tuple[list[int], list[float]]]:
    """transformers' greedy ``generate`` of each prompt alone: its tokens and their log-probs."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    out = []
    for prompt in PROMPTS:
        gen = model.generate(
            torch.tensor([prompt], device=device),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = gen.sequences[0, len(prompt) :].tolist()
        logps = [
            torch.log_softmax(step[0].float(), -1)[t].item()
            for step, t in zip(gen.logits, tokens, strict=True)
        ]
        out.append((tokens, logps))
    return out


GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


def _check(outputs: list[Any], expected: list[tuple[list[int], list[float]]], what: str) -> None:
    for out, (tokens, logps) in zip(outputs, expected, strict=True):
        assert list(out.token_ids) == tokens, what
        assert list(out.log_probs) == pytest.approx(logps, abs=1e-4), what


def test_every_cpu_decode_path_gives_generates_tokens(family: tuple[str, Path]) -> None:
    kind, folder = family
    expected = reference(folder)
    loop = GenerationCore(folder, decode="loop")
    _check(loop.generate(PROMPTS, GREEDY), expected, f"{kind} loop")
    static = GenerationCore(folder, decode="static-eager")
    assert static._decoder is not None
    for attention in ("matmul", "sdpa"):
        static._decoder.attention = attention
        _check(static.generate(PROMPTS, GREEDY), expected, f"{kind} static {attention}")
        assert static.last_decode_path == "static-eager"
        # Continuous slots (per-request limits), two slots so that a request waits and refills.
        slots = static.generate(PROMPTS, GREEDY, max_new_tokens=[NEW_TOKENS] * 3)
        _check(slots, expected, f"{kind} slots {attention}")


def test_the_window_changes_gemma3s_tokens(tmp_path: Path) -> None:
    """Without its window the decoder's tokens are not generate's: the test above sees the window."""
    folder = tmp_path / "gemma3"
    tiny_family_model("gemma3").save_pretrained(folder)
    expected = reference(folder)
    core = GenerationCore(folder, decode="static-eager")
    assert core._decoder is not None
    assert core._decoder.plan.windows == (3, 3, 3, 3, 3, None, 3)  # every 6th layer global
    core._decoder.plan = dataclasses.replace(core._decoder.plan, windows=(None,) * 7)
    tokens = [list(o.token_ids) for o in core.generate(PROMPTS, GREEDY)]
    assert tokens != [t for t, _ in expected]


def test_gemma3s_layer_plan_and_fused_norms() -> None:
    model = tiny_family_model("gemma3")
    plan = LayerPlan.of(model)
    assert plan.scaling == pytest.approx(24**-0.5)
    assert plan.rope == ("sliding_attention_",) * 5 + ("full_attention_", "sliding_attention_")
    assert plan.activation(torch.tensor([1.0])).item() == pytest.approx(0.841192, abs=1e-5)  # gelu tanh
    fused, plain = StaticDecoder(model), StaticDecoder(model, fused=False)
    norms = [*fused._input_norms, *fused._post_norms, fused._final_norm]
    assert fused._attn_out_norms is not None
    assert fused._q_norms is not None
    norms += [*fused._attn_out_norms, *fused._q_norms]
    assert all(n.eps == 1e-6 and n.one_plus for n in norms)
    x = torch.randn(3, 5, 32)
    norm = model.model.layers[0].input_layernorm
    assert torch.allclose(RmsNorm.of(norm, plan.spec)(x, True), norm(x), atol=1e-6)
    # The fused forward and the module-by-module one give transformers' logits.
    ids = torch.tensor([PROMPTS[0]])
    positions = torch.arange(ids.shape[1])[None]
    valid = torch.ones_like(ids, dtype=torch.bool)
    with torch.inference_mode():
        ref = model(input_ids=ids).logits[:, -1]
        for decoder in (fused, plain):
            b = decoder.allocate(1, 64, 4)
            logits = decoder.forward(ids, positions, b, decoder.prefill_bias(valid), ids.shape[1], col=None)
            assert torch.allclose(logits, ref, atol=1e-5), (logits - ref).abs().max()


def test_configs_the_decoder_does_not_compute_are_refused_in_one_line() -> None:
    model = tiny_family_model("gemma3", layers=2)
    model.config.final_logit_softcapping = 30.0
    assert unsupported_reason(model) == "final logit soft-capping (final_logit_softcapping=30.0)"
    model.config.final_logit_softcapping = None
    model.config.hidden_activation = "relu"
    assert unsupported_reason(model) == "hidden_activation 'relu' (only ['gelu_pytorch_tanh'])"
    with pytest.raises(ValueError, match=r"^the static decoder does not support this model: hidden_act"):
        StaticDecoder(model)
    llama = tiny_family_model("llama", layers=2)
    llama.config.layer_types = ["sliding_attention", "full_attention"]
    llama.config.sliding_window = 4
    assert unsupported_reason(llama) == "sliding-window attention"


_RANGED = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from test_model_families import PROMPTS, tiny_family_model
from ppo_rollout.config import SamplingConfig
from ppo_rollout.engine.core import GenerationCore
torch.set_num_threads(1)
folder = {tmp!r} + "/gemma3"
tiny_family_model("gemma3", layers=1).save_pretrained(folder)  # one layer, sliding over 3 tokens
core = GenerationCore(folder, decode="static-eager")
assert core._decoder.attention == "ranged" and core._decoder.plan.windows == (3,)
greedy = SamplingConfig(temperature=0.0, max_new_tokens=6, ignore_eos=True)
got = {{}}
for attention in ("ranged", "matmul"):
    core._decoder.attention = attention
    batch = core.generate(PROMPTS[:2], greedy)
    slots = core.generate(PROMPTS[:2], greedy, max_new_tokens=[6, 4])
    got[attention] = [(o.token_ids, o.log_probs) for o in batch + slots]
print(json.dumps(got))
"""


def test_ranged_attention_narrows_to_gemma3s_window(tmp_path: Path) -> None:
    """The ranged kernel (Triton's interpreter, a process of its own) gives the masked path's tokens
    with the window narrowing each row's range, in static batches and slots (Llama's ranged path:
    test_ranged_attention.py)."""
    pytest.importorskip("triton", reason="the ranged kernel is a Triton kernel")
    code = _RANGED.format(tests=str(Path(__file__).parent), tmp=str(tmp_path))
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(got["ranged"]) == len(got["matmul"]) == 4
    for (tokens, logps), (tokens2, logps2) in zip(got["ranged"], got["matmul"], strict=True):
        assert tokens == tokens2
        assert logps == pytest.approx(logps2, abs=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", FAMILIES)
def test_cuda_graph_decode_gives_generates_tokens(kind: str, tmp_path: Path) -> None:
    folder = tmp_path / kind
    tiny_family_model(kind).save_pretrained(folder)
    expected = reference(folder, "cuda")
    core = GenerationCore(folder, device="cuda", decode="static")
    _check(core.generate(PROMPTS, GREEDY), expected, f"{kind} cuda graphs")
    assert core.last_decode_path == "cuda-graphs", core.graph_failure
    _check(core.generate(PROMPTS, GREEDY, max_new_tokens=[NEW_TOKENS] * 3), expected, f"{kind} slots")
