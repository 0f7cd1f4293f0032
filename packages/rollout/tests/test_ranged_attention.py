"""The ranged decode-attention kernel: each row over its own cache columns, against a masked softmax.

Triton kernels run on a GPU; here they run under Triton's interpreter (``TRITON_INTERPRET=1``, on CPU
tensors), which has to be set before the kernels are built, so each check runs in a process of its own.
The GPU runs the compiled kernels in tests/test_gpu_engine.py and benchmarks/gpu_generate.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ppo_rollout.engine import ranged_attention
from ppo_rollout.engine.static_decode import LlamaStaticDecoder

pytest.importorskip("triton", reason="the ranged kernel is a Triton kernel")


def _interpreted(code: str, timeout: float = 240.0) -> dict:
    """Runs ``code`` under Triton's interpreter; it prints one JSON line, returned here."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kernel_is_the_masked_softmax_over_each_rows_range() -> None:
    # Ranges of one column, within one chunk, across chunks (CHUNK=256) and starting past column 0;
    # grouped-query heads; a head size that is not a power of two; a query that is a strided view;
    # cache rows beyond the batch's; float32 and bfloat16.
    result = _interpreted(
        """
        import json, torch
        from ppo_rollout.engine.ranged_attention import ranged_attention, ranged_attention_reference
        torch.manual_seed(0)
        errors = {}
        for dtype in (torch.float32, torch.bfloat16):
            for heads, kv_heads, head_dim in ((6, 2, 24), (4, 4, 16)):
                rows, capacity = 5, 640
                joint = torch.randn(rows, 1, heads + 2, head_dim).to(dtype)
                q = joint[:, :, :heads].transpose(1, 2)  # [B, H, 1, D], not contiguous
                keys = torch.randn(rows + 2, kv_heads, capacity, head_dim).to(dtype)
                values = torch.randn(rows + 2, kv_heads, capacity, head_dim).to(dtype)
                starts = torch.tensor([0, 3, 100, 0, 250])
                ends = torch.tensor([1, 40, 400, 576, 251])
                out = ranged_attention(q, keys, values, starts, ends, 576, head_dim ** -0.5)
                ref = ranged_attention_reference(q, keys, values, starts, ends, head_dim ** -0.5)
                assert out.dtype == dtype and out.shape == (rows, heads, 1, head_dim)
                errors[f"{dtype}-{heads}-{kv_heads}"] = (out.float() - ref.float()).abs().max().item()
        print(json.dumps(errors))
        """
    )
    for case, error in result.items():
        assert error <= (1e-5 if "float32" in case else 2e-2), (case, error)


def test_reference_is_attention_over_the_range_alone() -> None:
    # Columns outside a row's range change nothing; one allowed column gives its value exactly.
    torch.manual_seed(1)
    q = torch.randn(2, 2, 1, 8)
    keys, values = torch.randn(2, 1, 10, 8), torch.randn(2, 1, 10, 8)
    starts, ends = torch.tensor([2, 4]), torch.tensor([6, 5])
    out = ranged_attention.ranged_attention_reference(q, keys, values, starts, ends, 0.3)
    keys2, values2 = keys.clone(), values.clone()
    keys2[0, :, :2] = 99.0
    values2[0, :, 6:] = -99.0
    again = ranged_attention.ranged_attention_reference(q, keys2, values2, starts, ends, 0.3)
    assert torch.equal(out, again)
    assert torch.allclose(out[1, :, 0], values[1, 0, 4].expand(2, 8))


def test_ranged_is_the_default_only_where_the_kernel_runs(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    decoder = LlamaStaticDecoder(AutoModelForCausalLM.from_pretrained(tiny_model))
    assert not ranged_attention.available(torch.device("cpu")) or os.environ.get("TRITON_INTERPRET") == "1"
    assert decoder.attention == ("ranged" if ranged_attention.available(decoder.device) else "matmul")


def test_engine_with_ranged_attention_gives_the_masked_paths_outputs(tiny_model: Path) -> None:
    # Static batches (left-padded rows: ranges start past the padding) and continuous batching (slots
    # from column 0), greedy and sampled: the same tokens as matmul attention over the KV bucket.
    result = _interpreted(
        f"""
        import json, torch
        from ppo_rollout.config import SamplingConfig
        from ppo_rollout.engine.continuous import GenerationRequest
        from ppo_rollout.engine.core import GenerationCore
        torch.set_num_threads(1)
        prompts = [[1, 5, 6], [1, 7, 8, 9, 14, 3, 3], [1, 4]]
        requests = [GenerationRequest(tuple(p), n, seed=10 + i) for i, (p, n) in
                    enumerate(zip(prompts * 2, (9, 3, 14, 1, 6, 11)))]
        outputs = {{}}
        for attention in ("ranged", "matmul"):
            core = GenerationCore({str(tiny_model)!r}, decode="static-eager", max_running=2, refill_every=3)
            decoder = core._continuous_decoder()
            assert decoder is core._decoder and decoder.attention == "ranged"
            decoder.attention = attention
            got = []
            for s in (SamplingConfig(temperature=0.0, max_new_tokens=12, n_samples_per_prompt=2),
                      SamplingConfig(temperature=1.0, max_new_tokens=12, n_samples_per_prompt=2, seed=3)):
                got += [(o.token_ids, o.log_probs) for o in core.generate(prompts, s)]
                s2 = SamplingConfig(temperature=s.temperature, ignore_eos=True)
                got += [(o.token_ids, o.log_probs) for o in core.generate_requests(requests, s2)]
            outputs[attention] = got
        print(json.dumps(outputs))
        """,
        timeout=600.0,
    )
    ranged, masked = result["ranged"], result["matmul"]
    assert len(ranged) == len(masked) == 2 * (6 + 6)
    for (tokens, logps), (tokens2, logps2) in zip(ranged, masked, strict=True):
        assert tokens == tokens2
        assert logps == pytest.approx(logps2, abs=1e-5)


@pytest.mark.gpu
def test_compiled_kernel_on_the_gpu_inside_a_cuda_graph() -> None:
    # The compiled kernels at 0.82B's head shape and SmolLM2's (grouped heads of 64), captured in a
    # CUDA graph and replayed after the ranges moved, as the decode graphs use them.
    torch.manual_seed(0)
    dev = torch.device("cuda")
    assert ranged_attention.available(dev)
    for heads, kv_heads, head_dim in ((16, 16, 128), (9, 3, 64)):
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            rows, capacity = 64, 2112
            q = torch.randn(rows, heads, 1, head_dim, device=dev).to(dtype)
            keys = torch.randn(rows, kv_heads, capacity, head_dim, device=dev).to(dtype)
            values = torch.randn(rows, kv_heads, capacity, head_dim, device=dev).to(dtype)
            starts = torch.randint(0, 64, (rows,), device=dev)
            ends = starts + torch.randint(1, 1900, (rows,), device=dev)
            scale = head_dim**-0.5
            ranged_attention.ranged_attention(q, keys, values, starts, ends, 2048, scale)  # compiles
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = ranged_attention.ranged_attention(q, keys, values, starts, ends, 2048, scale)
            for _ in range(2):
                graph.replay()
                ref = ranged_attention.ranged_attention_reference(q, keys, values, starts, ends, scale)
                assert (out.float() - ref.float()).abs().max().item() <= tolerance, (heads, dtype)
                ends.copy_(torch.minimum(ends + 37, starts + 2048))
