"""First-cycle and steady sleep/wake speed, and what a checkpoint costs the loop, for roles of ~10 GB.

Each role is a Llama of ``--layers`` x ``--hidden`` (defaults: the 0.82B-parameter model of issue 16,
16 layers of 2048 with a 16-token vocabulary: 9.9 GB of float32 weights and AdamW state) built on
the GPU, with the trainer's optimizer (state made at setup, ``init_adam_state``) and the memory
backend the worker uses (``PinnedHostBackend`` on CUDA, host memory on CPU), tracked like
``TrainWorker.setup`` tracks them. It measures, in one process and without Ray:

* setup: pinning host buffers for every tracked tensor, optimizer state included;
* the first sleep of each role (nothing is allocated in it) and steady sleeps and wakes, in GB/s;
* a checkpoint of all roles while asleep, written by ``ppo_trainer.checkpoint.background.BackgroundSave``
  from the host copies (the worker's path: ``torch_io.capture(..., host=...)``, ``write_shard``,
  fsync): the loop's blocking seconds (capturing, then the wait at each role's next sleep after
  one simulated training step) and the writers' seconds.

Exits non-zero when a check fails (bytes written differ from the state, a first sleep allocates).
Usage: ``python benchmarks/offload_and_save.py [--roles 2] [--layers 16] [--hidden 2048] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from ppo_lifecycle.memory import HostCopies, HostMemoryBackend, MemoryBackend, PinnedHostBackend
from ppo_trainer.checkpoint.background import BackgroundSave
from ppo_trainer.checkpoint.format import FORMAT_VERSION, rng_state
from ppo_trainer.checkpoint.torch_io import PolicyExport, ShardState, drop_tied_aliases, from_host
from ppo_trainer.checkpoint.torch_optimizer import init_adam_state, state_by_name


class Role:
    """One trainer role's model, AdamW (state made at setup) and memory backend, as the worker has them."""

    def __init__(self, name: str, args: argparse.Namespace, device: torch.device) -> None:
        self.name = name
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
        with torch.device(device):
            self.model = LlamaForCausalLM(config)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-5, foreach=device.type == "cuda")
        init_adam_state(self.optimizer)
        self.memory: MemoryBackend = (
            PinnedHostBackend(device) if device.type == "cuda" else HostMemoryBackend()
        )
        t0 = time.perf_counter()
        self.memory.track("weights", lambda: [p.data for p in self.model.parameters()])
        self.memory.track(
            "optimizer",
            lambda: [
                v
                for s in self.optimizer.state.values()
                for v in s.values()
                if isinstance(v, torch.Tensor) and v.device.type == device.type
            ],
        )
        self.setup_pin_s = time.perf_counter() - t0
        self.device = device

    @property
    def pinned(self) -> int:
        return self.memory.pinned_bytes if isinstance(self.memory, PinnedHostBackend) else 0

    def train_step(self) -> None:
        ids = torch.randint(0, self.model.config.vocab_size, (2, 64), device=self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def capture(self, step: int) -> ShardState:
        """``torch_io.capture(trainer, step, host=...)`` for this role (no TorchTrainer)."""
        memory = self.memory
        assert isinstance(memory, HostCopies)
        model_state, optimizer_state = from_host(
            self.model.state_dict(), state_by_name(self.model, self.optimizer.state_dict()), memory
        )
        policy = None
        if self.name == "actor":  # the actor also writes hf/ (save_pretrained)
            policy = PolicyExport(self.model, dict(model_state), None, Path("/nonexistent-tokenizer"))
        return ShardState(
            rank=0,
            rng=rng_state(),
            model=drop_tied_aliases(self.model, model_state),
            optimizer=optimizer_state,
            trainer_state={"format_version": FORMAT_VERSION, "role": self.name, "step": step},
            policy=policy,
        )


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--roles", type=int, default=2, help="roles sharing the device (actor, critic)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=16)
    parser.add_argument("--cycles", type=int, default=3, help="steady sleep/wake cycles measured")
    parser.add_argument(
        "--no-copy-first",
        dest="copy_first",
        action="store_false",
        help="write straight from the pinned buffers (the next sleep waits for the disk)",
    )
    parser.add_argument("--out", type=Path, default=None, help="checkpoint folder (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    out = args.out or Path(tempfile.mkdtemp(prefix="offload_and_save."))
    failures: list[str] = []
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}

    roles = [Role(name, args, device) for name in ("actor", "critic")[: args.roles]]
    for role in roles:
        nbytes = sum(t.untyped_storage().nbytes() for t in role.model.parameters())
        nbytes += sum(
            v.untyped_storage().nbytes()
            for s in role.optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.device.type == device.type
        )
        params = sum(p.numel() for p in role.params)
        report[role.name] = {"params": params, "state_bytes": nbytes, "setup_pin_s": role.setup_pin_s}
        print(
            f"{role.name}: {params / 1e9:.2f}B parameters, {nbytes / 1e9:.2f} GB tracked, "
            f"pinned at setup {role.pinned / 1e9:.2f} GB in {role.setup_pin_s:.1f} s"
        )

    # First sleep of each role (the critic first, as the loop does), then steady cycles.
    for role in reversed(roles):
        pinned = role.pinned
        stats = role.memory.release()
        report[role.name]["first_sleep_gbps"] = _gbps(stats.bytes, stats.seconds)
        print(
            f"{role.name}: first sleep {stats.bytes / 1e9:.2f} GB in {stats.seconds:.3f} s = "
            f"{_gbps(stats.bytes, stats.seconds):.1f} GB/s"
        )
        if role.pinned != pinned:
            failures.append(f"{role.name}: the first sleep pinned {role.pinned - pinned} more bytes")
    sleeps, wakes = [], []
    for _ in range(args.cycles):
        for role in roles:
            w = role.memory.restore()
            role.train_step()
            s = role.memory.release()
            wakes.append(_gbps(w.bytes, w.seconds))
            sleeps.append(_gbps(s.bytes, s.seconds))
    report["steady_sleep_gbps"] = min(sleeps)
    report["steady_wake_gbps"] = min(wakes)
    print(f"steady: sleep >= {min(sleeps):.1f} GB/s, wake >= {min(wakes):.1f} GB/s over {len(sleeps)} cycles")

    # A checkpoint of every (asleep) role from its host copies, while the loop goes on.
    t0 = time.perf_counter()
    saves = []
    for role in roles:
        state = role.capture(step=1)
        assert state.model is not None
        # What the files must hold: the next sleep overwrites the pinned buffers behind the copies.
        expected = {n: t.clone() for n, t in list(state.model.items())[:3]}
        saves.append(
            (
                role,
                expected,
                BackgroundSave(state, out / role.name, name=role.name, copy_first=args.copy_first),
            )
        )
        del state
    capture_s = time.perf_counter() - t0
    waits = []
    for role, _, save in saves:  # the next step: each role wakes, trains and sleeps again
        role.memory.restore()
        role.train_step()
        t1 = time.perf_counter()
        save.wait_reading(600)
        waits.append(time.perf_counter() - t1)
        role.memory.release()
    writer_s = [save.result(600) for _, _, save in saves]
    reading_s = [save.reading_seconds for _, _, save in saves]
    written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    report["save"] = {
        "blocking_capture_s": capture_s,
        "blocking_wait_at_next_sleep_s": waits,
        "blocking_total_s": capture_s + sum(waits),
        "writer_s": writer_s,
        "reading_s": reading_s,
        "bytes_written": written,
    }
    print(
        f"save: the loop blocked {capture_s:.3f} s capturing + {sum(waits):.3f} s at the next sleeps "
        f"({', '.join(f'{w:.2f}' for w in waits)}); writers {', '.join(f'{s:.1f}' for s in writer_s)} s "
        f"(reading host copies {', '.join(f'{s:.1f}' for s in reading_s)} s), "
        f"{written / 1e9:.2f} GB on disk = {_gbps(written, max(writer_s)):.2f} GB/s"
    )
    # The files hold the state as it was at the save, not after the steps that followed.
    for role, expected, _ in saves:
        with safe_open(str(out / role.name / "model.safetensors"), framework="pt") as f:
            for name, tensor in expected.items():
                if not torch.equal(f.get_tensor(name), tensor):
                    failures.append(f"{role.name}: {name} in the file differs from the host copy")
    for role, _, _ in saves:
        # Each optimizer tensor written alone (a slab-wide storage would be written whole, per tensor).
        size = (out / role.name / "optimizer.pt").stat().st_size
        moments = 2 * sum(p.numel() * p.element_size() for p in role.params)
        if not moments <= size <= moments * 1.01 + (1 << 20):
            failures.append(f"{role.name}: optimizer.pt has {size} bytes, the moments {moments}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.out is None:
        shutil.rmtree(out, ignore_errors=True)
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
