"""The bubblewrap command that runs one node of a job in a mount namespace of its own (SPEC L1).

Inside, the job sees the host's system folders read-only (`SYSTEM_PATHS`: /usr, /etc, /opt, /sys and the
links beside them; nothing else of the host's: no /home, /root, /var, /run or /srv), with its own /workspace
made of bind mounts of shared storage (read-only ones really read-only, writable ones writing to storage), its
generated files at their absolute paths (/etc/mpi/hostfile, /job/hostfile, ...), a writable /tmp of its own,
a /dev of its own (with the host's accelerator devices, `ACCELERATOR_DEVICES`) and its own process, IPC, host
name and cgroup namespaces with a /proc of its own: it sees only its own processes. The agent's holder starts bwrap
from a mount namespace without the host's mounts no sandbox shows (agent/processes/holder.py, SandboxMounts): a
job's /sys has none of the host's cgroup hierarchies or kernel debugging interfaces, and each bwrap copies and
reads a mount table of a few entries rather than the host's. The network is the host's,
so that ranks reach each other as before, and so is the process group: the agent's killpg reaches every
process of the job.

A job is untrusted code. Where the agent runs as root, bwrap runs as root too (it mounts what the agent may
read, whatever the permissions of the folders above it), and the first process inside drops to the job's
unprivileged user and group (`SandboxSpec.run_as`, NodeLaunch.run_as) with no supplementary groups, no
capabilities (none kept, none to gain: an empty bounding set) and `no_new_privs`, then runs the job's command
(`dropper`): the agent's own static `trainyard-drop` (agent/isolation/drop.c, built by `make install` beside the
agent's Python, bound read-only at DROP_INSIDE: about 1 ms of CPU a start less than setpriv, and it runs in any
image), or where it was not built, the host's setpriv, or under an image the agent's own Python. Where the agent
is not root, bwrap makes a user namespace and the job runs as the agent's user, with no capabilities either. An
agent allowed to run jobs as root (`run_as` None while root) runs them as root without any capability.
There is no --die-with-parent: bwrap itself dies of the SIGTERM that starts a stop, and the flag would then
kill the job at once instead of leaving it its grace period. Ranks of one job on one host that are not in one
sandbox (several agents on one machine, the local stack) do not share memory: each sandbox is a host of its
own to them.

bwrap starts from an empty tmpfs root. The host root is bound there once, whole and read-only, at
one hidden place (HOST, /.host), and each host root entry is a symbolic link into it (/usr ->
.host/usr; a link of the host's own, such as /bin -> usr/bin, is recreated as written). A host
directory that must hold something new (/etc for /etc/mpi/hostfile, /run for /run/trainyard) is made
in the tmpfs instead, its entries links into HOST in the same way, down to the new paths. Why: bwrap's
cost grows faster than its number of mounts (it reads the mount table again after each one), so
binding each host entry on its own cost about 5 ms of CPU per start, and 50 ms where /etc had to be
shown entry by entry; this way a sandbox has a handful of mounts whatever the host holds. The host
root is bound after the sandbox's own mounts (/proc, /dev, /tmp, the workspace's), since it doubles the
table each later read goes through (0.3 ms of a 3.7 ms start). What a job may notice: host paths are
symbolic links, so a resolved path (realpath, pwd -P) starts with /.host.

A sandbox its holder starts shows HOST through a host view (`HostView`, `host_view`): the holder makes once, in its
mount namespace, a read-only tmpfs with the shown entries and trainyard-drop (at VIEW_DROP) bound in it, and each
sandbox binds that whole (one bind where it took five, each of which bwrap follows with a read of its mount table:
about 0.4 ms of CPU a start alone, 0.25-0.3 ms in the whole stack, where the view's own mounts lengthen those reads).
The command binds VIEW_SOURCE there, which the holder replaces with the view's place, or where it has none (not
root), with a bind of each path into HOST, the same files at the same paths. A command started elsewhere (a debug
session, an exec in the job) binds each entry itself. Where trainyard-drop starts the job, the holder makes its /dev
once too (`HostView.devices`): the six devices and the links bwrap's --dev makes, and the accelerators, made in a
read-only tmpfs each sandbox binds whole (DEVICES_SOURCE), where --dev bound each device and read the mount table
after each (0.6-0.8 ms of CPU a start); trainyard-drop mounts a devpts of the sandbox's own at /dev/pts before it
drops, so that its terminals are its own as under --dev. Every sandbox has a /dev/shm of its own that its user may
write (POSIX shared memory: PyTorch's data loaders, NCCL, MPI), which --dev's folder of root's was not.

Host paths the platform keeps for itself (its state folder with the token signing secret, tokens and
stack settings, the agent's own folder with other jobs' files) are hidden where the host's files
are, under HOST, so through whatever path leads there: an empty read-only tmpfs over a folder,
/dev/null over a file. The host's own files at the paths the sandbox gives its own (/tmp with other
jobs' sockets, a /workspace of the host's) are hidden there too. The job's own mounts are bound from
the host, so they still work when their sources lie under a hidden folder, and the paths to keep
visible (the agent's Python environment and code) are bound again where a hidden or replaced path
covers them.

A job in an image (J10, `SandboxSpec.root`) is the same with the image's unpacked root filesystem bound at
HOST instead of the host's, its entries linked the same way. The host's files are then not shown but for the
paths to keep visible, bound at their host paths, and the host's /sys; a hidden path inside a kept one (the
local stack's state folder inside the repository the agent runs from) is hidden there.

`bwrap_argv` only builds the command. It reads the host through `list_dir`, so tests can describe
a host instead of having one; an agent lists a host directory again only once it changed
(`HostListing`), and works out the host's part of the command (the root's entries, what is hidden and kept)
once for every job of the same shape, again once a directory it listed changed (`_layout`).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path

WORKSPACE = "/workspace"
HOST = "/.host"  # where the host root is bound whole, read-only
# Runs the job's argv inside: a missing or unusable executable is exit code 127 or 126 with the
# shell's message, as when the agent starts a command itself, rather than bwrap's own exit code 1. Left out
# (bwrap then executes argv itself, a process less: about 1 ms of CPU a start) when the executable is known
# to be there: a host file the job sees at the same path (`runs_directly`).
EXEC = ("/bin/sh", "-c", 'exec "$@"', "sh")
# Given mounts of their own: a new /proc (the job's own processes), a new /dev, the job's /tmp.
OWN_MOUNTS = ("/proc", "/dev", "/tmp")
# The host root's entries a job sees (read-only) when it runs on the host's files: the programs, libraries and
# settings it runs with (accelerator drivers and toolkits included: /usr/local, /opt) and the kernel's view of
# the devices. Links at the root (/bin -> usr/bin) are shown as written.
SYSTEM_PATHS = ("bin", "etc", "lib", "lib32", "lib64", "libx32", "opt", "sbin", "sys", "usr")
# The namespaces every sandbox has of its own (the mount namespace besides).
NAMESPACES = ("--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try")
# Host devices shown in a sandbox's own /dev, by the start of their names: NVIDIA GPUs, AMD GPUs (kfd, dri),
# Huawei Ascend NPUs (davinci*, devmm_svm, hisi_hdc), AWS Neuron, other accelerators (accel), RDMA NICs.
ACCELERATOR_DEVICES = ("nvidia", "kfd", "dri", "davinci", "devmm_svm", "hisi_hdc", "neuron", "accel",
                       "infiniband")
# What the first process inside runs to become the job's user, in an image (whose files may lack setpriv):
# every capability out of the bounding set, then no groups, the job's group and user, no new privileges.
PYTHON_DROPPER = """import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for cap in range(64):
    libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (past the last capability: EINVAL, ignored)
uid = int(sys.argv[1])
os.setgroups([])
os.setresgid(uid, uid, uid)
os.setresuid(uid, uid, uid)
if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
    sys.exit("cannot set no_new_privs")
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as exc:
    sys.stderr.write(f"{sys.argv[2]}: {exc.strerror}\\n")
    sys.exit(126 if isinstance(exc, PermissionError) else 127)
"""
# The static program that drops to the job's user (agent/isolation/drop.c), beside the agent's Python where
# `make install` built it, and where the sandbox shows it (read-only).
DROP_PROGRAM = "trainyard-drop"
DROP_INSIDE = "/.trainyard-drop"
VIEW_DROP = f"{HOST}/.trainyard-drop"  # where a host view shows it
# What a command binds at HOST for its holder to replace with a host view's place (`HostView`): a path no host has, so
# that a command started without the replacement fails rather than showing anything.
VIEW_SOURCE = "/.trainyard-host-view"
# The same for the /dev a host view's holder makes once (`HostView.devices`), bound with its devices usable.
DEVICES_SOURCE = "/.trainyard-devices-view"
# Where trainyard-drop mounts the sandbox's own devpts when /dev is the holder's view (bwrap's --dev mounts its own).
DEVPTS = "/dev/pts"
# What a job in an image still sees of the host (read-only): the kernel's view of the devices, which
# communication libraries and accelerator runtimes read (topology, CPU and memory facts).
IMAGE_HOST_MOUNTS = ("/sys",)
# A directory listed within this long of its last change is listed again next time: a change made
# within the same tick of the file system's clock could leave its modification time as it was.
SETTLED_NS = 1_000_000_000
# Directories whose listings an agent keeps, the last used: the host's few a sandbox shows, and those of
# the images used lately (an image's, once evicted, are never looked at again).
LISTINGS_KEPT = 1024


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


class HostListing:
    """`list_dir`, each directory's entries kept until the directory changes: a sandbox lists the same
    few host directories (the root, /etc, /run) for every job, and an entry added, removed or replaced
    changes its directory's modification time. One stat a directory tells."""

    def __init__(self, list_dir: ListDir = list_host_dir, kept: int = LISTINGS_KEPT) -> None:
        self._list_dir = list_dir
        self._kept = kept
        self._known: collections.OrderedDict[str, tuple[tuple[int, int, int], tuple[HostEntry, ...]]] = (
            collections.OrderedDict())

    def __call__(self, path: str) -> Sequence[HostEntry]:
        try:
            found = os.stat(path)
        except OSError:
            return ()
        stamp = (found.st_dev, found.st_ino, found.st_mtime_ns)
        known = self._known.get(path)
        if known is not None and known[0] == stamp:
            self._known.move_to_end(path)
            return known[1]
        entries = tuple(self._list_dir(path))
        if time.time_ns() - found.st_mtime_ns > SETTLED_NS:
            self._known[path] = (stamp, entries)
            self._known.move_to_end(path)
            if len(self._known) > self._kept:
                self._known.popitem(last=False)
        else:
            self._known.pop(path, None)
        return entries


