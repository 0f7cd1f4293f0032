"""The control path of ``WeightSender.update()`` on a CPU: round trips per update and where the ms go.

An engine process on 127.0.0.1 (a ``TensorEngine`` behind the test HTTP server: our own routes, or the
SGLang stand-in of ``--sglang`` versions), a gloo group, small weights, so that the control calls (pause,
flush, session, the metadata call, continue) and the non-finite scan are most of each update. Per update:
the HTTP requests the endpoint made (counted on the client: every operation's request, flush retries
included), the whole ``update()`` in ms and its split from the sender's metrics (``weight_sync/*_seconds``;
missing on revisions without them: shown as nan), and one kept-alive HTTP round trip to the same server.
Medians over ``--updates`` after a warm-up.

    python packages/weight_sync/benchmarks/bench_control.py [--updates 40]
    # another revision's sender and engine, same script:
    PYTHONPATH=/path/to/other/packages/weight_sync/src python packages/weight_sync/benchmarks/bench_control.py
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import threading
import time
from typing import Any

import torch

import ppo_weight_sync
from ppo_weight_sync import HttpEngineEndpoint, WeightSender
from ppo_weight_sync.endpoints import RECEIVER_LOAD_FORMATS
from ppo_weight_sync.ops import EngineReply
from ppo_weight_sync.testing import llama_like_spec, make_weights
from ppo_weight_sync.testing.http_engine import start_process

MODELS = {
    "tiny fp32": llama_like_spec(layers=2, hidden=64, intermediate=128, vocab=16, dtype="float32"),
    "small bf16": llama_like_spec(layers=4, hidden=512, intermediate=1408, vocab=4000, dtype="bfloat16"),
}
PARTS = [
    ("scan", "check_seconds"),
    ("control before", "control_before_seconds"),
    ("transfer", "seconds"),
    ("control after", "control_after_seconds"),
    ("control", "control_seconds"),  # before + after; the one split older revisions report too
]


class CountingEndpoint(HttpEngineEndpoint):
    """An HTTP endpoint that counts the requests it makes (every operation goes through ``call``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._count = 0
        self._count_lock = threading.Lock()

    def call(self, method: str, route: str, body: dict[str, Any] | None = None) -> EngineReply:
        with self._count_lock:
            self._count += 1
        return super().call(method, route, body)

    def made(self) -> int:
        with self._count_lock:
            return self._count


def measure(endpoint: CountingEndpoint, spec: dict[str, Any], updates: int) -> dict[str, float]:
    sender = WeightSender(backend="gloo", bucket_bytes=4 << 20, timeout_s=60)
    sender.connect([endpoint])
    try:
        weights = list(make_weights(spec, seed=1).items())
        for i in range(3):  # warm-up: connections, staging buffers, the engine's first load
            sender.update(weights, f"warm-{i}")
        sender.pop_metrics()
        walls, requests, splits = [], [], []
        for i in range(updates):
            before = endpoint.made()
            t0 = time.perf_counter()
            sender.update(weights, f"v{i}")
            walls.append(time.perf_counter() - t0)
            requests.append(endpoint.made() - before)
            splits.append(sender.pop_metrics())
        trips = []
        for _ in range(updates):
            t0 = time.perf_counter()
            endpoint.get_weight_version().result(30)
            trips.append(time.perf_counter() - t0)
    finally:
        sender.disconnect()
    out = {
        "requests": statistics.median(requests),
        "update": statistics.median(walls) * 1e3,
        "round trip": statistics.median(trips) * 1e3,
    }
    for label, key in PARTS:
        values = [m.get(f"weight_sync/{key}", math.nan) for m in splits]
        out[label] = statistics.median(values) * 1e3
    # the rest of the update: argument checks and the lock (and the scan, where it is not reported)
    others = [
        w
        - m["weight_sync/seconds"]
        - m["weight_sync/control_seconds"]
        - m.get("weight_sync/check_seconds", 0.0)
        for w, m in zip(walls, splits, strict=True)
    ]
    out["other"] = statistics.median(others) * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--sglang", nargs="*", default=["0.5.23"], help="SGLang stand-in versions to add")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"ppo_weight_sync from {os.path.dirname(ppo_weight_sync.__file__)}; torch {torch.__version__}; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    header = ["engine", "model", "requests / update", "update ms", *(f"{p} ms" for p, _ in PARTS), "other ms"]
    print("| " + " | ".join([*header, "HTTP round trip ms"]) + " |")
    print("|---|---|" + "---:|" * (len(header) - 1))  # the last column: the round trip
    engines: list[tuple[str, str | None]] = [("ours (stream)", None)]
    engines += [(f"SGLang {v} stand-in (flattened_bucket)", v) for v in args.sglang]
    for label, version in engines:
        for model, spec in MODELS.items():
            proc, url = start_process(spec, seed=0, timeout_s=180, sglang_version=version)
            try:
                if version is None:
                    endpoint = CountingEndpoint(
                        url, name="engine", timeout_s=60, load_formats=RECEIVER_LOAD_FORMATS
                    )
                else:
                    probe = HttpEngineEndpoint.for_sglang(url, timeout_s=60)
                    endpoint = CountingEndpoint(
                        url, 1, 60, "engine", ("flattened_bucket",), sglang=probe.sglang
                    )
                    probe.close()
                row = measure(endpoint, spec, args.updates)
                endpoint.close()
            finally:
                proc.kill()
                proc.wait(30)
            cells = [f"{row['requests']:.0f}", f"{row['update']:.2f}"]
            cells += [f"{row[p]:.2f}" for p in [*(p for p, _ in PARTS), "other"]]
            print(
                f"| {label} | {model} | " + " | ".join([*cells, f"{row['round trip']:.2f}"]) + " |",
                flush=True,
            )


if __name__ == "__main__":
    main()
