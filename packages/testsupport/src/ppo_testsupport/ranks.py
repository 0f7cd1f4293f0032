"""One process per rank: the launcher of the multi-process torch.distributed tests."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# The end of a failed rank's output kept in the error: enough for a traceback.
OUTPUT_TAIL = 3000


class RankFailure(AssertionError):
    """A rank exited non-zero or did not finish in time; the message names it and shows its output."""


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    script: Path,
    world: int,
    args: Callable[[int], Sequence[object]] = lambda rank: (),
    *,
    timeout_s: float = 150.0,
) -> list[str]:
    """Run ``python script RANK WORLD PORT *args(RANK)`` for every rank at once; their outputs, in rank order.

    ``PORT`` is a free port on 127.0.0.1 for the group's rendezvous (``tcp://127.0.0.1:PORT``). All
    ranks must exit 0 within ``timeout_s`` seconds in total; otherwise every rank still running is
    killed and ``RankFailure`` names the first rank that failed or hung, with the end of its output.
    """
    if world < 1:
        raise ValueError(f"world={world} must be >= 1")
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(world), str(port), *map(str, args(rank))],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    outputs: list[str] = []
    try:
        for rank, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                raise RankFailure(
                    f"rank {rank} of {script.name} (world {world}) did not finish within {timeout_s:g} s; "
                    f"its output:\n{out[-OUTPUT_TAIL:]}"
                ) from None
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, proc in enumerate(procs):
        if proc.returncode != 0:
            raise RankFailure(
                f"rank {rank} of {script.name} (world {world}) exited with {proc.returncode}; "
                f"its output:\n{outputs[rank][-OUTPUT_TAIL:]}"
            )
    return outputs
