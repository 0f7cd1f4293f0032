"""The settings, tasks and rewards load without torch, transformers or Ray: the driver's config
(``ppo-driver validate``) imports them, and checking a config should not pay for a model's stack."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers", "ray")


def test_the_settings_modules_import_without_torch() -> None:
    code = (
        "import sys; import ppo_rollout.config, ppo_rollout.tasks, ppo_rollout.rewards, ppo_rollout.data; "
        f"print([m for m in {HEAVY!r} if m in sys.modules])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout
