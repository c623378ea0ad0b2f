"""The bubblewrap command that runs one node of a job in a mount namespace of its own (SPEC L1).

Inside, the job sees the host's files read-only, with its own /workspace made of bind mounts of
shared storage (read-only ones really read-only, writable ones writing to storage), its generated
files at their absolute paths (/etc/mpi/hostfile, /job/hostfile, ...), a writable /tmp of its own,
the host's /dev and a /proc of its own. Only the mount namespace is new: the network, process ids,
users and the process group are the host's, so ranks reach each other as before and the agent's
killpg reaches every process of the job. /dev is the host's so that accelerators stay usable.
There is no --die-with-parent: bwrap itself dies of the SIGTERM that starts a stop, and the flag
would then kill the job at once instead of leaving it its grace period. There is no --unshare-pid
either: ranks sharing a host would see different process ids, which shared-memory transports
between processes rely on.

bwrap starts from an empty tmpfs root. A read-only bind of the whole host root could not hold
/workspace (nothing can be created in it), so each entry of the host root is bound on its own. A
host directory that must hold something new (/etc for /etc/mpi/hostfile) is made in the tmpfs
instead, and its entries are bound one by one, down to the new paths. Symbolic links are recreated
as they are written, so relative ones (/bin -> usr/bin, /etc/mtab -> ../proc/self/mounts) resolve
inside.

Host paths the platform keeps for itself (its state folder with the token signing secret, tokens and
stack settings, the agent's own folder with other jobs' files) are hidden: an empty read-only tmpfs
over a folder, /dev/null over a file. The job's own mounts are bound from the host, so they still
work when their sources lie under a hidden folder.

`bwrap_argv` only builds the command. It reads the host through `list_dir`, so tests can describe
a host instead of having one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

WORKSPACE = "/workspace"
# Runs the job's argv inside: a missing or unusable executable is exit code 127 or 126 with the
# shell's message, as when the agent starts a command itself, rather than bwrap's own exit code 1.
EXEC = ("/bin/sh", "-c", 'exec "$@"', "sh")


@dataclass(frozen=True)
class HostEntry:
    """One entry of a host directory."""

    name: str
    is_dir: bool  # a directory, or a symbolic link to one
    link: str | None = None  # a symbolic link's target, as written


ListDir = Callable[[str], Sequence[HostEntry]]


def list_host_dir(path: str) -> list[HostEntry]:
    """The entries of a host directory, by name; none when it does not exist."""
    entries = []
    try:
        with os.scandir(path) as found:
            for entry in found:
                link = os.readlink(entry.path) if entry.is_symlink() else None
                entries.append(HostEntry(name=entry.name, is_dir=entry.is_dir(), link=link))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(entries, key=lambda e: e.name)


@dataclass(frozen=True)
class Bind:
    """A host path shown at `target` (absolute) inside the sandbox."""

    source: Path
    target: str
    read_only: bool


@dataclass(frozen=True)
class Hidden:
    """A host path shown empty inside the sandbox."""

    path: Path
    is_dir: bool


@dataclass(frozen=True)
class SandboxSpec:
    """What one node's sandbox holds besides the host's files."""

    binds: Sequence[Bind]  # the workspace's mounts and the generated files
    dirs: Sequence[str] = ()  # empty directories to make first (the /workspace skeleton)
    tmp: Path | None = None  # the host directory seen as /tmp; None: an empty tmpfs
    # Host paths that must stay visible where they are (read-only), such as the Python environment
    # and the agent's own code; nothing is added for those the host's entries already show.
    keep: Sequence[Path] = field(default_factory=list)
    cwd: str = WORKSPACE
    # Host paths the job must not see (folders, or single files); those it could not see anyway are skipped.
    hidden: Sequence[Hidden] = ()


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _depth(path: str) -> int:
    return len(PurePosixPath(path).parts)


def bwrap_argv(spec: SandboxSpec, argv: Sequence[str], *, list_dir: ListDir = list_host_dir,
               bwrap: str = "bwrap") -> list[str]:
    """The full command that runs `argv` in the sandbox `spec` describes."""
    made = [WORKSPACE, *spec.dirs, *(b.target for b in spec.binds)]  # paths the sandbox provides
    args: list[str] = []
    bound: list[str] = []  # host paths bound whole, read-only, at their own place

    def walk(directory: str) -> None:
        for entry in list_dir(directory):
            path = str(PurePosixPath(directory) / entry.name)
            if path in ("/proc", "/dev", "/tmp"):
                continue  # given their own mounts below
            if path in made:
                continue  # replaced by the sandbox's own
            if any(_inside(new, path) for new in made):
                if entry.is_dir:  # holds something new: make it here and show its entries one by one
                    args.extend(["--dir", path])
                    walk(path)
                continue
            if entry.link is not None:
                args.extend(["--symlink", entry.link, path])
            else:
                args.extend(["--ro-bind-try", path, path])
                bound.append(path)

    walk("/")
    args.extend(["--proc", "/proc", "--dev-bind", "/dev", "/dev"])
    args.extend(["--bind", str(spec.tmp), "/tmp"] if spec.tmp is not None else ["--tmpfs", "/tmp"])
    hidden = _visible_hidden(spec, bound, made)
    kept = [k for k in _unique(str(p) for p in spec.keep)
            if not any(_inside(k, host) for host in bound) or any(_inside(k, str(h.path)) for h in hidden)]
    # A hidden path inside a kept one is hidden after it is bound; a kept path inside a hidden one is
    # bound after the hiding, so that it stays visible.
    for keep in kept:
        if not any(_inside(keep, str(h.path)) for h in hidden):
            args.extend(["--ro-bind", keep, keep])
    for entry in hidden:
        if entry.is_dir:
            args.extend(["--tmpfs", str(entry.path)])
        else:
            args.extend(["--ro-bind", "/dev/null", str(entry.path)])
    for keep in kept:
        if any(_inside(keep, str(h.path)) for h in hidden):
            args.extend(["--ro-bind", keep, keep])
    for directory in [WORKSPACE, *spec.dirs]:
        args.extend(["--dir", directory])
    # Parents before children, so that a mount never hides one made inside it.
    for bind in sorted(spec.binds, key=lambda b: _depth(b.target)):
        args.extend(["--ro-bind" if bind.read_only else "--bind", str(bind.source), bind.target])
    for entry in hidden:  # an empty folder the job cannot write to either
        if entry.is_dir:
            args.extend(["--remount-ro", str(entry.path)])
    # The tmpfs root itself (and the folders made in it, such as /etc) takes no writes either.
    args.extend(["--remount-ro", "/", "--chdir", spec.cwd])
    return [bwrap, *args, "--", *EXEC, *argv]


def _visible_hidden(spec: SandboxSpec, bound: Sequence[str], made: Sequence[str]) -> list[Hidden]:
    """The hidden paths the job would otherwise see: under a host path bound whole or a kept path, not
    under /proc, /dev or /tmp (the sandbox's own), not the sandbox's own paths, not inside another."""
    visible = [*bound, *(str(p) for p in spec.keep)]
    own = ["/proc", "/dev", "/tmp", *made]
    found: list[Hidden] = []
    for entry in sorted(spec.hidden, key=lambda h: _depth(str(h.path))):
        path = str(entry.path)
        if path == "/" or not any(_inside(path, v) for v in visible):
            continue
        if any(_inside(path, o) or _inside(o, path) for o in own):
            continue
        if any(h.is_dir and _inside(path, str(h.path)) for h in found):
            continue
        found.append(entry)
    return found


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))
