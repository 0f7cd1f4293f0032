"""Pre-flight checks: what `validate` and `train` find without Ray or a GPU, each naming the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppo_driver import preflight
from ppo_driver.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[3]


def _check(*overrides: str, run_dir: Path | None = None) -> None:
    preflight.check(load_config(None, list(overrides)), run_dir=run_dir)


def test_default_config_passes(tmp_path: Path) -> None:
    _check(run_dir=tmp_path / "run")


def test_reward_import_and_function(tmp_path: Path) -> None:
    _check("rollout.reward=json:dumps")
    with pytest.raises(ConfigError, match=r"rollout.reward='no_mod_q:f': module 'no_mod_q' does not import"):
        _check("rollout.reward=no_mod_q:f")
    with pytest.raises(ConfigError, match=r"module 'json' has no 'nope'"):
        _check("rollout.reward=json:nope")
    with pytest.raises(ConfigError, match=r"'__doc__' in 'json' is a str, not a function"):
        _check("rollout.reward=json:__doc__")


def test_model_path(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"model.path='/no/model' does not exist \(no folder /no/model\); make it"
    ):
        _check("model.path=/no/model")
    with pytest.raises(ConfigError, match=r"hf download someorg/nomodel-xyz --local-dir DIR"):
        _check("model.path=someorg/nomodel-xyz")
    (tmp_path / "m").mkdir()
    with pytest.raises(ConfigError, match=r"a folder without config.json"):
        _check(f"model.path={tmp_path / 'm'}")
    (tmp_path / "m" / "config.json").write_text("{}")
    _check(f"model.path={tmp_path / 'm'}")


def test_dataset(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    base = ["rollout.task=null", f"model.path={tmp_path / 'm'}", "rollout.reward=exact_match"]
    data = tmp_path / "d.jsonl"
    with pytest.raises(ConfigError, match=r"rollout.dataset=.* does not exist"):
        _check(*base, f"rollout.dataset={data}")
    data.write_text("")
    with pytest.raises(ConfigError, match=r"is empty"):
        _check(*base, f"rollout.dataset={data}")
    data.write_text('{"text": "a"}\n')
    with pytest.raises(
        ConfigError,
        match=r"d.jsonl:1: field 'prompt' must be a string \(set rollout.prompt_field .*\['text'\]",
    ):
        _check(*base, f"rollout.dataset={data}")
    data.write_text('{"prompt": "a"}\n[1]\n')
    with pytest.raises(ConfigError, match=r"d.jsonl:2: a list, not a JSON object"):
        _check(*base, f"rollout.dataset={data}")
    data.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    _check(*base, f"rollout.dataset={data}")
    with pytest.raises(ConfigError, match=r"rollout.reward is required with rollout.dataset"):
        _check(*base[:2], f"rollout.dataset={data}")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_run_folder(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match=r"--run-dir / logging.run_dir: .* cannot be created"):
        _check(run_dir=locked / "run")


def test_run_folder_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"is a file, so the folder .* cannot be created"):
        _check(run_dir=tmp_path / "f" / "run")
    with pytest.raises(ConfigError, match=r"checkpoint.dir: "):
        _check(f"checkpoint.dir={tmp_path / 'f' / 'ck'}", run_dir=tmp_path / "run")


def test_duplicate_yaml_keys_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 3\nrollout:\n  task: copy_small\ntrain:\n  seed: 1\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'train' at line 5 \(first at line 1\)"):
        preflight.check_yaml_file(path)
    path.write_text("train:\n  steps: 3\n  steps: 4\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'steps' at line 3"):
        preflight.check_yaml_file(path)
    path.write_text("train:\n  steps: 3\n")
    preflight.check_yaml_file(path)


def test_validate_imports_neither_torch_nor_transformers() -> None:
    # What keeps `ppo-driver validate` to about a second on a loaded machine.
    code = (
        "import sys\nfrom ppo_driver.cli import main\n"
        f"assert main(['validate', {str(REPO / 'configs' / 'cpu-default.yaml')!r}]) == 0\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules)\n"
        "print('heavy:', heavy)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "heavy: []" in done.stdout


def test_megatron_backend_rules(tmp_path: Path) -> None:
    """train.backend='megatron': CUDA, Python >= 3.12 with megatron-core, tensor_parallel dividing each
    role's GPUs and the model's heads; all reported at once, with the field to change."""
    with pytest.raises(ConfigError) as info:
        _check("train.backend=megatron", "train.tensor_parallel=2")
    text = str(info.value)
    assert "train.backend='megatron' needs placement.device='cuda' (got 'cpu')" in text
    assert "train.tensor_parallel=2 must divide placement.actor_gpus=1" in text
    if sys.version_info < (3, 12):
        assert "needs Python >= 3.12 (megatron-core 0.19)" in text
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        '{"model_type": "llama", "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 64}'
    )
    with pytest.raises(ConfigError) as info:
        _check("train.backend=megatron", "train.tensor_parallel=2", f"model.path={model}")
    text = str(info.value)
    assert "train.tensor_parallel=2 must divide the model's num_key_value_heads=3" in text
    assert "num_attention_heads" not in text
    # The torch backend has no tensor parallelism: the config itself refuses the combination.
    with pytest.raises(ConfigError, match=r"train.tensor_parallel=2 needs train.backend='megatron'"):
        _check("train.tensor_parallel=2")


# --- what a user meets in the first hour ---------------------------------------------------------

CHAT = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def _chat_model(folder: Path) -> Path:
    """The tiny model's folder with a chat template in its tokenizer."""
    from transformers import AutoTokenizer

    from ppo_rollout.tasks import make_tiny_model

    make_tiny_model("copy", folder, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT
    tokenizer.save_pretrained(folder)
    return folder


def _chat_rows(path: Path, n: int = 6) -> Path:
    rows = [{"prompt": [{"role": "user", "content": f"{i}{i}"}], "label": f"{i}{i}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_chat_dataset_passes_with_chat_template(tmp_path: Path) -> None:
    """A prompt field holding a list of {role, content} messages, with rollout.chat_template=true."""
    model = _chat_model(tmp_path / "m")
    data = _chat_rows(tmp_path / "chat.jsonl")
    base = [
        "rollout.task=null",
        f"model.path={model}",
        "rollout.reward=exact_match",
        f"rollout.dataset={data}",
    ]
    _check(*base, "rollout.chat_template=true")
    report = preflight.check_dataset(load_config(None, [*base, "rollout.chat_template=true"]))
    assert report is not None
    assert report.startswith("6 prompts")
    with pytest.raises(ConfigError, match=r"a list of messages needs rollout.chat_template=true"):
        _check(*base)


def test_a_damaged_model_folder_is_named_under_model_path(tmp_path: Path) -> None:
    from ppo_rollout.tasks import make_tiny_model

    model = make_tiny_model("copy", tmp_path / "m", seed=0)
    _check(f"model.path={model}")
    weights = model / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ConfigError) as info:
        _check(f"model.path={model}")
    text = str(info.value)
    assert (
        f"model.path='{model}': {weights} is truncated or damaged ({len(whole) // 2} of {len(whole)} bytes)"
        in text
    )
    assert len(text.splitlines()) == 2  # the heading and one line
    weights.write_bytes(whole)
    (model / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ConfigError, match=r"model.path=.*config.json is not valid JSON"):
        _check(f"model.path={model}")
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"model.path=.*: the folder has no tokenizer \(tokenizer.json"):
        _check(f"model.path={model}")


def test_a_missing_local_model_path_says_how_to_make_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(ConfigError) as info:
        _check("model.path=models/smollm2-135m-instruct")
    text = str(info.value)
    assert "`ppo-driver import-model SRC models/smollm2-135m-instruct`" in text
    assert "hf download" not in text
    with pytest.raises(ConfigError, match=r"hf download someorg/nomodel-xyz"):  # no such local folder
        _check("model.path=someorg/nomodel-xyz")


def test_paths_starting_with_a_tilde_are_the_home_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "d.jsonl").write_text('{"prompt": "1"}\n')
    (tmp_path / "e.jsonl").write_text('{"prompt": "2"}\n')
    sets = [
        "rollout.task=null",
        "model.path=~/m",
        "rollout.reward=exact_match",
        "rollout.dataset=~/d.jsonl",
        "rollout.eval_dataset=~/e.jsonl",
        "logging.run_dir=~/runs/x",
        "checkpoint.dir=~/ck",
    ]
    config = load_config(None, sets)
    assert config.rollout.dataset == str(tmp_path / "d.jsonl")
    assert config.rollout.eval_dataset == str(tmp_path / "e.jsonl")
    assert config.logging.run_dir == str(tmp_path / "runs" / "x")
    assert config.checkpoint.dir == str(tmp_path / "ck")
    assert config.model.path == str(tmp_path / "m")
    preflight.check(config, run_dir=Path(config.logging.run_dir))


