"""Memory of a LoRA actor and a LoRA critic on the same device, each holding its base (``unshared``)
against one base the critic maps from the actor (``train.lora.share_base``, ``shared``).

For each mode the actor and then the critic start in processes of their own (``spawn``, as Ray's
workers are), build the torch backend's trainer (``TorchTrainer``, the real converters), take one
optimizer step on random tokens and score fixed tokens; then, with both resident, this process reads

- CPU: each process's resident (RSS) and proportional (PSS: a page mapped by n processes counts 1/n
  in each) memory from ``/proc/<pid>/smaps_rollup``; the PSS sum is what the two cost the machine;
- CUDA: the device memory both processes use (``torch.cuda.mem_get_info`` before they start and with
  both up, so the two CUDA contexts count in both modes) and each one's ``memory_allocated``;

and, per role, the bytes a sleep moves (the weights the memory backend tracks, and the AdamW state)
and the base that stays resident. The two modes must score alike (to tolerance) and the shared base
must be bit-identical after both steps; the run fails otherwise.

The model: ``--preset 135m`` (SmolLM2-135M's shape: hidden 576, 30 layers, vocabulary 49152, tied
embeddings; random weights saved once so both roles load the same ones) or ``--model`` (a folder).

Run: ``python benchmarks/shared_base_memory.py --preset 135m`` (CPU, float32),
``python benchmarks/shared_base_memory.py --preset 135m --device cuda`` (bfloat16 base).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_memory import PRESETS, preset_folder

MODES = ("unshared", "shared")


def save_preset(name: str, folder: Path) -> Path:
    """The preset's shape with random weights from seed 0, saved (both roles load the same ones)."""
    from transformers import AutoConfig, LlamaForCausalLM

    preset_folder(name, folder)
    torch.manual_seed(0)
    LlamaForCausalLM(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    return folder


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def role_process(role: str, shared: bool, options: dict[str, Any], handle: Any, conn: Connection) -> None:
    """One role: build, one step, report; then wait for the parent's word (``mapped``, ``exit``)."""
    from ppo_trainer.backend import TorchTrainer
    from ppo_trainer.config import AlgorithmConfig, LoraSettings, TrainerConfig

    torch.set_num_threads(max(1, options["threads"]))
    config = TrainerConfig(
        role=role,  # type: ignore[arg-type]
        model_path=options["model"],
        device=options["device"],
        dtype=options["dtype"],
        lora=LoraSettings(rank=options["rank"], alpha=2.0 * options["rank"]),
        algorithm=AlgorithmConfig(kl_coef=options["kl_coef"]),
        actor_lr=1e-3,
        critic_lr=1e-3,
    )
    t = TorchTrainer(
        config, publish_base=shared and role == "actor", base=handle if role == "critic" else None
    )
    g = torch.Generator().manual_seed(1)
    vocab = t.model.config.vocab_size if role == "actor" else t.model.backbone.config.vocab_size
    ids = torch.randint(0, vocab, (2, options["tokens"]), generator=g).to(t.device)

    def out() -> torch.Tensor:
        with t._autocast():
            if role == "critic":
                return t.model(ids).float()
            return t.model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1)

    digest = t.shared_base.digest() if t.shared_base is not None else ""
    t.backward(out().pow(2).mean())
    t.optimizer_step()
    with torch.no_grad():
        scored = out().cpu()
    if t.device.type == "cuda":
        # What the worker's sleep also does: the cached blocks of loading (the float32 copies the
        # bfloat16 base replaced) and of the step go back, so the device figures count live memory.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    base = [] if t.shared_base is None else [t.shared_base.buffer]
    conn.send(
        {
            "pid": mp.current_process().pid,
            "handle": t.shared_base.handle if t.shared_base is not None else None,
            "scored": scored,
            "bfloat16": t.autocast_dtype is not None,
            "sleep_moves": nbytes(t.weight_tensors()) + nbytes(t.optimizer_tensors()),
            "stays_resident": nbytes(base),
            "allocated": torch.cuda.memory_allocated() if t.device.type == "cuda" else 0,
            "digest_before": digest,
            "digest_after": t.shared_base.digest() if t.shared_base is not None else "",
        }
    )
    while (word := conn.recv()) != "exit":
        if word == "mapped" and t.shared_base is not None:
            t.shared_base.unlink()
    if t.shared_base is not None:
        t.shared_base.unlink()
    conn.send("done")


