"""Before any role starts on a Ray cluster: every node sees the folders the roles read and write.

The roles' processes read the model folder and write (and, on resume, read) the checkpoint folder on
whatever node Ray placed them; a folder that exists only on the driver's machine, or a node-local
folder of the same name, fails minutes into a run, or worse, at the first resume. One small task per
alive node (no CPU asked, pinned to the node) looks for:

- the run folder and the checkpoint folder: a file the driver just wrote there, with a random token,
  must be read back with that token (a folder of the same path on the node's own disk does not have it);
- the model folder (``model.path``, or the built-in tiny model written into the run folder): it exists.

The dataset and the reward module are not looked for on the nodes: the rollout manager, which reads
the prompts and calls the reward function, runs in the driver's process; ``preflight.py`` checks both
there. A local run (no ``ray.address``) is this machine alone: nothing to check.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ppo_placement import node_key

if TYPE_CHECKING:  # the nodes' task imports this module: it stays light (no torch, no pydantic)
    from ppo_driver.config import RunConfig

TOKEN_FILE = ".cluster-check"


class SharedStorageError(RuntimeError):
    """A node does not see a folder the run needs on every node."""


@dataclass(frozen=True)
class Needed:
    """A folder every node must see: ``what`` names it for the user; with ``token``, the node must read
    ``path/TOKEN_FILE`` holding it (the same storage, not a folder of the same name)."""

    what: str
    path: str
    token: str | None = None


def _look(needed: Sequence[Needed]) -> tuple[str, list[str]]:
    """On a node: its address, and ``what`` of each folder it does not see (or sees another one at)."""
    missing = []
    for n in needed:
        if n.token is None:
            seen = os.path.isdir(n.path)
        else:
            try:
                seen = Path(n.path, TOKEN_FILE).read_text() == n.token
            except OSError:
                seen = False
        if not seen:
            missing.append(n.what)
    return ray.util.get_node_ip_address(), missing


def needed(config: RunConfig, run_dir: Path, ckpt_root: Path, model_path: Path) -> list[Needed]:
    """The folders of this run that every node must see (absolute paths, as the driver resolved them)."""
    token = secrets.token_hex(16)
    out = [Needed("run folder", str(run_dir), token)]
    if not ckpt_root.is_relative_to(run_dir):
        out.append(Needed("checkpoint folder (checkpoint.dir)", str(ckpt_root), token))
    if model_path.is_dir():  # else a Hugging Face id, which each process resolves from its own cache
        what = "model folder (model.path)" if config.model.path is not None else "built-in tiny model"
        out.append(Needed(what, str(model_path)))
    return out


def check(config: RunConfig, run_dir: Path, ckpt_root: Path, model_path: Path, timeout_s: float) -> None:
    """On a cluster (``ray.address`` set): raise ``SharedStorageError`` naming the first node (by
    address) that misses a folder, the folder and its path; every node is asked at once."""
    if not config.ray.address:
        return
    folders = needed(config, run_dir, ckpt_root, model_path)
    written = []
    try:
        for n in folders:
            if n.token is not None:
                Path(n.path).mkdir(parents=True, exist_ok=True)
                (Path(n.path) / TOKEN_FILE).write_text(n.token)
                written.append(Path(n.path) / TOKEN_FILE)
        views = _ask_every_node(folders, timeout_s)
    finally:
        for path in written:
            path.unlink(missing_ok=True)
    _raise_first(views, folders)


def _ask_every_node(folders: list[Needed], timeout_s: float) -> list[tuple[str, list[str]]]:
    look = ray.remote(num_cpus=0, max_retries=0)(_look)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = [
        look.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
            folders
        )
        for n in nodes
    ]
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        late = [nodes[refs.index(r)].get("NodeManagerAddress", "?") for r in pending]
        for ref in pending:
            ray.cancel(ref, force=True)
        raise SharedStorageError(
            f"node(s) {', '.join(late)} did not report which shared folders they see within "
            f"{timeout_s:g} s (ray.timeout_s); look at `ray status` and that node's raylet log"
        )
    return list(ray.get(ready))


def _raise_first(views: list[tuple[str, list[str]]], folders: list[Needed]) -> None:
    blind = sorted((v for v in views if v[1]), key=lambda v: node_key(v[0]))
    if not blind:
        return
    ip, missing = blind[0]
    folder = next(n for n in folders if n.what == missing[0])
    others = [v[0] for v in blind[1:]]
    also = f" (nor do {', '.join(others)})" if others else ""
    raise SharedStorageError(
        f"node {ip} does not see the {folder.what} {folder.path}{also}; every node of the cluster reads "
        "and writes it: put it on storage every node mounts at the same path (docs/guide/cluster.md)"
    )
