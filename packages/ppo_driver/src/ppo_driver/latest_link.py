"""``runs/latest``: a symbolic link to the newest run folder started under ``runs/``.

``ppo-driver train`` without ``--run-dir`` writes ``runs/<date-time>``; the guides' next commands
(``ppo-driver plot runs/latest``, the export in docs/guide/checkpoints.md) then find it without the
date. The link is replaced atomically (a new link renamed over the old), so a reader never sees none.
"""

from __future__ import annotations

import os
from pathlib import Path

LATEST = "latest"


def point_latest(run_dir: Path) -> Path | None:
    """Point ``<parent>/latest`` at ``run_dir`` when its parent folder is named ``runs``; returns the
    link, or None (another parent, or a file system without symbolic links). Never fails the run."""
    run_dir = run_dir.absolute()
    parent = run_dir.parent
    if parent.name != "runs" or run_dir.name == LATEST:
        return None
    link = parent / LATEST
    if link.exists() and not link.is_symlink():
        return None  # a folder of the user's own named "latest": left alone
    tmp = parent / f".{LATEST}-{os.getpid()}"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(run_dir.name, target_is_directory=True)  # relative: the tree can move
        tmp.replace(link)
    except OSError:
        tmp.unlink(missing_ok=True)
        return None
    return link
