"""A real browser for the whole-system tests: Debian's headless Chromium (``/usr/bin/chromium``) opens a
page from disk, and what the page wrote to its console (``console.error``, uncaught exceptions,
resources that failed to load) comes back with the DOM as the browser parsed it and a screenshot.

Chromium logs each console message to stderr with ``--enable-logging=stderr`` as
``[...:INFO:CONSOLE:<line>] "<message>", source: <url> (<line>)``; every other line there (D-Bus, GPU
probing) is the browser's own and ignored. Where Chromium is missing the test skips, unless
``PPO_REQUIRE_CHROMIUM=1`` (``.ci/run`` sets it and installs the browser): then it fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
REQUIRE_ENV = "PPO_REQUIRE_CHROMIUM"
# No network, no first-run work, no sandbox (CI runs as root, where Chromium refuses its sandbox).
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--mute-audio",
    "--hide-scrollbars",
    "--enable-logging=stderr",
    "--v=0",
)
CONSOLE = re.compile(r":CONSOLE(?::\d+|\(\d+\))\] (.*)$", re.MULTILINE)


def chromium() -> str:
    """The browser's path; skips the test without one, fails it where ``PPO_REQUIRE_CHROMIUM=1``."""
    found = CHROMIUM if Path(CHROMIUM).is_file() else shutil.which("chromium")
    if found is not None:
        return found
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(
            f"{CHROMIUM} is missing and {REQUIRE_ENV}=1: install it with `apt-get install -y "
            "--no-install-recommends chromium` (.ci/run does so when it runs as root)"
        )
    pytest.skip(f"needs Chromium at {CHROMIUM} (Debian: apt-get install -y chromium)")


@dataclass(frozen=True)
class Opened:
    """A page as the browser saw it: its DOM, its console messages, a screenshot of ``size``."""

    dom: str
    console: list[str]
    screenshot: Path
    size: tuple[int, int]


def _run(browser: str, args: list[str], profile: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [browser, *FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"chromium exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done


def open_page(page: Path, work: Path, size: tuple[int, int] = (1240, 1800), timeout: float = 120) -> Opened:
    """Open ``page`` (a file) in a fresh profile under ``work``: its DOM, its console messages and a
    screenshot of the window's ``size``, from one launch."""
    png = work / f"{page.stem}.png"
    done = _run(
        chromium(),
        [f"--window-size={size[0]},{size[1]}", f"--screenshot={png}", "--dump-dom", page.resolve().as_uri()],
        work / f"profile-{page.stem}",
        timeout,
    )
    assert png.is_file(), f"no screenshot written:\n{done.stderr[-3000:]}"
    return Opened(dom=done.stdout, console=CONSOLE.findall(done.stderr), screenshot=png, size=size)
