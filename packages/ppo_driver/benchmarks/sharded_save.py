"""What a checkpoint of an asleep FSDP2 (sharded) role costs the loop: foreground vs background, on CPU.

``--ranks`` processes (default 2) each run one ``ppo_trainer.TrainWorker`` of an FSDP2 actor over
gloo, with the host memory backend, as the driver runs them (without Ray). The model is a Llama built
from the arguments (default: 4 layers of 1024, a vocabulary of 8001 rows, which two ranks split
unevenly: about 66M parameters, 1.1 GB of float32 weights and AdamW state). After one training step
the role sleeps, and a checkpoint is taken twice of the same state:

* **foreground** (the path before background saves of sharded roles): the driver wakes the role,
  every rank gathers the whole state over the role's group and rank 0 writes, the role sleeps again.
  The loop blocks for all of it.
* **background**: ``save_async`` notes each rank's host copies of its shards and returns; the writer
  threads gather them to rank 0 over the save group and write while the loop takes its next step
  (wake, train, sleep). The loop blocks for ``save_async`` and for what the next sleep takes beyond
  a plain sleep (with the host backend nothing waits for the writer: each sleep has fresh buffers).

The figures are the slowest rank's. Exits non-zero when the two checkpoints differ in any byte (the
RNG files compared by content) or a save fails.
Usage: ``python benchmarks/sharded_save.py [--ranks 2] [--layers 4] [--hidden 1024] [--json FILE]``
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from ppo_trainer.config import AlgorithmConfig, TrainerConfig
from ppo_trainer.worker import TrainWorker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _train_step(worker: TrainWorker, seed: int) -> None:
    """One optimizer step of the FSDP2 model on a fixed batch (collective over the role's group)."""
    trainer = worker.trainer
    model = trainer.model  # type: ignore[attr-defined]  # the torch backend's
    generator = torch.Generator().manual_seed(seed + worker.rank)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=generator)
    model(input_ids=ids, labels=ids).loss.backward()
    trainer.optimizer.step()  # type: ignore[attr-defined]
    trainer.optimizer.zero_grad(set_to_none=True)  # type: ignore[attr-defined]


def _rank(rank: int, world: int, port: int, model: str, out: str) -> None:
    torch.set_num_threads(1)
    config = TrainerConfig(
        role="actor",
        model_path=model,
        algorithm=AlgorithmConfig(),
        data_parallel="fsdp2",
        memory_backend="host",
    )
    worker = TrainWorker(config, rank, world, timeout_s=600)
    worker.setup(f"tcp://127.0.0.1:{port}")
    if worker.trainer.layout != "fsdp2" or not worker.saves_asleep():
        raise RuntimeError(f"rank {rank}: expected an FSDP2 role that saves asleep ({worker.trainer.layout})")
    folder = Path(out)
    _train_step(worker, 1)
    figures: dict[str, Any] = {}
    t0 = time.perf_counter()
    worker.sleep()
    figures["sleep_s"] = time.perf_counter() - t0  # a sleep without a save in flight

    # Foreground: what the driver did for a sharded role: wake it, save, put it back to sleep.
    t0 = time.perf_counter()
    worker.wake_up()
    worker.save(str(folder / "fg.partial"))
    if rank == 0:
        worker.commit(str(folder / "fg.partial"), str(folder / "fg"))
    worker.sleep()
    figures["foreground_blocking_s"] = time.perf_counter() - t0

    # Background: save_async returns at once; the next step goes on while the writers run.
    t0 = time.perf_counter()
    started = worker.save_async(str(folder / "bg.partial"))
    figures["background_save_async_s"] = time.perf_counter() - t0
    figures["bytes_this_rank"] = started["bytes"]
    worker.wake_up()
    _train_step(worker, 2)
    save = worker._checkpoints.background
    assert save is not None
    t0 = time.perf_counter()
    worker.sleep()  # waits for the writer only where the next release reuses its buffers (pinned)
    figures["background_next_sleep_s"] = time.perf_counter() - t0
    figures["background_writer_s"] = worker.save_wait()
    figures["background_reading_s"] = save.reading_seconds
    if rank == 0:
        worker.commit(str(folder / "bg.partial"), str(folder / "bg"))
    figures["background_blocking_s"] = figures["background_save_async_s"] + max(
        0.0, figures["background_next_sleep_s"] - figures["sleep_s"]
    )
    (folder / f"rank{rank}.json").write_text(json.dumps(figures))
    worker.shutdown()


def _content(path: Path) -> object:
    if not path.name.startswith("rng_rank"):
        return path.read_bytes()
    with safe_open(str(path), framework="pt") as f:  # metadata order is not fixed: compare contents
        return f.metadata(), {k: f.get_tensor(k).tolist() for k in f.keys()}  # noqa: SIM118


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8001, help="odd: the ranks hold uneven shards")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="sharded_save.") as tmp:
        root = Path(tmp)
        config = LlamaConfig(
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.heads,
            vocab_size=args.vocab,
            max_position_embeddings=128,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(root / "model")
        del model
        out = root / "checkpoints"
        out.mkdir()
        mp.spawn(
            _rank,
            args=(args.ranks, _free_port(), str(root / "model"), str(out)),
            nprocs=args.ranks,
            join=True,
        )
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.ranks)]
        report: dict[str, Any] = {
            "ranks": args.ranks,
            "params": params,
            "state_bytes": sum(r["bytes_this_rank"] for r in ranks),
            "cpu": os.cpu_count(),
        }
        for key in ranks[0]:
            if key != "bytes_this_rank":
                report[key] = max(r[key] for r in ranks)
        failures = []
        fg, bg = out / "fg", out / "bg"
        names = sorted(str(p.relative_to(fg)) for p in fg.rglob("*") if p.is_file())
        if names != sorted(str(p.relative_to(bg)) for p in bg.rglob("*") if p.is_file()):
            failures.append("the two checkpoints hold different files")
        failures += [f"{n} differs" for n in names if _content(fg / n) != _content(bg / n)]
        report["written_bytes"] = sum((bg / n).stat().st_size for n in names if (bg / n).exists())
    gb = report["state_bytes"] / 1e9
    print(
        f"FSDP2 actor on {args.ranks} CPU ranks: {params / 1e6:.0f}M parameters, {gb:.2f} GB of weights and "
        f"AdamW state, {report['written_bytes'] / 1e9:.2f} GB written"
    )
    print(f"foreground (wake, gather, write, sleep): the loop blocks {report['foreground_blocking_s']:.2f} s")
    print(
        f"background: the loop blocks {report['background_blocking_s']:.2f} s "
        f"(save_async {report['background_save_async_s']:.3f} s + the next sleep's "
        f"{report['background_next_sleep_s']:.2f} s less a plain sleep's {report['sleep_s']:.2f} s); "
        f"writers {report['background_writer_s']:.2f} s"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
