"""The adapter's launch command against SGLang v0.5.17's flags, and a server that exits during start-up."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
            dtype="bfloat16",
            weights_cpu_backup=True,
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


def test_the_server_holds_the_weights_in_the_dtype_the_actor_sends() -> None:
    """A real 0.5.17 server given ``--dtype auto`` served a float32 checkpoint in float16, and its weights
    read back after a bfloat16 update differed from the actor's: the engine pool names the dtype."""
    from ppo_rollout.config import RolloutConfig
    from ppo_rollout.engine_pool import sglang_spec_args

    argv = SGLangServerSpec(model_path="/m", port=1, dtype="bfloat16").argv()
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert "--dtype" not in SGLangServerSpec(model_path="/m", port=1).argv()
    mine = SGLangServerSpec(model_path="/m", port=1, dtype="bfloat16", extra_args=("--dtype", "float16"))
    assert mine.argv().count("--dtype") == 1
    for dtype in ("bfloat16", "float32"):
        config = RolloutConfig(
            engine="sglang", model_path="/m", device="cuda", dtype=dtype, gpus_per_engine=1
        )
        assert sglang_spec_args(config, 0, None)["dtype"] == dtype


@dataclass(frozen=True)
class _SharedGpu:
    """Slots on one GPU shared with training (what placement hands a colocated engine)."""

    placement_group: Any = None
    bundle_indices: tuple[int, ...] = (0,)
    gpu_ids: tuple[int, ...] = (0,)
    gpu_share: float = 0.5


def test_a_released_server_keeps_its_weights_where_no_whole_update_follows_a_resume() -> None:
    """A real 0.5.17 server resumed released weights as zeros (and generated from them): the host copy
    is on where a resume is not followed by whole weights (adapter-only updates), off otherwise, and
    the setting wins."""
    from ppo_rollout.config import RolloutConfig, SGLangOptions
    from ppo_rollout.engine_pool import sglang_spec_args

    lora = AdapterUpdates(rank=4, alpha=8.0, target_modules=("q_proj",))
    base = {
        "engine": "sglang",
        "model_path": "/m",
        "device": "cuda",
        "dtype": "bfloat16",
        "gpus_per_engine": 1,
    }

    def backup(shared: bool = True, **kw: Any) -> bool:
        args = sglang_spec_args(RolloutConfig(**base, **kw), 0, _SharedGpu() if shared else None)
        return bool(args["weights_cpu_backup"])

    assert not backup()  # whole weights follow every resume
    assert backup(lora=lora)  # adapter-only updates never send the base again
    assert not backup(shared=False, lora=lora)  # a server alone on its GPUs never releases
    assert backup(sglang=SGLangOptions(weights_cpu_backup=True))
    assert not backup(lora=lora, sglang=SGLangOptions(weights_cpu_backup=False))
    argv = SGLangServerSpec(model_path="/m", port=1, weights_cpu_backup=True).argv()
    assert "--enable-weights-cpu-backup" in argv


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