def smaps_rollup(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            fields = line.split()
            if fields[0] in ("Rss:", "Pss:"):
                out[fields[0][:-1].lower()] = int(fields[1]) * 1024
    return out


def run_mode(shared: bool, options: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    cuda = options["device"] == "cuda"
    free_before = torch.cuda.mem_get_info()[0] if cuda else 0
    reports: dict[str, dict[str, Any]] = {}
    procs: dict[str, tuple[Any, Connection]] = {}
    try:
        handle = None
        for role in ("actor", "critic"):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=role_process, args=(role, shared, options, handle, child), daemon=True)
            proc.start()
            procs[role] = (proc, parent)
            if not parent.poll(timeout_s):
                raise RuntimeError(
                    f"{role} ({'shared' if shared else 'unshared'}): no report in {timeout_s}s"
                )
            reports[role] = parent.recv()
            handle = reports["actor"]["handle"] if shared else None
        if shared:
            procs["actor"][1].send("mapped")
        figures: dict[str, Any] = {role: dict(r) for role, r in reports.items()}
        for r in figures.values():
            r.pop("handle")
            if not cuda:
                r.update(smaps_rollup(r["pid"]))
        if cuda:
            torch.cuda.synchronize()
            figures["device_used"] = free_before - torch.cuda.mem_get_info()[0]
        return figures
    finally:
        for role in ("critic", "actor"):  # the owner of the base last
            if role in procs:
                proc, conn = procs[role]
                if proc.is_alive():
                    conn.send("exit")
                    conn.poll(timeout_s)
                proc.join(timeout_s)
                if proc.is_alive():
                    proc.kill()


def check(figures: dict[str, dict[str, Any]]) -> list[str]:
    """What differs between the modes beyond tolerance (empty: they agree)."""
    problems = []
    shared = figures["shared"]
    for role in ("actor", "critic"):
        a, b = figures["unshared"][role]["scored"], shared[role]["scored"]
        # bfloat16 compute: the same inputs in buffers of another alignment may take other kernels
        tolerance = 2e-2 if shared[role]["bfloat16"] else 1e-4
        if not torch.allclose(a, b, rtol=tolerance, atol=tolerance):
            problems.append(f"{role}: scores differ by up to {(a - b).abs().max():.3g}")
        if shared[role]["digest_before"] != shared["actor"]["digest_before"]:
            problems.append(f"{role}: sees another base than the actor")
        if shared[role]["digest_after"] != shared["actor"]["digest_before"]:
            problems.append(f"{role}: the base changed during the step")
    return problems


def print_report(figures: dict[str, dict[str, Any]], device: str) -> None:
    mb = 1e-6
    print("| figure | unshared | shared | shared / unshared |")
    print("|---|---:|---:|---:|")

    def row(label: str, unshared: float, shared: float) -> None:
        ratio = f"{shared / unshared:.3f}" if unshared else ""
        print(f"| {label} | {unshared * mb:,.1f} MB | {shared * mb:,.1f} MB | {ratio} |")

    u, s = figures["unshared"], figures["shared"]
    if device == "cuda":
        row("device memory, actor + critic", u["device_used"], s["device_used"])
        for role in ("actor", "critic"):
            row(f"  allocated by the {role}", u[role]["allocated"], s[role]["allocated"])
    else:
        row(
            "PSS, actor + critic",
            u["actor"]["pss"] + u["critic"]["pss"],
            s["actor"]["pss"] + s["critic"]["pss"],
        )
        row(
            "RSS, actor + critic",
            u["actor"]["rss"] + u["critic"]["rss"],
            s["actor"]["rss"] + s["critic"]["rss"],
        )
        for role in ("actor", "critic"):
            row(f"  PSS of the {role}", u[role]["pss"], s[role]["pss"])
    for role in ("actor", "critic"):
        row(f"a sleep moves ({role})", u[role]["sleep_moves"], s[role]["sleep_moves"])
    row("stays resident asleep (the shared base)", 0.0, s["actor"]["stays_resident"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="a Hugging Face model folder with weights")
    source.add_argument("--preset", choices=sorted(PRESETS))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--kl-coef", type=float, default=0.0, help="> 0: the critic holds the reference too")
    parser.add_argument(
        "--tokens", type=int, default=256, help="tokens per sequence of the step (2 sequences)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds for each process's report")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or save_preset(args.preset, Path(tmp) / "model")
        options = {
            "model": str(folder),
            "device": args.device,
            "dtype": args.dtype,
            "rank": args.rank,
            "kl_coef": args.kl_coef,
            "tokens": args.tokens,
            "threads": args.threads,
        }
        figures = {mode: run_mode(mode == "shared", options, args.timeout) for mode in MODES}
    print(
        f"model: {args.model or args.preset}, LoRA rank {args.rank}, dtype {args.dtype}, {args.device}, "
        f"kl_coef {args.kl_coef}"
    )
    print_report(figures, args.device)
    problems = check(figures)
    if args.json:
        plain = {
            m: {
                r: {k: v for k, v in f.items() if k != "scored"} if isinstance(f, dict) else f
                for r, f in figures[m].items()
            }
            for m in MODES
        }
        args.json.write_text(json.dumps(plain, indent=2) + "\n")
    for problem in problems:
        print(f"FAILED: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
