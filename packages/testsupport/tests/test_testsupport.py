"""The launcher and the skip hook, on real processes and a real pytest run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppo_testsupport import RankFailure, free_port, run_ranks


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "rank.py"
    path.write_text("import sys, time\nrank, world, port = (int(a) for a in sys.argv[1:4])\n" + body)
    return path


def test_every_rank_gets_rank_world_port_and_its_args(tmp_path: Path) -> None:
    script = _script(tmp_path, "print(rank, world, port, *sys.argv[4:])\n")
    outs = run_ranks(script, 3, lambda r: [r * 10, "x"], timeout_s=60)
    fields = [out.split() for out in outs]
    assert [f[:2] for f in fields] == [["0", "3"], ["1", "3"], ["2", "3"]]
    assert len({f[2] for f in fields}) == 1  # one rendezvous port for all
    assert [f[3:] for f in fields] == [["0", "x"], ["10", "x"], ["20", "x"]]


def test_a_failing_rank_is_named_with_its_output(tmp_path: Path) -> None:
    script = _script(tmp_path, "if rank == 1:\n    raise SystemExit('rank one broke')\n")
    with pytest.raises(
        RankFailure, match=r"(?s)rank 1 of rank\.py \(world 2\) exited with 1.*rank one broke"
    ):
        run_ranks(script, 2, timeout_s=60)


def test_a_hung_rank_is_killed_within_the_timeout(tmp_path: Path) -> None:
    script = _script(tmp_path, "print('started', flush=True)\ntime.sleep(600 if rank == 0 else 0)\n")
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"(?s)rank 0 of rank\.py .* did not finish within 2 s.*started"):
        run_ranks(script, 2, timeout_s=2)
    assert time.monotonic() - t0 < 30


def test_free_port_can_be_bound() -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_gpu_tests_are_skipped_without_cuda(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "from ppo_testsupport import skip_gpu_tests_without_cuda\n"
        "pytest_collection_modifyitems = skip_gpu_tests_without_cuda('no CUDA here')\n"
    )
    (tmp_path / "test_x.py").write_text(
        "import pytest\n@pytest.mark.gpu\ndef test_gpu():\n    pass\ndef test_cpu():\n    pass\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-rs",
            "-p",
            "no:cacheprovider",
            "-o",
            "markers=gpu: x",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout
    cuda = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    if cuda == "True":
        assert "2 passed" in done.stdout
    else:
        assert "1 passed, 1 skipped" in done.stdout
        assert "no CUDA here" in done.stdout
