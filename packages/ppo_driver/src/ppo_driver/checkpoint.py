"""Checkpoint folders: written to a temporary folder, renamed into place, found again on resume.

Layout of one checkpoint, ``<dir>/step_000010/``::

    driver.json          step, config digest, rollout state (data position), RNG seeds and states
    driver.safetensors   tensors of the driver state (torch RNG state, tensors of the rollout state)
    actor/  critic/      written by ``TrainGroup.save`` (model, optimizer, RNG of each worker)
    COMPLETE             written last, before the rename; a folder without it is ignored. It
                         lists every file's size and SHA-256, so a file cut short or changed later
                         (even at the same size) is found before loading

Every file and folder is fsynced before COMPLETE is written, and the folder after its rename, so a
power cut or a SIGKILL at any moment leaves the latest complete checkpoint whole. A checkpoint that
fails ``verify`` (a file missing, of the wrong size or with other content, JSON that does not parse)
is skipped by the loop for the previous one. Nothing here unpickles: JSON for structure, safetensors
for tensors.

The hashes are taken from the files as written (read back from the page cache while they are
fsynced), one thread per file; SHA-256 costs about 0.9 s per GB on one core of a 2-core Xeon,
0.5 s per GB with two files on two cores (docs/benchmarks/ppo_driver.md has the figures), paid when a
checkpoint completes and again when a resume verifies it (in the background, while Ray and the roles
start).
"""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import json
import os
import random
import re
import shutil
import threading
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


def unmarked_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of each ``step_N`` folder without a COMPLETE marker, oldest first.

    The loop never leaves one (an unfinished save is a ``.tmp-`` folder until its marker is written):
    such a folder was copied in part or had its marker removed, and resume skips it with a warning.
    """
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir() and not (child / MARKER).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


class CheckpointError(RuntimeError):
    """A checkpoint folder that cannot be used: the message names the folder and what is wrong."""


class DiskFullError(OSError):
    """No space left on the device of a run or checkpoint folder; the message names the folder, the
    space free there and about how much a checkpoint needs."""


def disk_full(folder: Path, needed: int | None, when: str) -> DiskFullError:
    """The report of a full disk under ``folder``: what is free there, what a checkpoint needs."""
    free = free_bytes(folder)
    sizes = f"{_mb(free)} free" + (f", about {_mb(needed)} needed for a checkpoint" if needed else "")
    return DiskFullError(
        errno.ENOSPC,
        f"no space left on device in {folder} ({sizes}) {when}; free space there, lower checkpoint.keep, "
        "or set checkpoint.dir to a folder on another disk",
    )


def free_bytes(folder: Path) -> int:
    """Bytes free to this user on the device of ``folder`` (or of its nearest existing parent)."""
    probe = folder
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def checkpoint_bytes(root: Path) -> int | None:
    """The size of the latest complete checkpoint under ``root`` (what the next save will about
    write); None when there is none."""
    found = latest_complete(root)
    return _tree_bytes(found[1]) if found is not None else None


def check_space(root: Path, needed: int | None) -> None:
    """Raise ``DiskFullError`` when the device of ``root`` has less than ``needed`` bytes free: a save
    of that size would fail there (start-up's check, before anything starts)."""
    if needed is not None and free_bytes(root) < needed:
        raise disk_full(root, needed, "for the run's next checkpoint")


def _tree_bytes(folder: Path) -> int:
    total = 0
    for here, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += (Path(here) / name).stat().st_size
            except OSError:  # removed meanwhile
                continue
    return total


def _mb(n: int) -> str:
    if n >= 10e6:
        return f"{n / 1e6:.0f} MB"
    if n >= 1e6:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e3:.0f} kB" if n >= 1e3 else f"{n} B"


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
            files = _fsync_tree(self.tmp)
            _write_synced(
                self.tmp / MARKER, json.dumps({"step": self.step, "format": FORMAT_VERSION, "files": files})
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
        written = _tree_bytes(self.tmp)
        self.discard()  # also frees the space a full disk needs back
        if is_disk_full(exc) and not isinstance(exc, DiskFullError):
            needed = max(written, checkpoint_bytes(self.root) or 0)
            raise disk_full(self.root, needed, f"while saving the step-{self.step} checkpoint") from exc


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
    """Raise ``CheckpointError`` when ``folder`` is not whole, naming every problem: a file COMPLETE
    lists that is missing or of another size, JSON that does not parse, a file whose SHA-256 is not
    the one COMPLETE records. A marker without hashes, or without a file list (as older drivers wrote
    it), checks what it records. Hashes are checked last, and only of files found whole so far."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {folder}: {MARKER} does not parse ({exc})") from None
    if not isinstance(marker, dict):
        raise CheckpointError(f"checkpoint {folder}: {MARKER} holds {type(marker).__name__}, not a mapping")
    try:
        listed = {name: FileRecord.parse(entry) for name, entry in (marker.get("files") or {}).items()}
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {folder}: {exc}") from None
    problems: dict[str, str] = {}  # by file, in the order found
    for name, record in listed.items():
        path = folder / name
        if not path.is_file():
            problems[name] = f"{name} is missing"
        elif (actual := path.stat().st_size) != record.size:
            problems[name] = f"{name} has {actual} bytes, {record.size} were written (cut short?)"
    for path in sorted(folder.rglob("*.json")):
        name = str(path.relative_to(folder))
        try:
            json.loads(path.read_text())
        except ValueError as exc:
            problems.setdefault(name, f"{name} is not valid JSON ({exc})")
    hashed = {n: r.sha256 for n, r in listed.items() if r.sha256 is not None and n not in problems}
    for name, digest in _hash_files(folder, list(hashed)).items():
        if digest != hashed[name]:
            problems[name] = (
                f"{name} is not the file that was written (same size, other SHA-256: changed on disk)"
            )
    if problems:
        raise CheckpointError(f"checkpoint {folder}: {'; '.join(problems.values())}")


class BackgroundVerify:
    """``verify`` of the complete checkpoints under ``root``, newest first until one is whole, in a
    daemon thread started before Ray: the hashing overlaps the roles' start-up, and a run that stops
    meanwhile does not wait for it. ``check`` gives a folder's verdict (verifying it now if the thread
    did not get to it)."""

    def __init__(self, root: Path) -> None:
        self._candidates = [folder for _, folder in reversed(complete_checkpoints(root))]
        self._verdicts: dict[Path, CheckpointError | None] = {}
        self._done = threading.Event()
        threading.Thread(target=self._run, name="verify-checkpoints", daemon=True).start()

    def _run(self) -> None:
        try:
            for folder in self._candidates:
                try:
                    verify(folder)
                except CheckpointError as exc:
                    self._verdicts[folder] = exc
                    continue
                except OSError as exc:  # unreadable: the loop's own check reports it
                    self._verdicts[folder] = CheckpointError(f"checkpoint {folder}: {exc}")
                    continue
                self._verdicts[folder] = None
                return
        finally:
            self._done.set()

    def check(self, folder: Path) -> None:
        """Raise the folder's ``CheckpointError``, if it has one."""
        self._done.wait()  # local files only: as long as reading them takes
        if folder not in self._verdicts:
            verify(folder)
            return
        error = self._verdicts[folder]
        if error is not None:
            raise error


