"""LoRA adapter-only updates to a real SGLang server: greedy tokens with the adapter equal the merged model's.

1. A tiny random Llama (head size 64; or ``--model``) in the sync dtype (``--dtype``: bfloat16 on CUDA,
   since SGLang 0.5.17's CUDA rmsnorm takes no float32; bfloat16 rounds the merged weight where SGLang
   adds the adapter's output, so a response may flip at a near-tie: ``--tie-gap``).
2. Adapters as the trainer makes them: ``LoRAConverter`` (rank 8, alpha 16, q/k/v/o and gate/up/down
   projections; A Kaiming-uniform), with B set random non-zero so they change the outputs; what an
   adapter-only update sends (the adapters in the sync dtype, ``TorchTrainer.trainable_weights``) and what
   the merged export gives (``LoRAConverter.export``: base, A and B cast to the sync dtype, then merged).
3. One server with the adapter's LoRA arguments (``SGLangServerSpec(lora=...)``: ``--enable-lora
   --max-lora-rank --lora-target-modules``); the adapters sent through the project's sender path
   (``WeightSender`` + ``SGLangAdapters``: ``/load_lora_adapter_from_tensors``); ``--prompts`` prompts x
   ``--tokens`` greedy tokens with the adapter (``lora_path``) and without it (the base: must differ).
4. The merged model: ``--merged-via tensor`` (CUDA): the merged weights pushed to the same server by
   ``update_weights_from_tensor`` (the project's ``ColocatedIpc`` sender), read back from the server and
   compared bitwise, then generated without the adapter; ``--merged-via launch``: a second server on a
   folder of the merged weights.
5. Greedy tokens compared; for each difference, where it starts and the trainer model's top-2 logit gap
   there (a near-tie or not). Exits 1 unless every response is equal or first differs at a near-tie
   (gap below ``--tie-gap``, default 0: none), or on any failure.

    python benchmarks/sglang/lora_equal.py                                    # GPU, bfloat16, tensor
    python benchmarks/sglang/lora_equal.py --device cpu --merged-via launch \\
        --command "python -m ppo_rollout.testing.sglang_standin --standin-version 0.5.17"   # dry run
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
from launch import launch_server, log
from transformers import AutoModelForCausalLM

from ppo_rollout.config import AdapterUpdates, SamplingConfig
from ppo_rollout.engine.sglang import (
    SGLangClient,
    SGLangError,
    SGLangServer,
)
from ppo_rollout.tasks import make_tiny_model
from ppo_trainer.config import LoraSettings
from ppo_trainer.converters.lora import LoRAConverter, adapter_state, lora_modules
from ppo_weight_sync import WeightSender
from ppo_weight_sync.buckets import dtype_name
from ppo_weight_sync.sglang_lora import ADAPTER_NAME, SGLangAdapters
from ppo_weight_sync.sglang_weights import rows_checksum

CUDA_GRAPHS = ("--cuda-graph-max-bs", "16")  # capture fewer shapes: a shorter start
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA = AdapterUpdates(rank=8, alpha=16.0, target_modules=MODULES)
Named = list[tuple[str, torch.Tensor]]


def base_model(args: argparse.Namespace, folder: Path) -> Path:
    if args.model:
        return Path(args.model)
    log(f"building a tiny random Llama (hidden 256, 4 heads of 64, 2 layers) in {args.dtype}")
    path = make_tiny_model(
        "copy", folder / "base", seed=0, hidden_size=256, num_heads=4, num_layers=2, intermediate_size=512,
        max_positions=512,
    )  # fmt: skip
    AutoModelForCausalLM.from_pretrained(path).to(getattr(torch, args.dtype)).save_pretrained(path)
    return path


def make_adapters(args: argparse.Namespace, path: Path) -> tuple[Any, Named, Named]:
    """The trainer's LoRA model (its forward is the reference), the adapters an adapter-only update sends
    and the merged weights (both in the sync dtype)."""
    dtype = getattr(torch, args.dtype)
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    settings = LoraSettings(rank=LORA.rank, alpha=LORA.alpha, target_modules=MODULES)
    converter = LoRAConverter(settings, seed=args.seed)
    converter.convert(model)
    g = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        for _, module in lora_modules(model):
            b = module.lora_B.weight
            b.copy_(torch.randn(b.shape, generator=g) * args.b_std)  # non-zero: the adapter changes outputs
    adapters = [(n, t.to(dtype, copy=True)) for n, t in adapter_state(model).items()]
    state = model.state_dict(keep_vars=True)
    merged = [(n, t.detach().to(dtype)) for n, t in converter.export(iter(state.items()), dtype)]
    log(f"adapters: {len(adapters)} tensors, rank {LORA.rank}, scale {LORA.scale:g}; merged: {len(merged)}")
    return model, adapters, merged


def generate(client: SGLangClient, prompts: list[list[int]], tokens: int, what: str) -> list[Any]:
    log(f"generating {len(prompts)} x {tokens} greedy tokens {what} (bounded by {client.timeout_s:.0f} s)")
    outs = client.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=tokens, ignore_eos=True))
    if any(len(o.token_ids) != tokens for o in outs):
        raise RuntimeError(f"{what}: responses of lengths {[len(o.token_ids) for o in outs]}, not {tokens}")
    return outs


def load_adapters(client: SGLangClient, adapters: Named) -> None:
    log("sending the adapters: WeightSender + SGLangAdapters (/load_lora_adapter_from_tensors)")
    sender = WeightSender(timeout_s=120, transports=[SGLangAdapters(LORA.alpha)])
    sender.connect([client.endpoint])
    try:
        sender.update(adapters, version="lora-1")
    finally:
        sender.disconnect()
    version = client.endpoint.get_weight_version().result(60)
    if version != "lora-1":
        raise RuntimeError(f"weight version {version!r} after the adapter update, expected 'lora-1'")
    log("adapters loaded (weight version lora-1)")


def push_merged(client: SGLangClient, merged: Named, device: torch.device) -> bool:
    """The merged weights over CUDA IPC (update_weights_from_tensor); True when the server's read back
    equals them bitwise."""
    from ppo_weight_sync import ColocatedIpc

    log("pushing the merged weights: WeightSender + ColocatedIpc (update_weights_from_tensor)")
    ipc = ColocatedIpc([client.endpoint.name], device=device)
    sender = WeightSender(backend="nccl", master_address="127.0.0.1", timeout_s=300, transports=[ipc])
    sender.connect([client.endpoint])
    try:
        sender.update([(n, t.to(device)) for n, t in merged], version="merged-1")
    finally:
        sender.disconnect()
    if not client.endpoint.flush_cache().result(60).success:  # the sender flushed; this makes sure
        raise RuntimeError("flush_cache after the merged update failed")
    log("reading the weights back (/get_weights_by_name, first 8 rows of each tensor)")
    manifest = [(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in merged]
    try:
        same = client.weights_checksum(manifest, rows=8) == rows_checksum(merged, 8)
    except SGLangError as exc:  # reported, and the tokens still compared
        log(f"FAILED could not read the weights back: {exc}")
        return False
    log(("ok    " if same else "FAILED") + " the server holds the merged weights bitwise")
    return same


def save_merged(base: Path, merged: Named, folder: Path) -> Path:
    shutil.copytree(base, folder)
    for stale in [
        *folder.glob("*.safetensors"),
        *folder.glob("*.safetensors.index.json"),
        *folder.glob("*.bin"),
    ]:
        stale.unlink()
    model: Any = AutoModelForCausalLM.from_pretrained(base, dtype=merged[0][1].dtype)
    model.load_state_dict(dict(merged))
    model.save_pretrained(folder)
    return folder


def top2_gap(model: Any, ids: list[int]) -> float:
    model.float()  # float32 throughout: the adapters are float32 whatever the base's dtype
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def compare(
    model: Any, prompts: list[list[int]], lora: list[Any], merged: list[Any], tie_gap: float
) -> tuple[int, int]:
    """(equal responses, responses that first differ where the trainer's top-2 logit gap is below
    ``tie_gap``: a near-tie that rounding may decide either way)."""
    equal = ties = 0
    for i, (p, a, b) in enumerate(zip(prompts, lora, merged, strict=True)):
        if a.token_ids == b.token_ids:
            equal += 1
            continue
        at = next(k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y)
        gap = top2_gap(model, [*p, *a.token_ids[:at]])
        ties += gap < tie_gap
        log(
            f"differs prompt {i} at token {at}: adapter {a.token_ids[at]} (log-prob {a.log_probs[at]:.6f}), "
            f"merged {b.token_ids[at]} (log-prob {b.log_probs[at]:.6f}); the trainer model's top-2 logit gap "
            f"there {gap:.2e}"
        )
    return equal, ties


def run(args: argparse.Namespace, tmp: Path) -> int:
    path = base_model(args, tmp)
    model, adapters, merged = make_adapters(args, path)
    g = torch.Generator().manual_seed(args.seed + 2)
    vocab = int(model.config.vocab_size)
    prompts = [
        [1, *torch.randint(4, vocab, (int(n),), generator=g).tolist()] for n in range(8, 8 + args.prompts)
    ]
    servers: list[SGLangServer] = []
    try:
        servers.append(launch_server(args, path, "sglang-lora", args.dtype, CUDA_GRAPHS, LORA)[0])
        client = SGLangClient(servers[0].url, timeout_s=args.request_timeout, name="lora-server")
        log(f"SGLang {client.protocol.version}")
        load_adapters(client, adapters)
        named = SGLangClient(client.base_url, timeout_s=args.request_timeout, adapter=ADAPTER_NAME)
        with_adapter = generate(named, prompts, args.tokens, f"with the adapter (lora_path {ADAPTER_NAME})")
        base = generate(client, prompts, args.tokens, "without the adapter (the base)")
        changed = sum(a.token_ids != b.token_ids for a, b in zip(with_adapter, base, strict=True))
        log(f"the adapter changes {changed}/{len(prompts)} responses")
        if changed == 0:
            raise RuntimeError("the adapter changed no response: not applied, or --b-std too small")
        held = True
        if args.merged_via == "tensor":
            held = push_merged(client, merged, torch.device("cuda", torch.cuda.current_device()))
            reference = generate(client, prompts, args.tokens, "with the merged weights (same server)")
        else:
            log(f"stopping {servers[0].name}; a second server on the merged weights")
            servers[0].stop()
            folder = save_merged(path, merged, tmp / "merged")
            servers.append(launch_server(args, folder, "sglang-merged", args.dtype, CUDA_GRAPHS)[0])
            other = SGLangClient(servers[1].url, timeout_s=args.request_timeout, name="merged-server")
            reference = generate(other, prompts, args.tokens, "with the merged model (second server)")
    finally:
        for server in servers:
            log(f"stopping {server.name}")
            server.stop()
    equal, ties = compare(model, prompts, with_adapter, reference, args.tie_gap)
    ok = equal + ties == len(prompts) and held
    verdict = "ok" if ok else "FAILED"
    log(
        f"{verdict} {equal}/{len(prompts)} greedy responses of {args.tokens} tokens equal "
        f"(adapter vs merged, {args.dtype}, merged via {args.merged_via}); {ties} first differ at a "
        f"near-tie (top-2 logit gap below --tie-gap {args.tie_gap:g})"
    )
    return 0 if ok else 1


def parse(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--device", default="cuda" if cuda else "cpu", help="where the merged weights are pushed from"
    )
    p.add_argument("--model", default=None, help="a Llama-like model folder instead of the tiny random one")
    p.add_argument(
        "--dtype",
        default="bfloat16" if cuda else "float32",
        choices=["float32", "bfloat16"],
        help="the sync dtype (SGLang 0.5.17's CUDA rmsnorm takes no float32: the server dies at start)",
    )
    p.add_argument(
        "--tie-gap",
        type=float,
        default=0.0,
        help="count a response that first differs where the trainer's top-2 logit gap is below this as a "
        "near-tie, not a failure (bfloat16 rounds the adapter's path and the merged weight differently)",
    )
    p.add_argument("--merged-via", choices=["tensor", "launch"], default=None, help="default: tensor on CUDA")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--b-std", type=float, default=0.05, help="the std of the random B matrices")
    p.add_argument("--mem-fraction-static", type=float, default=0.2)
    p.add_argument("--deterministic", action="store_true", help="--enable-deterministic-inference")
    p.add_argument("--command", default=None, help="replaces `python -m sglang.launch_server`")
    p.add_argument("--extra-args", default="", help="added to the servers' arguments")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=120.0, help="bounds each HTTP call")
    p.add_argument(
        "--logs", default=None, help="folder for the server logs (default: a new one under /tmp, kept)"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.merged_via = args.merged_via or ("tensor" if args.device == "cuda" else "launch")
    if args.merged_via == "tensor" and not cuda:
        p.error("--merged-via tensor needs CUDA (update_weights_from_tensor over CUDA IPC); use launch")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(min(4, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        args.logs = args.logs or tempfile.mkdtemp(prefix="sglang-lora-logs-")  # kept after the run
        Path(args.logs).mkdir(parents=True, exist_ok=True)
        log(f"command: {shlex.join([sys.executable, *sys.argv])}")
        try:
            return run(args, Path(tmp))
        except Exception as exc:  # every failure is a non-zero exit, with its reason
            traceback.print_exc()
            log(f"FAILED: {type(exc).__name__}: {exc}")
            return 1


if __name__ == "__main__":
    sys.exit(main())
