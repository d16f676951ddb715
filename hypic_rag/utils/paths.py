"""Checks of directories a command will create or write, made before anything is created.

`unusable_directory_reason(path)` says why `path` cannot be used as a directory to write into (it is a file, it
lies inside a file, it or the place it would be created is not writable), or None when it can. Commands call it
for every output directory they are given before creating any of them, so a bad argument leaves nothing behind.
"""

from __future__ import annotations

import os
from pathlib import Path


def _writable(directory: Path) -> bool:
    return os.access(directory, os.W_OK | os.X_OK)


def unusable_directory_reason(path: str | os.PathLike[str]) -> str | None:
    """Why `path` cannot be (created as) a writable directory, as a phrase naming the path; None if it can.

    An existing directory must be writable; a missing one needs its nearest existing ancestor to be a writable
    directory (that is where it would be created, with its missing parents)."""
    path = Path(path).expanduser().absolute()
    if path.exists():
        if not path.is_dir():
            return f"{path} is a file, not a directory"
        if not _writable(path):
            return f"{path} is not writable"
        return None
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"cannot create {path}: {ancestor} is a file, not a directory"
    if not _writable(ancestor):
        return f"cannot create {path}: {ancestor} is not writable"
    return None
