"""GPU memory over time, per process and for the whole device, from ``nvidia-smi``; then a summary.

    python benchmarks/sglang/gpu_memory.py sample OUT.csv &     # every 0.25 s until killed
    python benchmarks/sglang/gpu_memory.py summary OUT.csv      # what the SGLang server freed

Each row: seconds since the start, pid, the process's role (``sglang`` for a process of an SGLang server, else
``other``), its used MiB, and the device's used MiB. The summary gives the SGLang
server's largest and smallest footprint (its smallest is while it has released its memory for the
trainers), the share it freed, and the device's figures. Standard library only.
"""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from pathlib import Path

QUERY_APPS = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
QUERY_DEVICE = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def _parent(pid: int) -> int:
    # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces, so split after its ')'
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def role_of(pid: int) -> str:
    """``sglang`` for a process of an SGLang server: its command line, or an ancestor's, is
    ``sglang.launch_server`` or an ``sglang::`` process title (the scheduler that holds the GPU memory is
    a multiprocessing child of the server; a driver whose config file is named for SGLang is not)."""
    try:
        while pid > 1:
            line = _cmdline(pid)
            if "sglang.launch_server" in line or line.startswith("sglang::"):
                return "sglang"
            pid = _parent(pid)
    except (OSError, IndexError, ValueError):
        return "gone"
    return "other"


def read(command: list[str]) -> list[list[str]]:
    out = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False).stdout
    return [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.strip()]


def sample(path: Path, every_s: float = 0.25) -> None:
    start = time.monotonic()
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["t", "pid", "role", "used_mib", "device_used_mib"])
        while True:
            device = int(read(QUERY_DEVICE)[0][0])
            t = round(time.monotonic() - start, 2)
            for pid, used in read(QUERY_APPS):
                out.writerow([t, pid, role_of(int(pid)), used, device])
            f.flush()
            time.sleep(every_s)


def summary(path: Path) -> int:
    rows = list(csv.DictReader(path.open()))
    server = [int(r["used_mib"]) for r in rows if r["role"] == "sglang"]
    device = [int(r["device_used_mib"]) for r in rows]
    if not server:
        print(f"{path}: no SGLang process was seen ({len(rows)} rows)")
        return 1
    top, low = max(server), min(server)
    print(
        f"SGLang server: {top} MiB at most, {low} MiB at least (released): freed {top - low} MiB, "
        f"{(top - low) / top:.1%} of its largest footprint; device used {min(device)}-{max(device)} MiB "
        f"over {len({r['t'] for r in rows})} samples"
    )
    return 0


if __name__ == "__main__":
    what, file = sys.argv[1], Path(sys.argv[2])
    if what == "sample":
        sample(file)
    else:
        sys.exit(summary(file))
