"""Checkpoint folders: written to a temporary folder, renamed into place, found again on resume.

Layout of one checkpoint, ``<dir>/step_000010/``::

    driver.json          step, config digest, rollout state (data position), RNG seeds and states
    driver.safetensors   tensors of the driver state (torch RNG state, tensors of the rollout state)
    actor/  critic/      written by ``TrainGroup.save`` (model, optimizer, RNG of each worker)
    COMPLETE             written last, before the rename; a folder without it is ignored. It
                         lists every file's size, so a file cut short later is found before loading

Every file and folder is fsynced before COMPLETE is written, and the folder after its rename, so a
power cut or a SIGKILL at any moment leaves the latest complete checkpoint whole. A checkpoint that
fails ``verify`` (a file missing or of the wrong size, JSON that does not parse) is skipped by the
loop for the previous one. Nothing here unpickles: JSON for structure, safetensors for tensors.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

STEP_DIR = re.compile(r"^step_(\d{6,})$")
MARKER = "COMPLETE"
FORMAT_VERSION = 1


def step_folder(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of each complete checkpoint under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / MARKER).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_complete(root: Path) -> tuple[int, Path] | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


class CheckpointError(RuntimeError):
    """A checkpoint folder that cannot be used: the message names the folder and what is wrong."""


class DiskFullError(OSError):
    """No space left on the device of a run or checkpoint folder; the message names the folder."""


def write_checkpoint(
    root: Path, step: int, write: Callable[[Path], None], *, keep: int | None = None
) -> Path:
    """Call ``write(tmp)`` to fill a temporary folder, mark it complete, rename it to ``step_N``.

    A crash anywhere before the rename leaves only a ``.tmp-`` folder, which discovery ignores and
    the next save of the same step removes. Files are fsynced before the marker, the marker before
    the rename, the parent folder after it. ``keep`` prunes complete checkpoints of earlier steps
    (never a later one: those belong to another run, which the loop moves aside first).
    """
    pending = PendingCheckpoint(root, step)
    with pending.writing():
        write(pending.tmp)
    return pending.finish(keep=keep)


class PendingCheckpoint:
    """A checkpoint whose files are being written into ``tmp``; ``finish`` marks it complete.

    Writing may be spread over time and processes (roles write their folders in the background):
    until ``finish`` the folder is a ``.tmp-`` one, which discovery ignores; ``discard`` (or a crash)
    leaves nothing a resume would take.
    """

    def __init__(self, root: Path, step: int) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.step = step
        self.final = step_folder(root, step)
        self.tmp = root / f".tmp-{self.final.name}"
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Around writes into ``tmp``: a failure removes it (a full disk becomes ``DiskFullError``)."""
        try:
            yield
        except BaseException as exc:
            self._fail(exc)
            raise

    def finish(self, *, keep: int | None = None) -> Path:
        """fsync every file, write COMPLETE, rename into place, prune; the final folder."""
        with self.writing():
            sizes = _fsync_tree(self.tmp)
            _write_synced(
                self.tmp / MARKER, json.dumps({"step": self.step, "format": FORMAT_VERSION, "files": sizes})
            )
            _fsync_dir(self.tmp)
        root, final, tmp = self.root, self.final, self.tmp
        if final.exists():  # a re-run of the same step replaces its checkpoint
            old = root / f".old-{final.name}"
            if old.exists():
                shutil.rmtree(old)
            final.rename(old)
            tmp.rename(final)
            _fsync_dir(root)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
            _fsync_dir(root)
        if keep is not None:
            earlier = [c for c in complete_checkpoints(root) if c[0] <= self.step]
            for _, folder in earlier[:-keep]:
                shutil.rmtree(folder, ignore_errors=True)
        return final

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _fail(self, exc: BaseException) -> None:
        self.discard()  # also frees the space a full disk needs back
        if is_disk_full(exc):
            raise DiskFullError(
                errno.ENOSPC,
                f"no space left on the device of {self.root} while saving the step-{self.step} checkpoint; "
                "free space there or set checkpoint.dir to a folder on another disk",
            ) from exc


def remove_unfinished(root: Path) -> list[Path]:
    """Remove ``.tmp-`` folders of checkpoints a run started and never finished (it died or failed
    during a save); the run lock makes sure no other run is writing them. Returns what was removed."""
    if not root.is_dir():
        return []
    gone = [c for c in root.iterdir() if c.name.startswith(".tmp-step_") and c.is_dir()]
    for folder in gone:
        shutil.rmtree(folder, ignore_errors=True)
    return gone


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC anywhere in the cause chain, or the messages torch and Ray give for it.

    torch's writer reports a full disk as "unexpected pos ..." and a Ray worker's ``OSError`` arrives
    as text inside a ``RayTaskError``, so the text is all there is to go on for those.
    """
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        text = str(seen)
        if "No space left on device" in text or "unexpected pos" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def verify(folder: Path) -> None:
    """Raise ``CheckpointError`` when ``folder`` is not whole: every file COMPLETE lists is present with
    its size, and every JSON file parses. A marker without a file list (older drivers) checks JSON only."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {folder}: {MARKER} does not parse ({exc})") from None
    if not isinstance(marker, dict):
        raise CheckpointError(f"checkpoint {folder}: {MARKER} holds {type(marker).__name__}, not a mapping")
    for name, size in (marker.get("files") or {}).items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {folder}: {name} is missing")
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"checkpoint {folder}: {name} has {actual} bytes, {size} were written (cut short?)"
            )
    for path in sorted(folder.rglob("*.json")):
        try:
            json.loads(path.read_text())
        except ValueError as exc:
            raise CheckpointError(
                f"checkpoint {folder}: {path.relative_to(folder)} is not valid JSON ({exc})"
            ) from None


