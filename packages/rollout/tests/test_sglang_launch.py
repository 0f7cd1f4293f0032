"""The adapter's launch command against SGLang v0.5.17's flags, and a server that exits during start-up."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ppo_rollout.config import AdapterUpdates
from ppo_rollout.engine.sglang import SGLangError, SGLangServer, SGLangServerSpec
from ppo_weight_sync import free_port

FLAGS_FILE = Path(__file__).parent / "fixtures" / "sglang-0.5.17" / "server_args_flags.txt"


def _flags() -> set[str]:
    lines = FLAGS_FILE.read_text().splitlines()
    return {line for line in lines if line.startswith("--")}


def _argv_flags(spec: SGLangServerSpec) -> list[str]:
    return [a for a in spec.argv()[len(spec.command) :] if a.startswith("--")]


@pytest.mark.parametrize(
    "spec",
    [
        SGLangServerSpec(model_path="/m", port=30000),
        SGLangServerSpec(
            model_path="/m",
            port=30000,
            tp_size=2,
            base_gpu_id=2,
            enable_memory_saver=True,
            mem_fraction_static=0.6,
            random_seed=7,
            lora=AdapterUpdates(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj")),
        ),
    ],
    ids=["plain", "shared-gpu-lora"],
)
def test_every_flag_the_adapter_passes_is_one_sglang_0_5_17_defines(spec: SGLangServerSpec) -> None:
    known = _flags()
    assert len(known) > 400  # the whole parser was read, not a fragment
    unknown = [f for f in _argv_flags(spec) if f not in known]
    assert not unknown, f"flags SGLang 0.5.17's server_args.py does not define: {unknown}"


def test_the_defaults_pick_backends_a_slim_sglang_has() -> None:
    argv = SGLangServerSpec(model_path="/m", port=30000).argv()
    # deterministic mode would fall back to fa3 on Hopper, which a slim install leaves out
    assert argv[argv.index("--attention-backend") + 1] == "triton"
    assert argv[argv.index("--sampling-backend") + 1] == "pytorch"
    assert "--enable-deterministic-inference" in argv
    assert "--enable-memory-saver" not in argv  # only when sharing GPUs with training
    shared = SGLangServerSpec(model_path="/m", port=30000, enable_memory_saver=True).argv()
    assert "--enable-memory-saver" in shared
    # a backend in extra_args is the only one passed; None leaves the choice to SGLang
    mine = SGLangServerSpec(model_path="/m", port=1, extra_args=("--attention-backend", "fa3")).argv()
    assert mine.count("--attention-backend") == 1
    assert mine[mine.index("--attention-backend") + 1] == "fa3"
    assert (
        "--attention-backend" not in SGLangServerSpec(model_path="/m", port=1, attention_backend=None).argv()
    )


def test_a_server_that_exits_during_start_up_is_one_error_with_its_code_and_last_lines(
    tmp_path: Path,
) -> None:
    # A real process that writes its log and exits with 3 before serving anything (the adapter's
    # arguments follow the script, as they follow sglang.launch_server).
    script = "import sys\nfor i in range(40): print(f'server line {i}')\nsys.exit(3)\n"
    spec = SGLangServerSpec(model_path="/m", port=free_port(), command=(sys.executable, "-c", script))
    server = SGLangServer(spec, startup_timeout_s=60, log_path=tmp_path / "server.log", name="dying")
    with pytest.raises(SGLangError) as caught:
        server.start()
    message = str(caught.value)
    assert message.startswith("SGLang server dying exited with code 3 before /health answered")
    assert str(tmp_path / "server.log") in message
    assert "server line 39" in message
    assert "server line 20" in message
    assert "server line 19" not in message  # the last 20 lines, not the whole log
    assert not server.is_running()
