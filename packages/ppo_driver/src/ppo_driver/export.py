"""The trained model of a run, as a Hugging Face folder: ``hf_folder("runs/latest")``.

Each complete checkpoint holds ``actor/hf/`` (``save_pretrained`` output and the tokenizer files);
``hf_folder`` finds the latest one (or a given step's) so that a script needs no step number::

    from transformers import AutoModelForCausalLM
    from ppo_driver.export import hf_folder

    model = AutoModelForCausalLM.from_pretrained(hf_folder("runs/latest"))

A folder that holds no such export stops a script with one line (``NoExport``, a ``SystemExit``)
naming the folder and what it lacks, instead of transformers' traceback for a name that is neither a
folder nor a Hub id.
"""

from __future__ import annotations

from pathlib import Path

from ppo_driver import checkpoint

__all__ = ["NoExport", "hf_folder"]


class NoExport(SystemExit):
    """The folder holds no exported model; ``str()`` is one line. A ``SystemExit``: a script that does
    not catch it ends with that line alone (exit status 1), no traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


def hf_folder(run: str | Path, step: int | None = None) -> Path:
    """``actor/hf`` of the latest complete checkpoint of ``run`` (a run folder, or its checkpoint
    folder), or of checkpoint ``step``."""
    folder = Path(run).expanduser()
    if not folder.is_dir():
        raise NoExport(
            f"{run} is not a folder; give a run folder (`ppo-driver train` prints it; runs/latest is "
            "the newest under runs/)"
        )
    root = folder / "checkpoints" if (folder / "checkpoints").is_dir() else folder
    found = dict(checkpoint.complete_checkpoints(root))
    if not found:
        raise NoExport(
            f"{run} holds no complete checkpoint (no {root}/step_NNNNNN/COMPLETE); give a run folder whose "
            "run saved one (checkpoint.interval, and the last step's save)"
        )
    if step is not None and step not in found:
        raise NoExport(f"{run} has no complete checkpoint of step {step}; it has steps {sorted(found)}")
    chosen = found[step if step is not None else max(found)]
    hf = chosen / "actor" / "hf"
    if not (hf / "config.json").is_file():
        raise NoExport(f"{chosen} holds no actor/hf export (a checkpoint written without it); pick another")
    return hf
