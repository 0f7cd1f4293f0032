"""What the dataset pre-flight costs: ``ppo_rollout.prompts.check_dataset`` over a JSONL file of
``--rows`` rows (the run's reader and its tokenizer), seconds in all and per million rows.

The model is the built-in tiny one (a character tokenizer, a fast ``tokenizers`` one) unless
``--model`` names a Hugging Face folder; prompts are 20 to 55 characters (the tiny model holds 64
positions). Prints one JSON line.

    python packages/rollout/benchmarks/dataset_check.py --rows 1000000
    python packages/rollout/benchmarks/dataset_check.py --rows 1000000 --model /models/Qwen2.5-0.5B
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from ppo_rollout.config import RolloutConfig
from ppo_rollout.prompts import check_dataset
from ppo_rollout.tasks import make_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--model", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = args.model or make_tiny_model("copy", folder / "model", seed=0)
        rng = random.Random(0)
        dataset = folder / "prompts.jsonl"
        t0 = time.perf_counter()
        with dataset.open("w") as f:
            for _ in range(args.rows):
                prompt = "".join(rng.choice("0123456789") for _ in range(rng.randint(20, 55)))
                f.write(json.dumps({"prompt": prompt, "label": prompt}) + "\n")
        written_s = time.perf_counter() - t0
        config = RolloutConfig(model_path=str(model), task=None, dataset=str(dataset), reward="exact_match")
        report = check_dataset(config)
        file_mb = dataset.stat().st_size / 1e6
    print(
        json.dumps(
            {
                "rows": report.rows,
                "longest_prompt_tokens": report.longest_prompt,
                "check_s": round(report.seconds, 2),
                "check_s_per_million_rows": round(report.seconds / (report.rows / 1e6), 2),
                "file_mb": round(file_mb, 1),
                "write_s": round(written_s, 2),
                "cpus": os.cpu_count(),
                "load_average_1min": round(os.getloadavg()[0], 1),
            }
        )
    )


if __name__ == "__main__":
    main()
