"""A real vLLM CPU server for the tests: its environment built once (``vllm_env.py``), one server shared
by the tests of the engine, started through the adapter (``ppo_rollout.engine.vllm_server``).

Under CI (``CI=true``) an environment that cannot be built fails the tests; elsewhere it skips them.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import vllm_env  # beside this file

from ppo_rollout.engine.vllm_server import VLLMServer, VLLMServerSpec
from ppo_rollout.tasks import make_tiny_model
from ppo_weight_sync import free_port

TIMINGS: dict[str, float] = {}


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"the vLLM CPU environment is needed under CI: {reason}", pytrace=False)
    pytest.skip(f"no vLLM CPU environment: {reason}")


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The Python of the vLLM environment (built here on the first use of this CI run)."""
    try:
        python, seconds = vllm_env.ensure()
    except vllm_env.VLLMEnvError as exc:
        _unavailable(str(exc))
        raise
    TIMINGS["vllm environment build"] = seconds
    return python


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny Llama with two heads of 32 (vLLM's CPU attention takes no head size of 16)."""
    return make_tiny_model("copy_small", tmp_path_factory.mktemp("tiny"), seed=0, num_heads=2)


@pytest.fixture(scope="session")
def vllm_server(
    vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VLLMServer]:
    spec = VLLMServerSpec(
        model_path=str(tiny_model),
        port=free_port("127.0.0.1"),
        python=str(vllm_python),
        dtype="float32",
        extra_args=("--kv-cache-memory-bytes", str(64 << 20)),
    )
    server = VLLMServer(spec, startup_timeout_s=420, log_path=tmp_path_factory.mktemp("vllm") / "server.log")
    started = time.monotonic()
    server.start()
    TIMINGS["vllm server start"] = time.monotonic() - started
    try:
        yield server
    finally:
        server.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TIMINGS:
        parts = ", ".join(f"{k}: {v:.0f} s" for k, v in TIMINGS.items())
        terminalreporter.write_line(f"vLLM timings: {parts}")
