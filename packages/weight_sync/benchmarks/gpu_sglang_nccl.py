"""NCCL between two processes on two GPUs, against SGLang's receiving side (testing.sglang_like) in each
supported version's mode: the trainer here on cuda:0, the engine process on the second GPU. Exits
non-zero when anything fails.

Run on a 2-GPU machine: ``python packages/weight_sync/benchmarks/gpu_sglang_nccl.py``.
"""

from __future__ import annotations

import sys
import time

import torch

from ppo_weight_sync import HttpEngineEndpoint, WeightSender, checksum
from ppo_weight_sync.testing import llama_like_spec, make_weights
from ppo_weight_sync.testing.http_engine import start_process

SPEC = {**llama_like_spec(layers=4, hidden=512, intermediate=1024, vocab=4096), "scale": ("float32", [3])}


def main() -> int:
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs", flush=True)
        return 1
    torch.cuda.set_device(0)
    failures = 0
    for version in ("0.5.15.post1", "0.5.23"):
        proc, url = start_process(
            SPEC,
            seed=1,
            device="cuda",
            timeout_s=240,
            env={"CUDA_VISIBLE_DEVICES": "1"},
            sglang_version=version,
        )
        try:
            endpoint = HttpEngineEndpoint.for_sglang(url, name=f"sglang-{version}", timeout_s=120)
            for load_format in ("per_tensor", "flattened_bucket"):
                sender = WeightSender(
                    backend="nccl",
                    master_address="127.0.0.1",
                    timeout_s=120,
                    load_format=load_format,
                    bucket_bytes=8 << 20,
                )
                for cycle in range(2):  # connect, update, disconnect; then again with a new group name
                    sender.connect([endpoint])
                    sent = make_weights(SPEC, seed=100 + cycle, device="cuda:0")
                    start = time.perf_counter()
                    sender.update(sent.items(), f"{load_format}-{cycle}")
                    seconds = time.perf_counter() - start
                    state = endpoint.request("GET", "/state")
                    ok = (
                        state["checksum"] == checksum(sent.items())
                        and state["weight_version"] == f"{load_format}-{cycle}"
                    )
                    nbytes = sum(t.numel() * t.element_size() for t in sent.values())
                    print(
                        f"SGLang {version} {load_format} cycle {cycle}: {'OK' if ok else 'MISMATCH'} "
                        f"{nbytes / 1e6:.1f} MB in {seconds:.3f} s ({sender.active_group_name})",
                        flush=True,
                    )
                    failures += not ok
                    sender.disconnect()
                    if sender.last_disconnect_errors:
                        print(f"disconnect errors: {sender.last_disconnect_errors}", flush=True)
                        failures += 1
        finally:
            proc.kill()
            proc.wait(30)
    print("ALL OK" if not failures else f"{failures} FAILURE(S)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
