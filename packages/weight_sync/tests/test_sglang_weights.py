"""Weights read back from SGLang (/get_weights_by_name) and the row-limited checksum both sides compute."""

from __future__ import annotations

import pytest
import torch

from ppo_weight_sync import checksum
from ppo_weight_sync.sglang_weights import head_rows, rows_checksum, tensor_from_reply, weights_request


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(10, 4, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(4, generator=g).to(torch.bfloat16)),
    ]


def test_rows_none_is_the_plain_checksum_and_rows_cut_like_sglang() -> None:
    named = _named()
    assert rows_checksum(named) == checksum(named)
    cut = head_rows(named, 3)
    assert [tuple(t.shape) for _, t in cut] == [(3, 4), (3,)]  # tolist()[:3]: rows, or a 1-D's values
    assert rows_checksum(named, 3) == checksum(cut) != checksum(named)
    changed = [(n, t.clone()) for n, t in named]
    changed[0][1][5] += 1  # a row beyond the limit: not seen with rows=3, seen with every row
    assert rows_checksum(changed, 3) == rows_checksum(named, 3)
    assert rows_checksum(changed) != rows_checksum(named)
    with pytest.raises(ValueError, match="rows must be an int >= 1 or None"):
        head_rows(named, 0)


def test_requests_always_name_the_rows_and_replies_round_trip_exactly() -> None:
    # SGLang's truncate_size defaults to 100: every request says how many rows it wants
    assert weights_request("w", (500, 8), None) == {"name": "w", "truncate_size": 500}
    assert weights_request("w", (500, 8), 3) == {"name": "w", "truncate_size": 3}
    assert weights_request("w", (2, 8), 3) == {"name": "w", "truncate_size": 2}
    for name, t in _named():
        # what SGLang answers: tensor.cpu().to(torch.float32).numpy().tolist()[:truncate_size]
        body = t.to(torch.float32).tolist()[:3]  # the same floats; this package installs without numpy
        back = tensor_from_reply(name, body, tuple(t.shape), 3, torch.bfloat16)
        assert torch.equal(back, t[:3])
    with pytest.raises(ValueError, match=r"returned shape \[3, 4\], expected \[2, 4\]"):
        tensor_from_reply("w", [[0.0] * 4] * 3, (2, 4), None, torch.float32)
    with pytest.raises(ValueError, match="expected a list of values"):
        tensor_from_reply(
            "w", {"error": {"message": "Get parameter by name failed"}}, (2,), None, torch.float32
        )
