"""Folders whose subfolders the file system should spread apart: the agent's job folders and run sockets.

Every job makes a few files and folders on its node and removes them when it ends. ext4 looks for a free
inode in a block group from its first one on, and passes over each one freed in the last minutes, reading
the inode table for each: with one folder holding every job's folders, all of them come from and go back
to the same few groups, and the search grows with the jobs that ended lately. With 8 agents each starting a
short job after another, those searches took a fifth to a quarter of the machine's CPU (`perf`, the
`trivial` workload of bench/throughput.py). The ext2/3/4 `T` attribute (`chattr +T`, FS_TOPDIR_FL) marks
a folder whose subfolders are unrelated, as /home's are: each new subfolder (a job's rank folder, a rank's
socket folder) is then placed in a block group of its own choosing, with the files made in it, and the
searches stay short. File systems without the attribute refuse it, which changes nothing.
"""

from __future__ import annotations

import fcntl
import os
import struct
from pathlib import Path

# From <linux/fs.h>: FS_IOC_GETFLAGS = _IOR('f', 1, long), FS_IOC_SETFLAGS = _IOW('f', 2, long).
GET_FLAGS, SET_FLAGS = 0x80086601, 0x40086602
TOPDIR = 0x00020000  # FS_TOPDIR_FL
_FLAGS = struct.Struct("l")


def spread_subfolders(folder: Path) -> bool:
    """Mark `folder` so that its subfolders are spread apart; whether the file system took the mark."""
    return _topdir(folder, mark=True)


def subfolders_spread(folder: Path) -> bool:
    """Whether `folder` carries the mark."""
    return _topdir(folder, mark=False)


def _topdir(folder: Path, *, mark: bool) -> bool:
    """Whether `folder` carries the mark, given it first when `mark`; False where the file system has no such
    flags (tmpfs, overlay, xfs, ...), the folder is not ours to mark, or is not there."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        flags = _FLAGS.unpack(fcntl.ioctl(fd, GET_FLAGS, bytes(_FLAGS.size)))[0]
        if mark and not flags & TOPDIR:
            fcntl.ioctl(fd, SET_FLAGS, _FLAGS.pack(flags | TOPDIR))
            flags |= TOPDIR
        return bool(flags & TOPDIR)
    except OSError:
        return False
    finally:
        os.close(fd)
