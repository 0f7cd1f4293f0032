"""BFCL multi-turn questions as the rows a run reads: a training and a held-out JSONL file.

    python -m ppo_rollout.environments.bfcl.dataset --out data/bfcl/base \\
        --category multi_turn_base --held-out 0.2 --split-seed 0 --docs compact

writes ``train.jsonl`` and ``eval.jsonl`` under ``--out`` (``rollout.dataset`` and
``rollout.eval_dataset``, with ``rollout.chat_template: true``). Each row is ``{"prompt": [system
prompt with the function docs, first user turn], "id": <BFCL id>, "call_format", "docs"}``; the
``bfcl_multi_turn`` environment reads the rest of the question from the package by its id. The split
is by question number (``data.split_ids``): the same ``--held-out`` and ``--split-seed`` hold out the
same questions in every category. With ``--tokenizer`` and ``--max-prompt-tokens``, questions whose
rendered prompt is longer are left out of both files (and counted).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .data import CATEGORIES, question, questions, split_ids
from .prompts import PromptStyle, first_messages

__all__ = ["main", "row", "write_split"]


def row(question_id: str, style: PromptStyle) -> dict[str, Any]:
    """The dataset row of one question."""
    return {
        "prompt": first_messages(question(question_id), style),
        "id": question_id,
        "call_format": style.calls,
        "docs": style.docs,
    }


def write_split(
    out: Path,
    categories: Sequence[str],
    *,
    held_out: float,
    seed: int,
    style: PromptStyle,
    max_prompt_tokens: int | None = None,
    tokenizer: Any = None,
) -> dict[str, int]:
    """Write ``out/train.jsonl`` and ``out/eval.jsonl``; the rows written to each and the rows left out
    as too long."""
    ids = [qid for category in categories for qid in questions(category)]
    train, evaluation = split_ids(ids, held_out, seed)
    out.mkdir(parents=True, exist_ok=True)
    counts = {"too_long": 0}
    for name, chosen in (("train", train), ("eval", evaluation)):
        rows = [row(qid, style) for qid in chosen]
        if max_prompt_tokens is not None:
            kept = [r for r in rows if _prompt_tokens(tokenizer, r) <= max_prompt_tokens]
            counts["too_long"] += len(rows) - len(kept)
            rows = kept
        with (out / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        counts[name] = len(rows)
    return counts


def _prompt_tokens(tokenizer: Any, row: dict[str, Any]) -> int:
    ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"] if isinstance(ids, dict) else ids)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ppo_rollout.environments.bfcl.dataset", description=__doc__
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for train.jsonl and eval.jsonl")
    parser.add_argument("--category", action="append", choices=CATEGORIES, help="repeat for several")
    parser.add_argument("--held-out", type=float, default=0.2, help="share of questions held out (0.2)")
    parser.add_argument("--split-seed", type=int, default=0, help="seed of the held-out split (0)")
    parser.add_argument("--calls", choices=("python", "json"), default="python", help="call format asked")
    parser.add_argument("--docs", choices=("bfcl", "compact"), default="bfcl", help="function docs style")
    parser.add_argument("--tokenizer", help="a model folder: leave out prompts over --max-prompt-tokens")
    parser.add_argument("--max-prompt-tokens", type=int, help="with --tokenizer")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if (args.tokenizer is None) != (args.max_prompt_tokens is None):
        raise SystemExit("--tokenizer and --max-prompt-tokens go together: give both or neither")
    tokenizer = None
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    counts = write_split(
        args.out,
        args.category or ["multi_turn_base"],
        held_out=args.held_out,
        seed=args.split_seed,
        style=PromptStyle(calls=args.calls, docs=args.docs),
        max_prompt_tokens=args.max_prompt_tokens,
        tokenizer=tokenizer,
    )
    print(
        f"{args.out / 'train.jsonl'}: {counts['train']} rows; {args.out / 'eval.jsonl'}: {counts['eval']} "
        f"rows; {counts['too_long']} left out as longer than --max-prompt-tokens"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
