"""What the content hashes of a checkpoint cost: seconds per GB to complete a checkpoint (fsync and
SHA-256 of every file) against fsync alone, and to verify one on resume (sizes, JSON, SHA-256).

Writes a checkpoint of ``--files`` tensor files of ``--mb`` MB each (random bytes, a model's and its
optimizer's files) under ``--dir`` (default: a temporary folder; point it at the disk the checkpoints
go to), completes it with ``PendingCheckpoint.finish``, then verifies it with ``checkpoint.verify``.
The files are in the page cache, as right after a save; a resume after a reboot also reads them from
disk. Prints one JSON line.

    python packages/ppo_driver/benchmarks/checkpoint_hash.py --mb 512 --files 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from ppo_driver import checkpoint


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _write_files(folder: Path, files: int, mb: int) -> int:
    chunk = os.urandom(1 << 20)
    for i in range(files):
        with (folder / f"tensor{i}.safetensors").open("wb") as f:
            for _ in range(mb):
                f.write(chunk)
    (folder / "driver.json").write_text(json.dumps({"step": 1}))
    return files * mb * (1 << 20)


def _fsync_only(folder: Path) -> float:
    t0 = time.perf_counter()
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    return time.perf_counter() - t0


def _sha256_in_memory_s_per_gb() -> float:
    """SHA-256 of bytes already in memory: the CPU's own rate, the floor for the two above (and a
    gauge of how loaded the machine was while the others ran)."""
    data = os.urandom(256 << 20)
    t0 = time.perf_counter()
    hashlib.sha256(data).digest()
    return (time.perf_counter() - t0) / (len(data) / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=int, default=256, help="MB per file")
    parser.add_argument("--files", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        pending = checkpoint.PendingCheckpoint(root, 1)
        nbytes = _write_files(pending.tmp, args.files, args.mb)
        fsync_s = _fsync_only(pending.tmp)  # what finish did before the hashes (files already synced)
        t0 = time.perf_counter()
        final = pending.finish()
        finish_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        checkpoint.verify(final)
        verify_s = time.perf_counter() - t0
    gb = nbytes / 1e9
    print(
        json.dumps(
            {
                "cpu": _cpu(),
                "cpus": os.cpu_count(),
                "gb": round(gb, 3),
                "files": args.files,
                "finish_s_per_gb": round(finish_s / gb, 3),
                "fsync_only_s_per_gb": round(fsync_s / gb, 3),
                "verify_s_per_gb": round(verify_s / gb, 3),
                "sha256_in_memory_s_per_gb": round(_sha256_in_memory_s_per_gb(), 3),
                "load_average_1min": round(os.getloadavg()[0], 1),
            }
        )
    )


if __name__ == "__main__":
    main()
