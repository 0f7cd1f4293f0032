"""What destroying and rebuilding many process groups costs, with and without shared subgroups.

    python benchmarks/groups_reload.py                                  # gloo, 2 ranks, 20 subgroups
    python benchmarks/groups_reload.py --backend nccl --world 1         # one GPU (megatron's case)

Each rank makes the default group and ``--groups`` subgroups the way megatron-core does with
tensor parallelism 1: alternately over every rank (DP, DP-with-CP, TP-DP, ...) and one group per rank
(TP, PP, MP, embedding, ...; every rank calls ``new_group`` for every rank's group). A collective
runs on each group this rank is in, so each has its communicator (NCCL makes them lazily, at the
first collective). Then, per cycle: ``destroy()``, ``reload()``, the first collective on every group
(communicators made again) and a second one (steady). Modes: ``separate`` (one group per request,
as before) and ``shared`` (``new_group(share=True)``: one group per distinct rank set).
Prints the median seconds per cycle; exits non-zero if a collective's result is wrong.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ppo_lifecycle.process_groups import ReloadableProcessGroups
from ppo_testsupport import run_ranks

MODES = ("separate", "shared")
STEPS = ("destroy", "reload", "first_collectives", "steady_collectives")


def rank_main(argv: list[str]) -> None:
    rank, world, port = (int(a) for a in argv[:3])
    backend, n_groups, cycles, mode, out = argv[3], int(argv[4]), int(argv[5]), argv[6], argv[7]
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    groups = ReloadableProcessGroups()
    groups.init_default(backend, f"tcp://127.0.0.1:{port}", world, rank, timedelta(seconds=120))
    mine = []  # the handles of the groups this rank is in
    for i in range(n_groups):
        rank_sets = [list(range(world))] if i % 2 == 0 else [[r] for r in range(world)]
        for ranks in rank_sets:
            handle = groups.new_group(ranks, timeout=timedelta(minutes=30), share=mode == "shared")
            if rank in ranks:
                mine.append((handle, len(ranks)))

    def collectives() -> float:
        start = time.perf_counter()
        for handle, size in mine:
            t = torch.ones(4, device=device)
            dist.all_reduce(t, group=handle.group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if t.tolist() != [float(size)] * 4:
                raise RuntimeError(f"all_reduce over {size} ranks gave {t.tolist()}")
        return time.perf_counter() - start

    collectives()
    record: dict[str, list[float]] = {step: [] for step in STEPS}
    for _ in range(cycles):
        start = time.perf_counter()
        groups.destroy()
        record["destroy"].append(time.perf_counter() - start)
        start = time.perf_counter()
        groups.reload()
        record["reload"].append(time.perf_counter() - start)
        record["first_collectives"].append(collectives())
        record["steady_collectives"].append(collectives())
    asked, built = groups.subgroup_count
    groups.destroy()
    Path(out).write_text(json.dumps({"record": record, "asked": asked, "built": built}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--groups", type=int, default=20)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--out", default="", help="also write the medians here (JSON)")
    args = parser.parse_args()
    if args.backend == "nccl" and args.world != 1:
        raise ValueError("--backend nccl runs on one GPU: give --world 1")
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            run_ranks(
                Path(__file__),
                args.world,
                lambda r, mode=mode: [
                    "rank",
                    args.backend,
                    args.groups,
                    args.cycles,
                    mode,
                    f"{tmp}/{mode}{r}",
                ],
                timeout_s=300,
            )
            rec = json.loads(Path(f"{tmp}/{mode}0").read_text())
            results[mode] = {step: statistics.median(v) for step, v in rec["record"].items()}
            results[mode]["groups"] = f"{rec['asked']} asked, {rec['built']} made"
    print(
        f"\n{args.backend}, {args.world} rank(s), default group + {args.groups} subgroup requests, "
        f"median of {args.cycles} cycles (seconds, rank 0)"
    )
    print("| mode | subgroups | " + " | ".join(STEPS) + " | total |")
    print("|---|---|" + "---|" * (len(STEPS) + 1))
    for mode, row in results.items():
        total = sum(float(row[s]) for s in STEPS[:3])
        print(
            f"| {mode} | {row['groups']} | "
            + " | ".join(f"{float(row[s]):.4f}" for s in STEPS)
            + f" | {total:.4f} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 5 and sys.argv[4] == "rank":
        argv = sys.argv[1:4] + sys.argv[5:]
        rank_main(argv)
    else:
        sys.exit(main())