def test_an_eval_file_sharing_prompts_with_the_training_file_is_counted(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    train = tmp_path / "t.jsonl"
    train.write_text("".join(json.dumps({"prompt": str(i)}) + "\n" for i in range(10)))
    held = tmp_path / "e.jsonl"
    held.write_text("".join(json.dumps({"prompt": str(i)}) + "\n" for i in range(7, 13)))
    base = ["rollout.task=null", f"model.path={tmp_path / 'm'}", "rollout.reward=exact_match"]
    config = load_config(None, [*base, f"rollout.dataset={train}", f"rollout.eval_dataset={held}"])
    assert preflight.check(config) == [
        f"rollout.eval_dataset: 3 of the 6 evaluation prompts are also in rollout.dataset ({train}), so "
        "the evaluation is not held out; remove them from one of the two files"
    ]
    config = load_config(None, [*base, f"rollout.dataset={train}", f"rollout.eval_dataset={train}"])
    assert "10 of the 10 evaluation prompts" in preflight.check(config)[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1]\n")
    with pytest.raises(ConfigError, match=r"rollout.eval_dataset=.*bad.jsonl:1: a list"):
        _check(*base, f"rollout.dataset={train}", f"rollout.eval_dataset={bad}")


def test_a_local_cuda_run_counts_its_gpus_before_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(REPO / "configs" / "2gpu-disaggregate.yaml")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match=r"placement needs 2 GPUs but CUDA_VISIBLE_DEVICES shows 0; set "):
        preflight.check_devices(config)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    preflight.check_devices(config)
    preflight.check_devices(load_config(REPO / "configs" / "2gpu-disaggregate.yaml", ["ray.address=auto"]))


