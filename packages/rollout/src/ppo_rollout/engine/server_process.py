"""An inference server as a subprocess in its own process group: started, waited for until ``/health``
answers 200 (bounded, named, the log's last lines in the error), stopped with everything it started.

SGLang's and vLLM's servers (``engine/sglang.py``, ``engine/vllm_server.py``) are both this: they differ
in their command line, environment, error type and the setting that bounds their start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

__all__ = ["ServerProcess"]


class ServerProcess:
    """One server subprocess in its own process group. ``start()`` returns once ``/health`` answers 200.

    Subclasses name themselves (``KIND``, ``ERROR``, ``STARTUP_SETTING``) and give the command line and
    environment (:meth:`argv`, :meth:`environment`)."""

    KIND: ClassVar[str] = "server"  # as the errors name it: "SGLang server sglang@http://..."
    ERROR: ClassVar[type[Exception]] = RuntimeError  # a server that exited during its start
    STARTUP_SETTING: ClassVar[str] = ""  # the setting that bounds the start, named when it runs out
    POLL_S: ClassVar[float] = 0.5

    def __init__(
        self,
        url: str,
        *,
        startup_timeout_s: float = 600.0,
        stop_grace_s: float = 15.0,
        log_path: str | Path | None = None,
        name: str = "",
        log_prefix: str = "server-",
    ) -> None:
        self._url = url
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.name = name
        self.log_path = (
            Path(log_path) if log_path else Path(tempfile.mkstemp(prefix=log_prefix, suffix=".log")[1])
        )
        self._proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> Sequence[str]:
        raise NotImplementedError

    def environment(self) -> Mapping[str, str]:
        return dict(os.environ)

    @property
    def url(self) -> str:
        return self._url

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        if self.is_running():
            return
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                list(self.argv()),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(self.environment()),
                start_new_session=True,  # own process group: stop() reaches the server's children too
            )
        try:
            self.wait_healthy(self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise self.ERROR(
                    f"{self.KIND} {self.name} exited with code {self._proc.returncode} before /health "
                    f"answered; log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() >= deadline:
                setting = f" ({self.STARTUP_SETTING})" if self.STARTUP_SETTING else ""
                raise TimeoutError(
                    f"{self.KIND} {self.name} did not answer /health with 200 within {timeout_s:.0f} s"
                    f"{setting}; log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(self.POLL_S)

    def stop(self) -> int | None:
        """SIGTERM to the process group, SIGKILL after ``stop_grace_s``. Idempotent; returns the exit code."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        # The leader is gone; whatever it left in its group (schedulers, engine cores, workers) goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.returncode
