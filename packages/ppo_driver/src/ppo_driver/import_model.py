"""``ppo-driver import-model SRC OUT``: a GGUF file or a Hugging Face folder to the folder a run loads.

The output is what ``model.path`` takes: ``config.json``, ``model.safetensors``, the tokenizer with
its chat template, and ``generation_config.json`` (its eos token ends the engines' responses). A GGUF
file is dequantized by transformers (``gguf_file=``, through the ``gguf`` package: the driver's
``import`` extra); transformers refuses ``save_pretrained`` on a model loaded that way (its config
still says "quantized"), so the model is rebuilt from its config, without the quantization entry, and
the loaded state dict. Then the folder is checked the way a run uses it: the actor (a causal LM), the
critic (the backbone and a value head) and the built-in engine load it, and the engine answers one
prompt through the chat template. Nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ppo_weight_sync.families import ModelFamily, family_of_config

__all__ = [
    "CheckResult",
    "ImportReport",
    "Source",
    "check_folder",
    "check_source",
    "import_model",
    "resolve_source",
]

DType = Literal["float32", "bfloat16"]
CHECK_QUESTION = "What is 2 + 3?"


@dataclass(frozen=True)
class Source:
    """Where the weights come from: a GGUF file (``folder/gguf_file``) or a Hugging Face folder."""

    kind: Literal["gguf", "hf"]
    folder: Path
    gguf_file: str | None = None


@dataclass(frozen=True)
class CheckResult:
    """What loading the folder as a run does saw: the eos tokens, the critic's values' shape for the
    check prompt, and the engine's greedy answer to it."""

    eos_token_ids: tuple[int, ...]
    critic_values_shape: tuple[int, ...]
    prompt: str
    answer: str


@dataclass(frozen=True)
class ImportReport:
    """What was written (``check`` is None when the checks were skipped)."""

    out: Path
    source: Source
    parameters: int
    dtype: DType
    chat_template: bool
    check: CheckResult | None
    family: str | None = None  # the model family's name (ppo_weight_sync.families), None: not in the table