def move_aside(root: Path) -> Path | None:
    """Rename ``root`` (an older run's checkpoints) to ``<root>.before-<time>``; None if it holds none.

    A run started with ``checkpoint.resume=false`` must not mix its checkpoints with an older run's:
    pruning and the next resume go by step number, and the older run's later steps would win.
    """
    if not any(True for _ in _step_folders(root)):
        return None
    aside = root.with_name(f"{root.name}.before-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while aside.exists():
        n += 1
        aside = root.with_name(f"{root.name}.before-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
    root.rename(aside)
    return aside


def _step_folders(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [c for c in root.iterdir() if STEP_DIR.match(c.name) or c.name.startswith((".tmp-", ".old-"))]


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> dict[str, int]:
    """fsync every file and folder under ``folder`` (deepest first); return each file's size."""
    sizes: dict[str, int] = {}
    for here, _dirs, files in os.walk(folder, topdown=False):
        for name in files:
            path = Path(here) / name
            with path.open("rb") as f:
                os.fsync(f.fileno())
            sizes[str(path.relative_to(folder))] = path.stat().st_size
        _fsync_dir(Path(here))
    return dict(sorted(sizes.items()))


# --- driver state: JSON + safetensors ---------------------------------------------------------


@dataclass(frozen=True)
class DriverState:
    step: int  # last completed step
    rollout: Mapping[str, Any]  # RolloutManager.state_dict()
    extra: Mapping[str, Any]  # e.g. the config digest, wall time


def capture_rng() -> dict[str, Any]:
    """Python, numpy and torch RNG states of the driver process."""
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # legacy=True always returns the tuple form
    return {
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
        "numpy": {
            "kind": np_state[0],
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.uint32).view(np.int32).copy()),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }


def restore_rng(state: Mapping[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npy = state["numpy"]
    keys = npy["keys"].numpy().view(np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])


def save_driver_state(folder: Path, state: DriverState) -> None:
    tensors: dict[str, torch.Tensor] = {}
    doc = {
        "format": FORMAT_VERSION,
        "step": state.step,
        "rollout": _split(state.rollout, "rollout", tensors),
        "rng": _split(capture_rng(), "rng", tensors),
        "extra": _split(state.extra, "extra", tensors),
    }
    (folder / "driver.json").write_text(json.dumps(doc, indent=1) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "driver.safetensors"))


def load_driver_state(folder: Path, *, restore_driver_rng: bool = True) -> DriverState:
    try:
        doc = json.loads((folder / "driver.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {folder}: driver.json cannot be read ({exc})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"checkpoint {folder}: driver.json holds {type(doc).__name__}, not a mapping")
    if doc.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {folder} has format {doc.get('format')!r}, this driver reads {FORMAT_VERSION}; "
            "resume it with the driver version that wrote it, or start a new run (checkpoint.resume=false)"
        )
    tensors = load_file(str(folder / "driver.safetensors"))
    if restore_driver_rng:
        restore_rng(_join(doc["rng"], tensors))
    return DriverState(
        step=int(doc["step"]), rollout=_join(doc["rollout"], tensors), extra=_join(doc["extra"], tensors)
    )


# Tensors are replaced in the JSON tree by {"__tensor__": key} and stored in safetensors; tuples
# come back as lists. Anything else that JSON cannot hold is an error, never a pickle.
def _split(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().cpu()
        return {"__tensor__": path}
    if isinstance(obj, np.ndarray):
        tensors[path] = torch.from_numpy(obj.copy())
        return {"__tensor__": path, "numpy": True}
    if isinstance(obj, Mapping):
        out = {}
        for key, value in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"checkpoint state {path}: key {key!r} is not a string")
            out[key] = _split(value, f"{path}.{key}", tensors)
        return out
    if isinstance(obj, list | tuple):
        return [_split(value, f"{path}.{i}", tensors) for i, value in enumerate(obj)]
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"checkpoint state {path}: {type(obj).__name__} is not JSON or a tensor")


def _join(obj: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            tensor = tensors[obj["__tensor__"]]
            return tensor.numpy() if obj.get("numpy") else tensor
        return {key: _join(value, tensors) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_join(value, tensors) for value in obj]
    return obj
