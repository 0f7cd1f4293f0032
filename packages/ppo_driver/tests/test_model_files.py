"""Damaged model files are named from their own tables (safetensors and GGUF headers) in one line:
by pre-flight (``model.path``) and by ``import-model`` (its SRC), before anything loads them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ppo_driver.cli import main
from ppo_driver.model_files import gguf_problem, safetensors_problem


def _gguf(path: Path) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.add_tensor("token_embd.weight", np.ones((49, 61), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones((61,), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_whole_gguf_file_passes_and_a_cut_one_says_how_much_is_there(tmp_path: Path) -> None:
    whole = _gguf(tmp_path / "m.gguf")
    assert gguf_problem(whole) is None
    data = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 200])
    problem = gguf_problem(cut)
    assert problem is not None
    assert problem.startswith(f"{cut} is truncated or damaged ({len(data) - 200} of ")
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:60])  # inside the metadata
    assert gguf_problem(head) == f"{head} is truncated or damaged (60 bytes; its header is cut at byte 60)"


def test_a_cut_safetensors_file_is_named_with_its_sizes(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": np.ones((100, 10), dtype=np.float32)}, str(path))
    assert safetensors_problem(path) is None
    data = path.read_bytes()
    path.write_bytes(data[:-1000])
    assert (
        safetensors_problem(path)
        == f"{path} is truncated or damaged ({len(data) - 1000} of {len(data)} bytes)"
    )
    path.write_bytes(data[:20])
    assert "its header alone says" in str(safetensors_problem(path))


@pytest.mark.parametrize("where", ["gguf data", "gguf header", "hf safetensors", "hf config"])
def test_import_model_names_a_damaged_source_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    if where.startswith("gguf"):
        src = _gguf(tmp_path / "m.gguf")
        data = src.read_bytes()
        src.write_bytes(data[: len(data) // 3] if where == "gguf data" else data[:60])
        damaged = src
    else:
        from ppo_rollout.tasks import make_tiny_model

        src = make_tiny_model("copy", tmp_path / "src", seed=0)
        damaged = src / ("model.safetensors" if where == "hf safetensors" else "config.json")
        if where == "hf safetensors":
            damaged.write_bytes(damaged.read_bytes()[:5000])
        else:
            damaged.write_text('{"hidden_size": ')
    capsys.readouterr()  # the tiny model's own progress bars
    assert main(["import-model", str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    expected = "is not valid JSON" if where == "hf config" else "is truncated or damaged ("
    assert f"{damaged} {expected}" in err.replace("\n", "")
    assert not (tmp_path / "out").exists()
