"""Node environments on disk (SPEC J15): each rank's folder, kept for debug sessions or removed.

A node's folder is `<agent root>/jobs/<job>.attempt-<a>.task-<t>.rank-<r>`. When the launch keeps
the workspace, the agent writes `session.json` there before the command starts: the job's variables
and how the workspace was made (backend, paths, sandbox binds), so that a session can run commands
in the same environment after the process ended, however it ended. Every node's environment is also
in its process record (agent/ranks/process.py), so that an agent that adopts the process (after a restart)
runs commands in it as the one that started it did. Otherwise the folder is removed once the process
ended; in the plain backend its mounts are symbolic links into shared storage, and removal never
follows them.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import msgspec

from agent.isolation.sandbox import Bind, Hidden, SandboxSpec
from agent.isolation.workspace import Workspace

ENVIRONMENT_NAME = "session.json"
# Ids that become folder names and subject tokens: no separators, no `.`/`..`.
SAFE_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class _Bind(msgspec.Struct, frozen=True):
    source: str
    target: str
    read_only: bool


class _Hidden(msgspec.Struct, frozen=True):
    path: str
    is_dir: bool


class _Sandbox(msgspec.Struct, frozen=True):
    binds: list[_Bind]
    dirs: list[str]
    tmp: str | None
    keep: list[str]
    cwd: str
    hidden: list[_Hidden] = []  # absent from records written before paths were hidden
    root: str | None = None  # J10: the unpacked image shown as / (None: the host's root)
    run_as: int | None = None  # L1: the job's user (None: root without capabilities, or an older record)
    devices: list[str] = []


class _Workspace(msgspec.Struct, frozen=True):
    root: str
    path: str
    backend: str
    sandbox: _Sandbox | None


class RecordedEnvironment(msgspec.Struct, frozen=True):
    """A node's environment as its process record holds it."""

    env: dict[str, str]
    workspace: _Workspace


class _Record(msgspec.Struct, frozen=True, kw_only=True):
    version: int = 1
    job_id: str
    attempt: int
    task: int
    rank: int
    node: str
    kept_at: datetime
    env: dict[str, str]
    workspace: _Workspace


@dataclass(frozen=True)
class Environment:
    """Where and with what a node's commands run."""

    workspace: Workspace
    env: dict[str, str]


def rank_root(root: Path, job_id: str, attempt: int, task: int, rank: int) -> Path:
    # One folder per rank, named for its job too rather than inside a folder of the job's: a folder made and
    # removed for every job is an inode allocated and freed, which costs the file system more the more of them
    # it freed in the last minutes (ext4 looks past each recently freed inode before it takes one).
    return Path(f"{root}/jobs/{job_id}.attempt-{attempt}.task-{task}.rank-{rank}")


# This layout's folder name, and the one before it (`attempt-<a>.task-<t>.rank-<r>` inside the job's folder).
_RANK_FOLDER = re.compile(r"^(?:(?P<job>[^/.]+)\.)?attempt-(\d+)\.task-(\d+)\.rank-(\d+)$")


def rank_of_folder(directory: Path) -> tuple[int, int, int] | None:
    """The (attempt, task, rank) a node folder (`rank_root`) belongs to; None for another layout's."""
    found = _RANK_FOLDER.match(directory.name)
    return None if found is None else (int(found[2]), int(found[3]), int(found[4]))


def job_of_folder(directory: Path) -> str:
    """The job a node folder (`rank_root`, or one of a layout before) belongs to."""
    found = _RANK_FOLDER.match(directory.name)
    if found is not None and found["job"] is not None:
        return found["job"]
    return directory.parent.name if found is not None else directory.parent.parent.parent.name


# The node folders under an agent's root, as glob patterns: this layout's, and the two before it
# (`<job>/attempt-<a>.task-<t>.rank-<r>`, `<job>/<attempt>/task-<t>/rank-<r>`), so that an agent started on
# folders an older one left adopts, resumes and releases them still.
NODE_FOLDERS = ("jobs/{job}.attempt-*.task-*.rank-*", "jobs/{job}/attempt-*.task-*.rank-*",
                "jobs/{job}/*/task-*/rank-*")


def node_files(root: Path, name: str, job_id: str = "*") -> list[Path]:
    """The file `name` of every node folder under the agent's `root` (of one job, or of all), sorted."""
    return sorted(path for pattern in NODE_FOLDERS for path in root.glob(f"{pattern.format(job=job_id)}/{name}"))


def _to_record(workspace: Workspace) -> _Workspace:
    spec = workspace.sandbox
    sandbox = None if spec is None else _Sandbox(
        binds=[_Bind(str(b.source), b.target, b.read_only) for b in spec.binds], dirs=list(spec.dirs),
        tmp=None if spec.tmp is None else str(spec.tmp), keep=[str(p) for p in spec.keep], cwd=spec.cwd,
        hidden=[_Hidden(str(h.path), h.is_dir) for h in spec.hidden],
        root=None if spec.root is None else str(spec.root), run_as=spec.run_as, devices=list(spec.devices))
    return _Workspace(root=str(workspace.root), path=str(workspace.path), backend=workspace.backend, sandbox=sandbox)


