"""The trainer's layering: it imports nothing of the rollout, and the checkpoint code reads a torch
trainer through ``checkpoint.protocol.TorchCheckpointable``, never through ``backend.TorchTrainer``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]


def _imported(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (functions and ``TYPE_CHECKING`` blocks too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and not node.level:
            found.add(node.module)
    return found


def test_the_trainer_imports_nothing_of_the_rollout_outside_its_tests() -> None:
    files = [*(PACKAGE / "src").rglob("*.py"), *(PACKAGE / "benchmarks").rglob("*.py")]
    assert len(files) > 40
    offending = {
        str(f.relative_to(PACKAGE)): sorted(m for m in _imported(f) if m.split(".")[0] == "ppo_rollout")
        for f in files
    }
    assert {f: m for f, m in offending.items() if m} == {}


def test_the_checkpoint_code_runs_without_the_torch_backend_module() -> None:
    code = (
        "import sys\n"
        "from ppo_trainer.checkpoint import megatron_io, saves, sharded, torch_io\n"
        "backends = ('ppo_trainer.backend', 'ppo_trainer.megatron_backend')\n"
        "print(sorted(m for m in sys.modules if m in backends))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"
    for name in ("torch_io", "sharded", "saves"):
        imported = _imported(PACKAGE / "src" / "ppo_trainer" / "checkpoint" / f"{name}.py")
        assert "ppo_trainer.backend" not in imported, name