host_listing = HostListing()  # the agent's: one per process


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
    # and the agent's own code; bound again only where a hidden or replaced path covers them.
    keep: Sequence[Path] = field(default_factory=list)
    cwd: str = WORKSPACE
    # Host paths the job must not see (folders, or single files); those it could not see anyway are skipped.
    hidden: Sequence[Hidden] = ()
    # An unpacked image's root filesystem, shown as / instead of the host's (J10); the host's files are then not
    # shown at all but for the binds, /dev, /sys and /proc.
    root: Path | None = None
    # The user and group id the job runs as where bwrap runs as root; None: as root, without capabilities.
    run_as: int | None = None
    devices: Sequence[str] = ()  # host device paths shown in its /dev (accelerators)
    system: Sequence[str] = SYSTEM_PATHS  # the host root's entries shown (without an image)


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _under(path: str, roots: AbstractSet[str]) -> bool:
    """Whether `path` is one of `roots` or lies in one (a look at each of its folders)."""
    while path not in roots:
        if path in ("/", ""):
            return False
        path = path.rsplit("/", 1)[0] or "/"
    return True


def _depth(path: str) -> int:
    return path.rstrip("/").count("/")


def _join(directory: str, name: str) -> str:
    return f"{directory.rstrip('/')}/{name}"


