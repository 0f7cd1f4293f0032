"""Test setup shared by the placement tests."""

from __future__ import annotations

import os

# Under `uv run`, Ray starts every worker through `uv run` again and ships the working tree to it;
# the tests need neither, and worker start-up is the slow part of a placement test. Set before
# anything imports Ray, which reads it once.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
