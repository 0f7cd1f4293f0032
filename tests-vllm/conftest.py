"""A real vLLM CPU server for the tests: its environment built once (``vllm_env.py``), one server shared
by the tests of the engine, started through the adapter (``ppo_rollout.engine.vllm_server``).

The two-step ``ppo-driver train`` of ``test_vllm_train.py`` launches a server of its own. It starts in
the background before the first test (``vllm_run``), and the engine tests run meanwhile: a vLLM
server's start keeps about one core of two busy (27 CPU-s in 28 s), so the two starts overlap instead
of following each other; the run's test then waits for it.

Under CI (``CI=true``) an environment that cannot be built fails the tests; elsewhere it skips them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
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


# The two-step run of test_vllm_train.py: the tiny model's two heads of 32 (head size 32: vLLM's CPU
# attention takes no 16), every weight update read back from the server (train.check_weights).
RUN_STEPS = 2
RUN_TIMEOUT_S = 840


@dataclass
class BackgroundRun:
    """A ``ppo-driver train`` process started in the background; ``wait`` gives its exit code and output."""

    proc: subprocess.Popen[bytes]
    run_dir: Path
    output: Path
    started: float

    def wait(self) -> tuple[int, str]:
        code = self.proc.wait(timeout=max(1.0, RUN_TIMEOUT_S - (time.monotonic() - self.started)))
        TIMINGS.setdefault("two-step run (alongside the engine tests)", time.monotonic() - self.started)
        return code, self.output.read_text()


def run_overrides(vllm_python: Path) -> list[str]:
    return [
        "rollout.engine=vllm",
        f"rollout.vllm.python={vllm_python}",
        "rollout.vllm.kv_cache_memory_bytes=67108864",
        "model.tiny.num_heads=2",
        f"train.steps={RUN_STEPS}",
        "rollout.prompts_per_step=8",
        "rollout.sampling.n_samples_per_prompt=4",
        "rollout.eval_prompts=4",
        "train.check_weights=true",
        "logging.progress=false",
        "logging.tensorboard=false",
    ]


@pytest.fixture(scope="session", autouse=True)
def _the_run_starts_first(request: pytest.FixtureRequest) -> None:
    """Starts ``vllm_run`` before the first test, when a selected test waits for it."""
    if any("vllm_run" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("vllm_run")


@pytest.fixture(scope="session")
def vllm_run(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundRun]:
    """The run of test_vllm_train.py in the background; still going at the end, it is stopped with two
    SIGINTs (the driver's second stops it at once and ends what it started)."""
    folder = tmp_path_factory.mktemp("vllm_run")
    driver = Path(sys.executable).with_name("ppo-driver")
    args = [str(driver), "train", "--run-dir", "run"]
    for override in run_overrides(vllm_python):
        args += ["--set", override]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    output = folder / "output.txt"
    with output.open("wb") as out:  # a file, not a pipe: nothing reads it until the run is over
        proc = subprocess.Popen(args, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT)
    run = BackgroundRun(proc, folder / "run", output, time.monotonic())
    try:
        yield run
    finally:
        if proc.poll() is None:
            for _ in range(2):
                proc.send_signal(signal.SIGINT)
                time.sleep(0.2)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()  # its reaper ends the rest
                proc.wait()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TIMINGS:
        parts = ", ".join(f"{k}: {v:.0f} s" for k, v in TIMINGS.items())
        terminalreporter.write_line(f"vLLM timings: {parts}")