def _parents(path: str) -> list[str]:
    """The folders `path` lies in, / excepted: /etc and /etc/mpi for /etc/mpi/hostfile."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[:n]) for n in range(1, len(parts) + 1)]


def _hide(place: str, is_dir: bool) -> list[str]:
    return ["--tmpfs", place] if is_dir else ["--ro-bind", "/dev/null", place]


@functools.lru_cache(maxsize=1024)
def _real_path(path: str) -> str:
    """A path with its links resolved, remembered: the few folders and executables jobs start from, looked up on
    every start. A link changed since only ever costs a start through the shell being left out where it
    was wanted (bwrap's own message then), never what the sandbox hides."""
    return os.path.realpath(path)


@functools.lru_cache(maxsize=4096)
def _seen_as_on_host(path: str, covered: frozenset[str], shown: frozenset[str], kept: frozenset[str]) -> bool:
    """Whether the host's `path`, as written and resolved, lies in a shown entry of the host's root or a kept path,
    and outside every path the sandbox shows something else at or hides (`covered`), remembered: every start looks
    along the same PATH with the same paths."""
    def seen(p: str) -> bool:
        return (p.split("/", 2)[1] in shown or _under(p, kept)) and not _under(p, covered)

    return path.startswith("/") and all(seen(p) for p in (path, _real_path(path)))


@functools.lru_cache(maxsize=4096)
def _absent_inside(path: str, made: frozenset[str]) -> bool:
    """Whether the host folder `path`, which the job does not see as on the host, is nowhere inside the sandbox:
    neither in nor around a path the sandbox mounts, hides or makes (`made`: the folders it makes hold only what it
    puts there), and with no host link on its way (a link at the host's root is shown as written), remembered: every
    start looks along the same PATH. Its entries then cannot be found there."""
    return not any(_inside(path, other) or _inside(other, path) for other in made) and _real_path(path) == path


def is_executable_file(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def bwrap_argv(spec: SandboxSpec, argv: Sequence[str], *, list_dir: ListDir = host_listing,
               bwrap: str = "bwrap", search_path: str | None = None,
               executable: Callable[[str], bool] = is_executable_file, as_root: bool | None = None,
               python: str = sys.executable, setpriv: str = "/usr/bin/setpriv",
               drop_program: str | None = None, host_view: HostView | None = None) -> list[str]:
    """The full command that runs `argv` in the sandbox `spec` describes; `search_path`: the PATH argv[0] is
    looked up on inside, when it is known; `as_root`: whether bwrap runs as root (the agent's user, by default);
    `drop_program`: the host path of trainyard-drop, where it was built (`built_drop_program`); `host_view`: the
    host's root shown through a view the holder makes (`host_view_of`) rather than by a bind of each entry, where
    the sandbox shows the host's files and the view holds what it shows (else it is not used)."""
    image = spec.root is not None
    as_root = os.geteuid() == 0 if as_root is None else as_root
    run_as = _drops_to(spec, as_root)
    binds = [*spec.binds, *_kept_binds(spec.keep)] if image else list(spec.binds)
    layout = _layout(spec, tuple(b.target for b in binds), list_dir)
    # The sandbox's own mounts before the host's root: bwrap reads the whole mount table after each bind it makes,
    # and the host's root bound at HOST doubles that table, so each of these reads costs half as much before it.
    # None of them lies under HOST; the hidden and kept paths, which do, come after.
    viewed = host_view is not None and not image and host_view == host_view_of(
        layout.host_entries, drop_program if run_as is not None else None, spec.devices)
    devices_viewed = viewed and host_view is not None and host_view.devices is not None
    args = [*NAMESPACES, *(() if as_root else ("--unshare-user",)), *layout.before, "--proc", "/proc"]
    if devices_viewed:  # the holder's /dev, its devices in it; trainyard-drop mounts the sandbox's own devpts
        args.extend(["--dev-bind", DEVICES_SOURCE, "/dev"])
    else:
        args.extend(["--dev", "/dev"])
        for device in spec.devices:
            args.extend(["--dev-bind-try", device, device])
    # Shared memory of the sandbox's own that its user may write (POSIX shm_open, PyTorch's and NCCL's tensors).
    args.extend(["--perms", "1777", "--tmpfs", "/dev/shm"])
    for path in IMAGE_HOST_MOUNTS if image else ():
        args.extend(["--ro-bind", path, path])
    args.extend(["--bind", str(spec.tmp), "/tmp"] if spec.tmp is not None else ["--tmpfs", "/tmp"])
    for directory in [WORKSPACE, *spec.dirs]:
        args.extend(["--dir", directory])
    # Parents before children, so that a mount never hides one made inside it.
    made = {WORKSPACE, *spec.dirs, *layout.folders}
    for bind in sorted(binds, key=lambda b: _depth(b.target)):
        args.extend(_folders_for(bind.target, made))
        args.extend(["--ro-bind" if bind.read_only else "--bind", str(bind.source), bind.target])
    wrapper = () if runs_directly(spec, argv, search_path, layout.replaced, executable, layout.folders) else EXEC
    drop: Sequence[str] = ()
    if run_as is not None:
        inside = VIEW_DROP if viewed else DROP_INSIDE
        if drop_program is not None and not viewed:
            args.extend(["--ro-bind", drop_program, DROP_INSIDE])
        drop = dropper(run_as, image=image, python=python, setpriv=setpriv,
                       program=None if drop_program is None else inside, devpts=DEVPTS if devices_viewed else None)
    elif as_root:
        args.extend(["--cap-drop", "ALL"])  # root allowed: still without any capability
    host = ("--ro-bind", VIEW_SOURCE, HOST) if viewed else layout.host
    return [bwrap, *args, *host, *layout.after, "--", *drop, *wrapper, *argv]


@dataclass(frozen=True)
class HostView:
    """What a sandbox on the host's files shows at HOST, for the holder to make once (agent/processes/holder.py,
    SandboxMounts.view): each path bound read-only at its name. The command binds VIEW_SOURCE there, which the holder
    replaces with the view's place, or where it cannot make one, with a bind of each path.

    Where trainyard-drop starts the job (it mounts the sandbox's devpts), the holder also makes its /dev once
    (`devices`: the accelerator devices in it besides bwrap's six): one bind of a read-only tmpfs with the devices
    made in it where bwrap's --dev bound each of them, reading its whole mount table after each (0.6-0.8 ms of CPU a
    start). The command binds DEVICES_SOURCE at /dev, which the holder replaces with that /dev's place, or where it
    cannot make one, with bwrap's --dev and a bind of each device."""

    binds: tuple[tuple[str, str], ...]  # host path, and its name in the view
    devices: tuple[str, ...] | None = None  # the accelerator devices of the holder's /dev (None: bwrap makes /dev)

    @functools.cached_property
    def request(self) -> str:
        """The view as a start's request to the holder carries it (JSON text, which the holder reads once)."""
        view: dict[str, object] = {"source": VIEW_SOURCE, "binds": [list(bind) for bind in self.binds]}
        if self.devices is not None:
            view["devices"] = {"source": DEVICES_SOURCE, "paths": list(self.devices)}
        return json.dumps(view)


def host_view_of(entries: Sequence[str], drop_program: str | None, devices: Sequence[str] = ()) -> HostView:
    """The view of the host root's shown `entries` (each at its name) and trainyard-drop (at VIEW_DROP's name); where
    trainyard-drop is in it, the holder's /dev too, with the accelerator `devices`."""
    binds = [(path, path.lstrip("/")) for path in entries]
    if drop_program is not None:
        binds.append((drop_program, VIEW_DROP.removeprefix(HOST + "/")))
    return HostView(binds=tuple(binds), devices=tuple(devices) if drop_program is not None else None)


def host_view(spec: SandboxSpec, *, list_dir: ListDir = host_listing, drop_program: str | None = None,
              as_root: bool | None = None) -> HostView | None:
    """The host view a sandbox of `spec` shows, with trainyard-drop where the job drops to its user (None under an
    image, whose root is one bind already)."""
    if spec.root is not None:
        return None
    binds = tuple(b.target for b in spec.binds)
    dropping = _drops_to(spec, os.geteuid() == 0 if as_root is None else as_root) is not None
    return host_view_of(_layout(spec, binds, list_dir).host_entries, drop_program if dropping else None, spec.devices)


def _drops_to(spec: SandboxSpec, as_root: bool) -> int | None:
    """The user the sandbox's first process drops to: where bwrap runs as root and the job has a user to run as."""
    return spec.run_as if as_root else None


def _folders_for(target: str, made: set[str]) -> list[str]:
    """The folders a mount at `target` goes into, made first where not made yet: bwrap, as root, would make them
    for the mount itself readable by root alone, and the job's user must go through them. `made` is added to."""
    args: list[str] = []
    for parent in _parents(target):
        if parent not in made and parent not in OWN_MOUNTS:
            made.add(parent)
            args.extend(["--dir", parent])
    return args


def dropper(uid: int, *, image: bool, python: str = sys.executable, setpriv: str = "/usr/bin/setpriv",
            program: str | None = None, devpts: str | None = None) -> list[str]:
    """What becomes user and group `uid` with no groups, capabilities or new privileges, then runs what follows:
    `program` (trainyard-drop, where the sandbox shows it) when there is one, first mounting a devpts of the
    sandbox's own at `devpts` when asked."""
    if program is not None:
        return [program, *(("--devpts", devpts) if devpts is not None else ()), str(uid)]
    if image:
        return [python, "-I", "-S", "-c", PYTHON_DROPPER, str(uid)]
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
            "--no-new-privs", "--"]


@functools.cache
def built_drop_program(python: str = sys.executable) -> str | None:
    """trainyard-drop beside the agent's Python, where `make install` could build it (None: setpriv drops)."""
    return built_program(DROP_PROGRAM, python)


def built_program(name: str, python: str = sys.executable) -> str | None:
    """The program `name` that `make install` builds beside the agent's Python, where it could (None: not there)."""
    program = Path(python).with_name(name)
    return str(program) if is_executable_file(str(program)) else None


@dataclass(frozen=True)
class _Layout:
    """A sandbox's command but for its own mounts: the root's entries (before them), then the host's root, the
    hidden and kept paths and the last remounts. It depends on where the sandbox's mounts go, never on what they
    bind (a rank's own folders), and on the listings of the host directories shown, which it keeps."""

    before: tuple[str, ...]
    host: tuple[str, ...]  # what shows the host's root at HOST (an image's, or each shown entry bound there)
    after: tuple[str, ...]
    host_entries: tuple[str, ...]  # the host root's entries bound at HOST (without an image)
    replaced: frozenset[str]  # the paths the job sees something else at
    folders: frozenset[str]  # the folders it makes in the sandbox's root (those that hold new paths)
    listings: tuple[tuple[str, Sequence[HostEntry]], ...]  # each directory listed, and what it held


# The layouts of the last few sandbox shapes (every job of a kind has the same), kept only for an agent's
# HostListing: its listings are tuples, the same one as long as the directory is unchanged, so a layout whose
# directories all list as the very tuples it was made from is the one they would make again.
_LAYOUTS: collections.OrderedDict[tuple[object, ...], _Layout] = collections.OrderedDict()
LAYOUTS_KEPT = 32


def _layout(spec: SandboxSpec, targets: tuple[str, ...], list_dir: ListDir) -> _Layout:
    if not isinstance(list_dir, HostListing):
        return _make_layout(spec, targets, list_dir)
    key = (list_dir, spec.root, targets, tuple(spec.dirs), tuple(spec.keep), tuple(spec.hidden), spec.cwd,
           tuple(spec.system))
    known = _LAYOUTS.get(key)
    if known is not None and all(list_dir(path) is entries for path, entries in known.listings):
        _LAYOUTS.move_to_end(key)
        return known
    layout = _LAYOUTS[key] = _make_layout(spec, targets, list_dir)
    if len(_LAYOUTS) > LAYOUTS_KEPT:
        _LAYOUTS.popitem(last=False)
    return layout


def _make_layout(spec: SandboxSpec, targets: tuple[str, ...], list_dir: ListDir) -> _Layout:
    image = spec.root is not None
    own = [WORKSPACE, *spec.dirs, *targets]  # paths the sandbox provides
    replaced = {*OWN_MOUNTS, *own, *(IMAGE_HOST_MOUNTS if image else ())}  # paths the job sees something else at
    holding = {parent for path in own for parent in _parents(path)}  # folders that must hold new paths
    root = str(spec.root) if spec.root is not None else "/"
    visible = _visibility(spec)
    args: list[str] = []
    covered: list[tuple[str, bool]] = []  # files of the root the sandbox shows its own at: hidden under HOST too
    listings: list[tuple[str, Sequence[HostEntry]]] = []
    host_entries: list[str] = []  # the host root's entries bound under HOST (without an image)
    folders: set[str] = set()

    def listed(directory: str) -> Sequence[HostEntry]:
        path = directory if not image else root.rstrip("/") + directory
        listings.append((path, list_dir(path)))
        return listings[-1][1]

    def show(directory: str, depth: int) -> None:
        for entry in listed(directory):
            path = _join(directory, entry.name)
            if depth == 0 and entry.link is None and visible(path):
                host_entries.append(path)
            if path in replaced or path == HOST:
                if entry.link is None and path not in ("/proc", "/dev") and visible(path):
                    covered.append((HOST + path, entry.is_dir))
            elif path in holding:
                if entry.is_dir:  # made here, its entries (of a folder shown) shown one by one
                    args.extend(["--dir", path])
                    folders.add(path)
                    if visible(path):
                        show(path, depth + 1)
            elif entry.link is not None:
                args.extend(["--symlink", entry.link, path])
            elif visible(path):
                args.extend(["--symlink", "../" * depth + HOST.lstrip("/") + path, path])

    show("/", 0)
    before = tuple(args)
    host = ("--ro-bind", root, HOST) if image else ("--dir", HOST, *(
        arg for path in host_entries for arg in ("--ro-bind", path, HOST + path)))
    args = []
    for place, is_dir in covered:
        args.extend(_hide(place, is_dir))
    hidden_dirs = [place for place, is_dir in covered if is_dir]
    if not image:  # under an image the host's files are not there to hide, and kept paths are bound
        args.extend(_hidden_and_kept(spec, replaced, covered, hidden_dirs))
    if image:  # of the host, only the kept paths are there: what is hidden inside them is hidden there
        kept = [str(path) for path in spec.keep]
        for hidden in sorted(spec.hidden, key=lambda h: _depth(str(h.path))):
            if any(_inside(str(hidden.path), path) for path in kept):
                args.extend(_hide(str(hidden.path), hidden.is_dir))
                if hidden.is_dir:
                    hidden_dirs.append(str(hidden.path))
    for place in hidden_dirs:  # an empty folder the job cannot write to either
        args.extend(["--remount-ro", place])
    # The tmpfs root itself (and the folders made in it, such as /etc) takes no writes either.
    args.extend(["--remount-ro", "/", "--chdir", spec.cwd])
    return _Layout(before=before, host=host, after=tuple(args), host_entries=tuple(host_entries),
                   replaced=frozenset(replaced), folders=frozenset(folders), listings=tuple(listings))


def _visibility(spec: SandboxSpec) -> Callable[[str], bool]:
    """Whether the host's file at a path is there to see under HOST: in a shown entry of the host's root (every
    entry of an image's)."""
    if spec.root is not None:
        return lambda path: True
    shown = frozenset(spec.system)
    return lambda path: path == "/" or path.split("/", 2)[1] in shown


def runs_directly(spec: SandboxSpec, argv: Sequence[str], search_path: str | None, replaced: AbstractSet[str],
                  executable: Callable[[str], bool] = is_executable_file,
                  folders: AbstractSet[str] = frozenset()) -> bool:
    """Whether argv[0] is found, inside the sandbox, as the executable host file at the same path: on the host's
    root (no image), neither at nor under a path the sandbox shows something else at or hides, and, looked up on
    `search_path`, in the first folder holding it, with no folder before that the sandbox shows otherwise; a
    folder that is nowhere inside (`_absent_inside`; `folders`: those the sandbox makes in its root) is passed
    over, as the shell passes over it."""
    if spec.root is not None or not argv:
        return False
    covered = frozenset(replaced).union(str(entry.path) for entry in spec.hidden)
    shown = frozenset(spec.system)
    kept = frozenset(str(path) for path in spec.keep)

    def seen_as_on_host(path: str) -> bool:
        return _seen_as_on_host(path, covered, shown, kept)

    name = argv[0]
    if "/" in name:
        return name.startswith("/") and seen_as_on_host(name) and executable(name)
    if not search_path:
        return False
    made = covered.union(kept, folders, (HOST,))
    for folder in search_path.split(":"):
        if folder.startswith("/") and not seen_as_on_host(folder) and _absent_inside(folder, made):
            continue  # such as a folder of the agent's user's home on the agent's PATH
        if not folder.startswith("/") or not seen_as_on_host(folder):
            return False  # the working folder, or one that holds other files inside: as the shell finds it
        candidate = _join(folder, name)
        if executable(candidate):
            return seen_as_on_host(candidate)
    return False


def _kept_binds(keep: Sequence[Path]) -> list[Bind]:
    """Under an image, the kept host paths bound where they are on the host (those inside another once)."""
    paths = sorted(dict.fromkeys(str(path) for path in keep), key=_depth)
    outermost: list[str] = []
    for path in paths:
        if not any(_inside(path, other) for other in outermost):
            outermost.append(path)
    return [Bind(source=Path(path), target=path, read_only=True) for path in outermost]


def _hidden_and_kept(spec: SandboxSpec, replaced: AbstractSet[str], covered: list[tuple[str, bool]],
                     hidden_dirs: list[str]) -> list[str]:
    """Hide each hidden path where the job would see it, and bind each kept path the job would not see
    again where it is looked for; parents first, so that a path kept inside a hidden folder is bound
    after the hiding, and one hidden inside a kept path after the binding. `hidden_dirs` is added to."""
    args: list[str] = []
    kept: list[tuple[str, str]] = []  # kept host path, and where it is bound
    layers: list[tuple[str, bool, bool]] = [(place, is_dir, True) for place, is_dir in covered]  # place, dir, hides
    visible = _visibility(spec)
    made: set[str] = set()

    def place_of(path: str) -> str | None:
        """Where the host's `path` is inside; None where the sandbox shows something else, or nothing."""
        for host, at in reversed(kept):
            if _inside(path, host):
                return at + path[len(host):]
        if _under(path, replaced) or not visible(path):
            return None
        return HOST + path

    def hidden(place: str) -> bool:
        for layer, is_dir, hides in reversed(layers):  # the last one made over it decides
            if place == layer or (is_dir and _inside(place, layer)):
                return hides
        return False

    paths = [(str(h.path), h.is_dir, True) for h in spec.hidden] + [(str(k), True, False) for k in spec.keep]
    for path, is_dir, hides in sorted(dict.fromkeys(paths), key=lambda p: (_depth(p[0]), not p[2])):
        place = place_of(path)
        if hides:
            if place is None or path == "/" or hidden(place):
                continue  # not to be seen anyway
            args.extend(_hide(place, is_dir))
            if is_dir:
                hidden_dirs.append(place)
        else:
            if place is not None and not hidden(place):
                continue  # the job sees it already
            place = place or path  # under a path the sandbox replaces or does not show: bound where it is looked for
            if not _inside(place, HOST):
                args.extend(_folders_for(place, made))
            args.extend(["--ro-bind", path, place])
            kept.append((path, place))
        layers.append((place, is_dir, hides))
    return args
