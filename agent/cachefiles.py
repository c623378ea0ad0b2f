"""Files of a node's caches (datasets, agent/datacache.py; images, agent/imagecache.py): the lock an entry is
made or removed under, the removal of a folder the cache made read-only, and the names of pin files."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (made if missing): also between agents sharing a folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def remove_folder(folder: Path) -> None:
    """Remove a folder, its read-only files and subfolders too; symbolic links are removed, never followed."""
    if not folder.exists():
        return
    for parent, dirs, _ in os.walk(folder):
        for name in dirs:
            path = os.path.join(parent, name)
            with contextlib.suppress(OSError):
                if not os.path.islink(path):
                    os.chmod(path, stat.S_IRWXU)
    with contextlib.suppress(OSError):
        folder.chmod(stat.S_IRWXU)
    shutil.rmtree(folder, ignore_errors=True)


def pin_name(holder: str) -> str:
    """A pin's file name: its holder (<job>/<attempt>/<task>/<rank>, or a preload's id) without slashes."""
    return holder.replace("/", "_")


def holder_of_pin(name: str) -> str:
    return name.replace("_", "/")