def _from_record(record: _Workspace) -> Workspace:
    found = record.sandbox
    sandbox = None if found is None else SandboxSpec(
        binds=[Bind(source=Path(b.source), target=b.target, read_only=b.read_only) for b in found.binds],
        dirs=found.dirs, tmp=None if found.tmp is None else Path(found.tmp), keep=[Path(p) for p in found.keep],
        cwd=found.cwd, hidden=[Hidden(path=Path(h.path), is_dir=h.is_dir) for h in found.hidden],
        root=None if found.root is None else Path(found.root), run_as=found.run_as, devices=found.devices)
    return Workspace(root=Path(record.root), path=Path(record.path), backend=record.backend, sandbox=sandbox)


def recorded(environment: Environment) -> RecordedEnvironment:
    return RecordedEnvironment(env=environment.env, workspace=_to_record(environment.workspace))


def from_recorded(found: RecordedEnvironment) -> Environment:
    return Environment(workspace=_from_record(found.workspace), env=found.env)


def write_environment(directory: Path, *, job_id: str, attempt: int, task: int, rank: int, node: str,
                      environment: Environment) -> None:
    """Record a kept environment; only the agent's user may read it (the job's variables are in it)."""
    record = _Record(job_id=job_id, attempt=attempt, task=task, rank=rank, node=node, kept_at=datetime.now(UTC),
                     env=environment.env, workspace=_to_record(environment.workspace))
    partial = directory / f".{ENVIRONMENT_NAME}.tmp"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(msgspec.json.format(msgspec.json.encode(record)))
    partial.replace(directory / ENVIRONMENT_NAME)  # never half a record


def read_environment(directory: Path) -> Environment | None:
    """The environment kept in `directory`, or None when there is none (or it cannot be read)."""
    try:
        record = msgspec.json.decode((directory / ENVIRONMENT_NAME).read_bytes(), type=_Record)
    except (OSError, msgspec.DecodeError):
        return None
    return Environment(workspace=_from_record(record.workspace), env=record.env)


def kept_roots(root: Path, job_id: str) -> list[Path]:
    """Every kept node folder of the job under the agent's root (all attempts, tasks and ranks)."""
    return [path.parent for path in node_files(root, ENVIRONMENT_NAME, job_id)]


class RemovalRefused(OSError):
    """The folder is not one the agent may remove."""


# A node folder of at most this many entries is removed on the agent's event loop rather than in a worker
# thread: in a thread, each of the removal's system calls gives up the interpreter lock and then waits for
# the busy loop to hand it back (an agent under load made ~15,000 futex calls in 6 s removing the plain
# backend's skeleton in threads, a handful without). A big folder (a job that filled its /tmp) still goes
# in a thread, so the loop is never held long.
FEW_ENTRIES = 64


def has_few_entries(directory: Path, limit: int = FEW_ENTRIES) -> bool:
    """Whether `directory` holds at most `limit` entries in all, its subfolders' included (links are not
    followed); counting stops past the limit. A folder that is gone has none."""
    try:
        return sum(1 for _ in itertools.islice(_entries_under(str(directory)), limit + 1)) <= limit
    except (FileNotFoundError, NotADirectoryError):
        return True


def remove_node_root(root: Path, directory: Path) -> None:
    """Remove one node folder under `<root>/jobs`, then its parents that are left empty.

    Symbolic links inside are removed, not followed (shutil.rmtree works on file descriptors and
    never descends into a link), so shared storage is untouched. A folder that is itself a link,
    lies outside the agent's jobs folder or holds a mount point is refused.
    """
    jobs = _real_jobs(root)
    try:
        if stat.S_ISLNK(os.lstat(directory).st_mode):
            raise RemovalRefused(f"{directory} is not a node folder under {jobs}")
    except FileNotFoundError:
        return
    # Not a link itself: in the real jobs folder, it is its own real path (the look at every folder above is saved).
    parent, name = os.path.split(directory)
    real = str(directory) if parent == jobs and name not in ("", ".", "..") else os.path.realpath(directory)
    if not real.startswith(jobs + os.sep):
        raise RemovalRefused(f"{directory} is not a node folder under {jobs}")
    if (mounted := _mount_point_in(real)) is not None:
        raise RemovalRefused(f"{mounted} is a mount point; it was left in place")
    shutil.rmtree(real)
    parent = os.path.dirname(real)
    while parent.startswith(jobs + os.sep):
        try:
            os.rmdir(parent)
        except OSError:  # not empty: other ranks, tasks or attempts are still there
            return
        parent = os.path.dirname(parent)


def _entries_under(folder: str) -> Iterator[os.DirEntry[str]]:
    """Every entry inside `folder`, its subfolders' included; links are not followed."""
    waiting = [folder]
    while waiting:
        with os.scandir(waiting.pop()) as entries:
            for entry in entries:
                yield entry
                if entry.is_dir(follow_symlinks=False):
                    waiting.append(entry.path)


def _mount_point_in(folder: str) -> str | None:
    """A folder inside `folder` on another file system (a mount point, as os.path.ismount tells one), if
    any: links are not followed."""
    device = os.lstat(folder).st_dev
    for entry in _entries_under(folder):
        if entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_dev != device:
            return entry.path
    return None


@functools.lru_cache(maxsize=4)
def _real_jobs(root: Path) -> str:
    """The agent's jobs folder, links resolved (once: it is the agent's own)."""
    return os.path.realpath(root / "jobs")
