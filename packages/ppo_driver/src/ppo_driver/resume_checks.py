"""What a resume must refuse, found before Ray starts from the latest complete checkpoint's
``driver.json`` (no tensor is read, nothing is imported but the dataset reader):

- the checkpoint was written by another run (two run folders sharing one ``checkpoint.dir``);
- the model changed shape (``model.path`` now holds another architecture, or ``model.tiny`` changed);
- the training file changed under the saved data position (row count and content hash);
- the learning rate would rise again: a resume never sets a rate above the last one trained with
  (outside warm-up), which is what raising ``train.steps`` on a cosine schedule would do.

Each refusal is one line naming the field and the fix; ``checkpoint.accept_changes`` names the
changes a user makes on purpose (``dataset``, ``lr_rise``, ``other_run``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ppo_driver.config import ConfigError, RunConfig
from ppo_trainer.lr_schedule import lr_factor

# The checkpoint layout (checkpoint.py, which imports torch: this module must not).
_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_MARKER = "COMPLETE"

# config.json keys that fix the weights' shapes.
SHAPE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)


def latest_checkpoint(ckpt_root: Path) -> tuple[int, Path] | None:
    if not ckpt_root.is_dir():
        return None
    found = [
        (int(m.group(1)), child)
        for child in ckpt_root.iterdir()
        if (m := _STEP_DIR.match(child.name)) and (child / _MARKER).is_file()
    ]
    return max(found) if found else None


def check(config: RunConfig, run_dir: Path, ckpt_root: Path) -> None:
    """``ConfigError`` (one line per refusal) when resuming from ``ckpt_root`` would silently mix
    runs, models, data or learning rates; nothing when there is no checkpoint or resume is off."""
    if not config.checkpoint.resume:
        return
    found = latest_checkpoint(ckpt_root)
    if found is None:
        return
    step, folder = found
    try:
        doc = json.loads((folder / "driver.json").read_text())
    except (OSError, ValueError):
        return  # the resume reports an unreadable checkpoint and falls back to an earlier one
    if not isinstance(doc, dict):
        return
    extra = _mapping(doc.get("extra"))
    saved = _mapping(extra.get("config"))
    accepted = set(config.checkpoint.accept_changes)
    problems = []
    if "other_run" not in accepted:
        problems += _other_run(extra.get("run_dir"), run_dir, ckpt_root, step)
    problems += _model_shape(saved, config, folder)
    problems += _lora(saved, config, folder)
    if "dataset" not in accepted:
        problems += _dataset(doc.get("rollout"), config, folder)
    if "lr_rise" not in accepted:
        problems += _lr_rise(saved, config, step)
    if problems:
        n = len(problems)
        raise ConfigError(
            f"cannot resume ({n} problem{'s' if n > 1 else ''}):\n" + "\n".join(f"  - {p}" for p in problems)
        )


def _mapping(value: Any) -> dict[str, Any]:
    """A JSON object of driver.json, or {} for anything else (an older or damaged file)."""
    return value if isinstance(value, dict) else {}


def _other_run(writer: Any, run_dir: Path, ckpt_root: Path, step: int) -> list[str]:
    """A checkpoint written by a run in another folder that still exists: two runs share one
    ``checkpoint.dir``. (A moved run folder leaves no folder at the old path, and a copied one holds
    its checkpoints inside it: both resume.)"""
    if ckpt_root.resolve().is_relative_to(run_dir.resolve()):
        return []
    if not isinstance(writer, str) or Path(writer) == run_dir.resolve() or not Path(writer).is_dir():
        return []
    return [
        f"checkpoint.dir {ckpt_root} holds the checkpoints of the run in {writer} (step {step}), not of "
        f"this run ({run_dir.resolve()}); give each run its own checkpoint.dir, or set "
        "checkpoint.accept_changes=[other_run] to continue that run's training here"
    ]


def _model_shape(saved: Mapping[str, Any], config: RunConfig, folder: Path) -> list[str]:
    model = saved.get("model") if isinstance(saved.get("model"), dict) else None
    if model is None:
        return []
    fix = f"set it back, or set checkpoint.resume=false (or another run folder) to start a new run; {folder}"
    tiny = model.get("tiny") if isinstance(model.get("tiny"), dict) else {}
    if model.get("path") is None and config.model.path is None:
        now = config.model.tiny.model_dump()
        changed = [k for k in sorted(now) if k in tiny and tiny[k] != now[k]]
        if changed:
            k = changed[0]
            return [
                f"model.tiny.{k} is {now[k]}, the checkpoint's model has {tiny[k]}: its weights do not fit; "
                + fix
            ]
        return []
    before, after = model.get("path"), config.model.path
    if before == after:
        return []
    if before is None or after is None:
        what = "the built-in tiny model" if before is None else f"model.path={before!r}"
        return [f"model.path is {after!r}; the checkpoint was written with {what}: {fix}"]
    old, new = _shape(Path(before)), _shape(Path(after))
    if old is None or new is None:
        return []  # nothing to compare: loading the weights tells
    diff = [k for k in SHAPE_KEYS if old.get(k) != new.get(k)]
    if not diff:
        return []  # the same model in another folder
    k = diff[0]
    return [
        f"model.path changed from {before!r} to {after!r}, a model of another shape ({k} "
        f"{old.get(k)!r} -> {new.get(k)!r}), whose weights the checkpoint's do not fit; {fix}"
    ]


def _shape(folder: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((folder.expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    return text if isinstance(text, dict) and "hidden_size" not in config else config


def _dataset(rollout: Any, config: RunConfig, folder: Path) -> list[str]:
    data = rollout.get("data") if isinstance(rollout, dict) else None
    dataset = config.rollout.dataset
    if not isinstance(data, dict) or data.get("kind") != "jsonl" or dataset is None:
        return []
    from ppo_rollout.data import CHANGED_FIX, JsonlPrompts, dataset_change

    try:
        now = JsonlPrompts(dataset, config.rollout.prompt_field, config.train.seed, messages_ok=True)
    except (OSError, ValueError):
        return []  # pre-flight has named the file's problem
    problem = dataset_change(data, len(now.rows), now.sha256)
    if problem is None:
        return []
    return [f"rollout.dataset {dataset}: {problem} ({folder}); {CHANGED_FIX}"]


def _lora(saved: Mapping[str, Any], config: RunConfig, folder: Path) -> list[str]:
    """``train.lora`` set, unset or changed: the checkpoint's tensors (adapters, their AdamW state) and
    what they compute belong to the other setting. ``dropout`` may change (it holds no tensor)."""
    train = saved.get("train") if isinstance(saved.get("train"), dict) else None
    if train is None or "lora" not in train:
        return []
    before = train["lora"] if isinstance(train["lora"], dict) else None
    now = config.model_dump(mode="json")["train"]["lora"]
    keys = ("rank", "alpha", "target_modules", "roles")
    if before is None and now is None:
        return []
    if before is not None and now is not None and all(before.get(k) == now[k] for k in keys):
        return []
    return [
        f"train.lora is {_lora_text(now)}; the checkpoint was trained with {_lora_text(before)}: its "
        f"weights and optimizer state belong to that setting; set it back, or set checkpoint.resume=false "
        f"(or another run folder) to start a new run; {folder}"
    ]


def _lora_text(value: Mapping[str, Any] | None) -> str:
    if value is None:
        return "null (every weight trains)"
    return "{" + ", ".join(f"{k}: {value.get(k)}" for k in ("rank", "alpha", "target_modules", "roles")) + "}"


def _lr_rise(saved: Mapping[str, Any], config: RunConfig, step: int) -> list[str]:
    """The factor of the first resumed step under the new settings against the last one trained."""
    train = saved.get("train") if isinstance(saved.get("train"), dict) else None
    t = config.train
    if train is None or step >= t.steps:
        return []
    try:
        before = lr_factor(
            max(step, 1),
            schedule=train["lr_schedule"],
            warmup_steps=int(train["lr_warmup_steps"]),
            total_steps=int(train["steps"]),
            min_lr_ratio=float(train["min_lr_ratio"]),
        )
    except (KeyError, TypeError, ValueError):
        return []
    if step < int(train["lr_warmup_steps"]):
        return []  # still warming up: the rate rises by design
    after = lr_factor(
        step + 1,
        schedule=t.lr_schedule,
        warmup_steps=t.lr_warmup_steps,
        total_steps=t.steps,
        min_lr_ratio=t.min_lr_ratio,
    )
    if after <= before + 1e-9:
        return []
    return [
        f"train.steps={t.steps} (the checkpoint's run: {train['steps']}) with train.lr_schedule="
        f"{t.lr_schedule!r} would raise the learning rate from {before:.3g} to {after:.3g} x its base at "
        f"step {step + 1}, so the schedule re-warms; keep train.steps={train['steps']} and the schedule, "
        "or set checkpoint.accept_changes=[lr_rise] to train on with the new schedule"
    ]
