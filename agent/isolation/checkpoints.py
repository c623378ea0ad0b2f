"""Checkpoint folders per attempt (J12): a process of an old attempt can never write into the new one's.

A checkpoint-resume job's attempt `n` saves into `checkpoints/<job>/attempt-<n>` in shared storage
(`libs/storage.py::checkpoint_mount`), shown to it as `/workspace/checkpoints`. Before the attempt's
command starts, the agent creates that folder as a copy of the newest earlier attempt's, so the job
resumes from what was saved last without knowing about attempts. A process of an earlier attempt that
still runs (its node was declared lost, and came back before the stop reached it) writes only into its
own attempt's folder: never into the one the new attempt resumes from and saves to.

Every rank's agent prepares the folder the same way, at the same time: each copies into a private
folder and renames it into place, and the first rename wins (a copy always holds `SEEDED_FROM`, so it
is never an empty folder another rename could replace). `cp --reflink=auto` makes the copy cheap on a
filesystem that shares blocks (btrfs, XFS); elsewhere it is a full copy. Folders older than the one
copied are removed: nobody resumes from them any more.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

ATTEMPT_FOLDER = re.compile(r"^attempt-(\d+)$")
SEEDED_FROM = ".trainyard-resumed-from"  # in the new folder: the earlier attempt's folder it started as


class SeedError(OSError):
    """The earlier attempt's checkpoints could not be copied."""


def prepare_checkpoints(folder: Path) -> Path | None:
    """Make the attempt's checkpoint folder `folder` (`…/attempt-<n>`) if it is not there yet: a copy of the
    newest earlier attempt's folder, or empty when there is none. Returns the folder copied, if any."""
    match = ATTEMPT_FOLDER.match(folder.name)
    if folder.exists() or match is None:
        folder.mkdir(parents=True, exist_ok=True)
        return None
    attempt = int(match[1])
    earlier = sorted((int(m[1]), path) for path in _children(folder.parent)
                     if (m := ATTEMPT_FOLDER.match(path.name)) and int(m[1]) < attempt and path.is_dir())
    if not earlier:
        folder.mkdir(parents=True, exist_ok=True)
        return None
    source = earlier[-1][1]
    partial = folder.with_name(f".{folder.name}.{uuid.uuid4().hex}.partial")
    copied = subprocess.run(["cp", "-a", "--reflink=auto", str(source), str(partial)],
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
    if copied.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise SeedError(f"cannot copy the checkpoints of {source.name} into {folder.name}: "
                        f"{copied.stderr.strip() or copied.returncode}")
    (partial / SEEDED_FROM).write_text(f"{source.name}\n")
    try:
        os.rename(partial, folder)
    except OSError:  # another rank's copy is in place already
        shutil.rmtree(partial, ignore_errors=True)
    for _, older in earlier[:-1]:
        shutil.rmtree(older, ignore_errors=True)
    return source


def _children(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []
