"""Record every exchange between the SGLang adapter and a server, as replay fixtures.

Runs every step of :mod:`ppo_rollout.testing.sglang_exercise` (each route and payload the adapter uses,
and its error cases) through the adapter, pointed at a recording proxy on 127.0.0.1 that forwards to the
server, and writes one JSON file per step to ``OUT/main/`` (and ``OUT/lora/`` with ``--lora``), plus each
server's log. Exits 1 naming every step whose answer was not SGLang v0.5.17's; 2 when no server came up.

On the GPU machine (only ``packages/*/src`` on PYTHONPATH, plus sglang)::

    python benchmarks/sglang/record.py --out /tmp/rec --lora

launches ``sglang.launch_server`` through the adapter's own launch code (``SGLangServerSpec``) on two tiny
bfloat16 models made on the spot; ``--url http://127.0.0.1:30000`` uses a server already running (its model
given by ``--model-path``). ``--command "python -m ppo_rollout.testing.sglang_standin --standin-version
0.5.17"`` records the stand-in instead (the provisional fixtures; CPU).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from ppo_rollout.engine.sglang import SGLangClient, SGLangServer, SGLangServerSpec
from ppo_rollout.testing.sglang_exercise import LORA, LORA_STEPS, STEPS, Context, Step, make_models, run_steps
from ppo_rollout.testing.sglang_record import RecordingProxy, write_fixtures
from ppo_weight_sync import free_port


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder for the fixtures (main/, lora/)")
    p.add_argument("--url", default=None, help="a running server (default: launch one through the adapter)")
    p.add_argument("--lora-url", default=None, help="a running server with --enable-lora (with --url)")
    p.add_argument("--model-path", default=None, help="the server's model (default: tiny models made here)")
    p.add_argument("--other-model-path", default=None, help="the weights pushed by the updates")
    p.add_argument("--lora", action="store_true", help="also the LoRA steps (a server with --enable-lora)")
    p.add_argument("--command", default=None, help="replaces `python -m sglang.launch_server`")
    p.add_argument("--extra-args", default="", help="added to the launched servers' arguments")
    p.add_argument("--mem-fraction-static", type=float, default=0.3)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--only", default="", help="comma-separated step names (default: every step)")
    return p.parse_args(argv)


def _vocab(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def _spec(args: argparse.Namespace, model: str, lora: bool) -> SGLangServerSpec:
    cuda = torch.cuda.is_available()
    extra: dict[str, Any] = {}
    if args.command:
        extra["command"] = tuple(shlex.split(args.command))
    return SGLangServerSpec(
        model_path=model,
        port=free_port(),
        enable_memory_saver=cuda,  # release/resume need it; the stand-in takes the flag and ignores it
        mem_fraction_static=args.mem_fraction_static if cuda else None,
        random_seed=0,
        extra_args=tuple(shlex.split(args.extra_args)),
        lora=LORA if lora else None,
        **extra,
    )


def _record(
    args: argparse.Namespace, url: str, models: tuple[Path, Path], steps: list[Step], out: Path, meta: dict
) -> list[str]:
    """Every step against ``url`` through a recording proxy; the fixtures to ``out``; the failures."""
    failures: list[str] = []
    only = {s for s in args.only.split(",") if s}
    with RecordingProxy(url) as proxy:
        with proxy.step("connect", subset={"/server_info": ["version", "tp_size", "dp_size", "pp_size"]}):
            client = SGLangClient(proxy.url, timeout_s=600, name="recorded", vocab_size=_vocab(models[0]))
        gpus = torch.cuda.device_count()
        device = torch.device("cuda", 0) if gpus else None  # the server's (base_gpu_id 0)
        # a weight group from a second GPU over NCCL; from the CPU over gloo when there is one GPU
        ctx = Context(
            client,
            proxy,
            models[0],
            models[1],
            backend="nccl" if gpus > 1 else "gloo",
            sender_device=torch.device("cuda", 1) if gpus > 1 else torch.device("cpu"),
            device=device,
        )
        print(f"weight group: {ctx.backend} from {ctx.sender_device}; CUDA IPC on {device}", flush=True)

        def wanted(s: Step) -> bool:
            if s.compare.get("needs") == "cuda" and device is None:
                print(f"[{s.name}] not run: needs CUDA", flush=True)
                return False
            return not only or s.name in only

        try:
            for s, record, error in run_steps(ctx, steps, wanted):
                status = "ok" if error is None else f"FAILED: {type(error).__name__}: {error}"
                print(f"[{s.name}] {status} ({len(record.exchanges)} exchanges)", flush=True)
                if error is not None:
                    record.note = status
                    failures.append(f"{out.name}/{s.name}: {error}")
                    traceback.print_exception(error)
        finally:
            client.close()
        meta = {**meta, "version": client.protocol.version, "failures": failures}
        paths = write_fixtures(out, proxy.steps, meta)
    print(f"wrote {len(paths)} step files to {out}", flush=True)
    return failures


def _serve_and_record(
    args: argparse.Namespace, models: tuple[Path, Path], lora: bool, meta: dict
) -> list[str]:
    out = args.out / ("lora" if lora else "main")
    steps = LORA_STEPS if lora else STEPS
    given = args.lora_url if lora else args.url
    if given:
        return _record(args, given, models, steps, out, {**meta, "url": given})
    spec = _spec(args, str(models[0]), lora)
    log = args.out / f"server-{out.name}.log"
    server = SGLangServer(
        spec, startup_timeout_s=args.startup_timeout, log_path=log, name=f"sglang-{out.name}"
    )
    t0 = time.monotonic()
    server.start()
    meta = {**meta, "argv": spec.argv()[len(spec.command) :], "startup_s": round(time.monotonic() - t0, 1)}
    print(f"server up in {meta['startup_s']} s: {' '.join(spec.argv())}", flush=True)
    try:
        return _record(args, server.url, models, steps, out, meta)
    finally:
        code = server.stop()
        print(f"server stopped (exit code {code}); log {log}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model_path:
        models = (Path(args.model_path), Path(args.other_model_path or args.model_path))
        meta: dict[str, Any] = {"models": [str(m) for m in models]}
    else:
        models = make_models(Path(tempfile.mkdtemp(prefix="sglang-rec-")))
        meta = {"models": "tiny", "tiny": {"task": "copy", "seeds": [0, 1], "max_positions": 2048}}
    meta["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    meta["torch"] = torch.__version__
    failures: list[str] = []
    for lora in (False, True) if args.lora else (False,):
        try:
            failures += _serve_and_record(args, models, lora, meta)
        except Exception as exc:
            print(f"no recording for {'lora' if lora else 'main'}: {type(exc).__name__}: {exc}", flush=True)
            return 2
    (args.out / "summary.json").write_text(json.dumps({"failures": failures}, indent=1) + "\n")
    for f in failures:
        print(f"FAILED {f}", flush=True)
    print("all steps answered as SGLang v0.5.17 does" if not failures else f"{len(failures)} step(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
