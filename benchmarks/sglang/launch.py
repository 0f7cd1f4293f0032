"""One SGLang server for the benchmark scripts of this folder, launched by the adapter's own code.

The adapter's spec gives ``--attention-backend triton`` and ``--dtype``; without ``--deterministic`` the
scripts still want the pytorch sampler (the one every SGLang build has), which the spec adds only with
``--enable-deterministic-inference``. ``args`` holds the scripts' shared options: ``--device``,
``--mem-fraction-static``, ``--deterministic``, ``--command``, ``--extra-args``, ``--startup-timeout``,
``--logs``.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import time
from pathlib import Path

from ppo_rollout.config import AdapterUpdates
from ppo_rollout.engine.sglang import DEFAULT_COMMAND, SGLangServer, SGLangServerSpec
from ppo_weight_sync import free_port

T0 = time.monotonic()


def log(message: str) -> None:
    """``message`` with the wall-clock time and the seconds since the script started."""
    print(f"[{datetime.datetime.now():%H:%M:%S} +{time.monotonic() - T0:7.1f} s] {message}", flush=True)


def launch_server(
    args: argparse.Namespace,
    path: Path,
    name: str,
    dtype: str,
    extra: tuple[str, ...] = (),
    lora: AdapterUpdates | None = None,
) -> tuple[SGLangServer, float]:
    """A started server on ``path`` and its seconds from launch to ``/health`` 200."""
    sampler = () if args.deterministic else ("--sampling-backend", "pytorch")
    spec = SGLangServerSpec(
        model_path=str(path),
        port=free_port("127.0.0.1"),
        mem_fraction_static=args.mem_fraction_static if args.device == "cuda" else None,
        deterministic=args.deterministic,
        dtype=dtype,
        random_seed=0,
        lora=lora,
        extra_args=(*extra, *sampler, *shlex.split(args.extra_args)),
        command=tuple(shlex.split(args.command)) if args.command else DEFAULT_COMMAND,
    )
    log_path = Path(args.logs) / f"{name}.log"
    server = SGLangServer(spec, startup_timeout_s=args.startup_timeout, log_path=log_path, name=name)
    log(f"launching {name}: {shlex.join(spec.argv())}")
    log(f"waiting for {name} /health (at most {args.startup_timeout:.0f} s; log {log_path})")
    t0 = time.perf_counter()
    server.start()
    seconds = time.perf_counter() - t0
    log(f"{name} up after {seconds:.1f} s (launch to /health 200)")
    return server, seconds