def resolve_source(src: str | Path) -> Source:
    """A ``.gguf`` file, a folder holding exactly one, or a Hugging Face folder (``config.json``)."""
    path = Path(src)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: not a .gguf file; give a GGUF file or a Hugging Face model folder")
        return Source("gguf", path.parent, path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return Source("hf", path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return Source("gguf", path, ggufs[0].name)
        if ggufs:
            names = ", ".join(g.name for g in ggufs)
            raise ValueError(f"{path} holds several GGUF files ({names}); give the one to import")
        raise ValueError(
            f"{path} holds neither config.json (a Hugging Face folder) nor a .gguf file; give one of those"
        )
    raise ValueError(f"{path}: no such file or folder; give a GGUF file or a Hugging Face model folder")


def check_source(source: Source) -> None:
    """``ValueError`` in one line when a source file is cut short or its header is damaged: the
    GGUF file, or a folder's ``config.json`` and ``.safetensors`` files, each against its own table."""
    from ppo_driver.model_files import gguf_problem, safetensors_problem

    if source.kind == "gguf":
        try:
            import gguf  # noqa: F401 - its block sizes size the tensors
        except ImportError:
            return  # _load says how to install it
        problem = gguf_problem(source.folder / (source.gguf_file or ""))
        if problem is not None:
            raise ValueError(f"{problem}; copy or download it again")
        return
    try:
        json.loads((source.folder / "config.json").read_text())
    except ValueError as exc:
        raise ValueError(
            f"{source.folder / 'config.json'} is not valid JSON ({exc}); copy or download it again"
        ) from None
    for weights in sorted(source.folder.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem is not None:
            raise ValueError(f"{problem}; copy or download it again")


def _load(source: Source) -> tuple[Any, Any]:
    """(the model in float32, the tokenizer), both from ``source``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per tensor group: noise in a CLI's output
    if source.kind == "hf":
        model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32)
        return model, AutoTokenizer.from_pretrained(source.folder)
    try:
        import gguf  # noqa: F401 - transformers needs it to read the file; fail early with the fix
    except ImportError:
        raise ValueError(
            "importing a GGUF file needs the `gguf` package: `uv sync` in this workspace installs it, "
            "elsewhere `pip install 'ppo-driver[import]'`"
        ) from None
    loaded = AutoModelForCausalLM.from_pretrained(
        source.folder, gguf_file=source.gguf_file, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file)
    # save_pretrained refuses a GGUF-loaded model: rebuild it from its config without the
    # quantization entry, and its (dequantized) weights.
    values = loaded.config.to_dict()
    values.pop("quantization_config", None)
    values.pop("_name_or_path", None)
    config = type(loaded.config).from_dict(values)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"{source.gguf_file}: the rebuilt model does not take the file's weights (missing "
            f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]})"
        )
    model.tie_weights()
    model.generation_config = loaded.generation_config
    return model, tokenizer


def import_model(
    src: str | Path, out: str | Path, *, dtype: DType = "float32", force: bool = False, check: bool = True
) -> ImportReport:
    """Write ``src`` (GGUF file or Hugging Face folder) to ``out`` as safetensors and check it loads.

    ``out`` must not exist (``force``: replace it). The folder is written beside ``out`` and renamed
    into place once complete, so a failed import leaves no half-written model behind.
    """
    import torch

    source = resolve_source(src)
    check_source(source)  # a damaged file is named now, not by a traceback from deep in the loader
    out = Path(out)
    if out.exists() and not force:
        raise ValueError(f"{out} already exists; remove it or pass --force to replace it")
    model, tokenizer = _load(source)
    family = family_of_config(model.config)
    _end_turns(model.generation_config, tokenizer, family)
    model = model.to(getattr(torch, dtype))
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        model.generation_config.save_pretrained(partial)
        result = check_folder(partial, dtype) if check else None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    parameters = sum(p.numel() for p in model.parameters())  # a tied embedding counts once
    chat = bool(tokenizer.chat_template)
    return ImportReport(out, source, parameters, dtype, chat, result, family.name if family else None)


def _end_turns(generation_config: Any, tokenizer: Any, family: ModelFamily | None) -> None:
    """Adds to the eos tokens the family's turn-end tokens (``ChatNotes.turn_end``) that the tokenizer's
    chat template writes: a response that ends its turn then ends (Gemma's ``<end_of_turn>``, which a
    GGUF file's ``eos_token_id`` leaves out)."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    if family is None or not template:
        return
    eos = generation_config.eos_token_id
    before = [] if eos is None else [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
    ids = list(before)
    for token in family.chat.turn_end:
        token_id = tokenizer.convert_tokens_to_ids(token) if token in template else None
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token_id not in ids:
            ids.append(token_id)
    if ids != before:
        generation_config.eos_token_id = ids


def check_folder(folder: Path, dtype: DType) -> CheckResult:
    """Load ``folder`` as the actor, the critic and the built-in engine do; one greedy answer."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from ppo_rollout.config import SamplingConfig
    from ppo_rollout.data import PromptRenderer
    from ppo_rollout.engine.builtin import BuiltinEngine
    from ppo_trainer.models import load_causal_lm, load_critic

    tokenizer = AutoTokenizer.from_pretrained(folder)
    chat = bool(tokenizer.chat_template)
    renderer = PromptRenderer(tokenizer, "prompt", chat_template=chat)
    prompt = renderer.render({"prompt": CHECK_QUESTION})
    ids = renderer.encode(prompt)

    actor = load_causal_lm(folder, seed=0)
    critic = load_critic(folder, seed=0)
    with torch.no_grad():
        values = critic(torch.tensor([ids]))
        actor_logits = actor(torch.tensor([ids])).logits[0, -1]
    if values.shape != (1, len(ids)) or not torch.isfinite(values).all():
        raise ValueError(f"{folder}: the critic gives values of shape {tuple(values.shape)} (or non-finite)")
    del critic

    engine = BuiltinEngine(folder, "cpu", dtype, name="import-check")
    engine_state = dict(engine.named_tensors())
    for name, tensor in actor.state_dict().items():
        theirs = engine_state.get(name)
        if theirs is None or not torch.equal(theirs, tensor.to(theirs.dtype)):
            raise ValueError(f"{folder}: the engine's {name!r} differs from the actor's")
    out = engine.generate([ids], SamplingConfig(temperature=0.0, max_new_tokens=24), seed=0)[0]
    del engine
    eos = GenerationConfig.from_pretrained(folder).eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    if not eos_ids:
        raise ValueError(f"{folder}: generation_config.json names no eos_token_id; responses would never end")
    if not torch.isfinite(actor_logits).all():
        raise ValueError(f"{folder}: the actor's logits are not finite")
    answer = str(tokenizer.decode(list(out.token_ids), skip_special_tokens=True))
    return CheckResult(eos_ids, tuple(values.shape), prompt, answer)