@dataclass(frozen=True)
class FileRecord:
    """What COMPLETE records of one file: its size, and its SHA-256 (None in older markers)."""

    size: int
    sha256: str | None = None

    @staticmethod
    def parse(entry: Any) -> FileRecord:
        if isinstance(entry, int):  # drivers before the hashes recorded the size alone
            return FileRecord(entry)
        if isinstance(entry, dict) and isinstance(entry.get("size"), int):
            digest = entry.get("sha256")
            return FileRecord(entry["size"], digest if isinstance(digest, str) else None)
        raise CheckpointError(f"{MARKER} lists a file as {entry!r}, not its size and hash")


# Files are hashed in chunks of this size; hashlib releases the GIL for each, so one thread per file
# hashes several files at once.
_HASH_CHUNK = 8 * 1024 * 1024
_HASH_THREADS = max(1, min(8, os.cpu_count() or 1))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _hash_files(folder: Path, names: list[str]) -> dict[str, str]:
    """SHA-256 of each of ``names`` (paths relative to ``folder``), hashed in parallel."""
    if not names:
        return {}
    with concurrent.futures.ThreadPoolExecutor(min(_HASH_THREADS, len(names))) as pool:
        return dict(zip(names, pool.map(lambda n: file_sha256(folder / n), names), strict=True))


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


def _fsync_tree(folder: Path) -> dict[str, dict[str, Any]]:
    """fsync every file and folder under ``folder`` (deepest first); return each file's size and
    SHA-256 (read back while it is fsynced: the bytes just written are still in the page cache)."""
    paths: list[Path] = []
    for here, _dirs, files in os.walk(folder, topdown=False):
        paths.extend(Path(here) / name for name in files)

    def sync_and_hash(path: Path) -> dict[str, Any]:
        with path.open("rb") as f:
            os.fsync(f.fileno())
        return {"size": path.stat().st_size, "sha256": file_sha256(path)}

    records: dict[str, dict[str, Any]] = {}
    if paths:
        with concurrent.futures.ThreadPoolExecutor(min(_HASH_THREADS, len(paths))) as pool:
            for path, record in zip(paths, pool.map(sync_and_hash, paths), strict=True):
                records[str(path.relative_to(folder))] = record
    for here, _dirs, _files in os.walk(folder, topdown=False):
        _fsync_dir(Path(here))
    return dict(sorted(records.items()))


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
