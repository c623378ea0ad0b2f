"""Files of a node's caches (datasets, agent/caches/datacache.py; images, agent/caches/imagecache.py): the lock
an entry is made or removed under, the removal of a folder the cache made read-only, the names of pin files, and
what is read from shared storage opened without following links (so that what is opened is what was checked)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

# A folder reached by name only: a link where a folder is expected fails (ELOOP or ENOTDIR), never followed.
FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A file to read: a link fails as above; a FIFO put in its place does not block the open (fstat tells).
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


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


def open_beneath(root: str, relative: str, flags: int) -> int:
    """A descriptor of `relative` (slash-separated, no `..`) under the folder `root`, each step opened from the
    last without following a link: whatever was swapped in on the way, it is never left. OSError otherwise
    (ELOOP or ENOTDIR where a link stands). `root` itself is opened by its path: it is trusted."""
    parts = [part for part in relative.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise OSError(errno.EINVAL, f"{relative} leaves its folder")
    here = os.open(root, FOLDER_FLAGS & ~os.O_NOFOLLOW)
    try:
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            step = os.open(part, flags if last else FOLDER_FLAGS, dir_fd=here)
            os.close(here)
            here = step
        if not parts and flags & os.O_DIRECTORY == 0:
            raise OSError(errno.EISDIR, f"{root} is a folder")
    except BaseException:
        os.close(here)
        raise
    return here


def open_file_beneath(root: str, relative: str) -> int:
    """A descriptor to read the plain file `relative` under `root` (see `open_beneath`); OSError (EINVAL) for
    anything else that stands there now."""
    fd = open_beneath(root, relative, FILE_FLAGS)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a plain file")
    return fd