def test_the_object_store_floor_is_rays() -> None:
    with pytest.raises(
        ConfigError, match=r"ray.object_store_memory_mb: Input should be greater than or equal to 75"
    ):
        load_config(None, ["ray.object_store_memory_mb=64"])
    load_config(None, ["ray.object_store_memory_mb=75"])


def test_a_ray_address_where_nothing_listens_is_refused_at_once() -> None:
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens
    config = load_config(None, [f"ray.address=127.0.0.1:{port}"])
    start = time.monotonic()
    with pytest.raises(
        ConfigError,
        match=rf"ray.address='127.0.0.1:{port}': nothing answers at 127.0.0.1:{port} \(Connection refused",
    ):
        preflight.check_ray_address(config)
    assert time.monotonic() - start < 5
    with socket.socket() as server:  # listens, accepts, says nothing: not Ray's GCS
        server.bind(("127.0.0.1", 0))
        server.listen()
        silent = server.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(
            ConfigError,
            match=rf"ray.address='ray://127.0.0.1:{silent}': something listens at 127.0.0.1:{silent} but "
            r"does not answer as Ray's GCS \(a gRPC server\) within 1 s",
        ):
            preflight.check_ray_address(load_config(None, [f"ray.address=ray://127.0.0.1:{silent}"]), 1.0)
        assert time.monotonic() - start < 3


def test_a_ray_address_answering_http2_passes_and_http1_does_not() -> None:
    """A server that answers the HTTP/2 preface with its SETTINGS frame, as every gRPC server (Ray's
    GCS among them, checked against a real cluster by tests-e2e/test_multinode.py) does, passes."""
    import contextlib
    import socket
    import threading

    def serve(server: socket.socket, reply: bytes) -> None:
        conn, _ = server.accept()
        with conn, contextlib.suppress(OSError):  # the check closes its end once it has read
            conn.recv(64)
            conn.sendall(reply)
            conn.recv(64)

    settings = bytes([0, 0, 6, 4, 0, 0, 0, 0, 0]) + bytes([0, 3, 0, 0, 0, 100])  # MAX_CONCURRENT_STREAMS
    for reply, passes in ((settings, True), (b"HTTP/1.1 400 Bad Request\r\n\r\n", False)):
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            threading.Thread(target=serve, args=(server, reply), daemon=True).start()
            config = load_config(None, [f"ray.address=127.0.0.1:{server.getsockname()[1]}"])
            if passes:
                preflight.check_ray_address(config, 2.0)
            else:
                with pytest.raises(ConfigError, match="does not answer as Ray's GCS"):
                    preflight.check_ray_address(config, 2.0)
