"""The holder of a node's commands: what lets a job outlive its agent (as slurmstepd outlives slurmd).

An agent runs one holder (`holder.py --serve`, in a session of its own) and gives it each rank's
command as a line on its standard input: the rank's folder, argv, environment and working directory.
The holder starts the command in a session and process group of its own (so a stop reaches every
child it forks), its output to the folder's `output.log`, and answers `started <pid>`; once the
command ended, it reaps it and tells `ended <pid> <folder and exit record>`; the exit is written to `exit.json` in
the rank's folder only while nobody was told of it: once the agent, having reported the exit, answers
`reported <pid>`, the holder forgets it, so a short job's end costs no file of its own (each file made
and removed for every job costs the file system more the more of them it freed lately). When the agent
goes away (its input ends, or its pipe breaks), every exit it was told of and did not confirm is
written to `exit.json`, and so is every later one. Nothing of the command hangs on the agent: no pipe
breaks when the agent is killed or restarted, and a new agent adopts the command from these files
(agent/processes/holder_client.py): it ships the output from where the last one stopped and reports the exit when it
comes. Once its input ends (the agent is gone), the holder waits for the commands it started, then
ends, so none is left a zombie; a restarted agent starts a holder of its own.

Started without `--tell-exits` (by an agent from before it), the holder writes every exit to `exit.json`
before it tells `ended <pid>`, as that agent expects.

One holder holds every command of its agent, each started with posix_spawn: a Python started for
each rank cost about 20 ms of CPU, a holder forked for each rank about 3 ms (a Python process, its
files), more than the rest of a short job's start. A holder killed takes the record of all its
commands' exits with it: each of them then counts as killed (agent/processes/holder_client.py).

The holder is the subreaper of what its commands leave behind (`become_subreaper`), and reaps it: the first process
of each bwrap sandbox outlives bwrap by a moment.

A holder running as root starts the bwrap sandboxes it is asked for (`"sandbox": true` in the request) from a mount
namespace of its own (`SandboxMounts`): a private copy of the host's without the mounts no sandbox shows (the host's
cgroup hierarchies, terminals, shared memory and message queues, kernel debugging and tracing interfaces, what is
mounted inside /proc). bwrap reads its whole mount table again after each of a sandbox's mounts (some twenty a
start), and copies it into the sandbox first: on this kind of machine 16 of the host's 20 mounts went, and a
sandbox's start cost about 0.9 ms of CPU less (5.3 against 4.4); a host with containers of its own has hundreds
more. The copy is made again before the next start once the host's mount table changed (storage mounted later is
there for the next job). Other commands start in the host's namespace, as the holder itself runs. In that namespace it
also makes the host views sandboxes ask for (`"view"` in the request, agent/isolation/sandbox.py HostView), once each,
and the /dev a view asks for with it (`"devices"`), which sandboxes bind whole instead of bwrap's --dev.

Run as `python -I -S holder.py --serve`: standard library only, so that it needs no installed package
and reads no PYTHON* variable. It carries none of the job's TRAINYARD_* variables itself, so a stop
that kills every process of the attempt leaves it alive to record the exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import re
import select
import selectors
import shutil
import signal
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

OUTPUT_NAME = "output.log"
EXIT_NAME = "exit.json"  # {"exit_code": ..., "exited_at": ..., "started": ...}
# Ignored by the holder (by Python itself, or by `main` below): a command gets them back as any process
# starts with them (what subprocess's restore_signals does for the first two), so that a job stopped with
# SIGINT as its checkpoint signal, or a pipeline whose reader ended, behaves as it would from a shell.
RESTORED_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGHUP, signal.SIGINT)
PR_SET_CHILD_SUBREAPER = 36  # prctl: orphans of this process's descendants become its children
# Mount namespaces (<sched.h>, <sys/mount.h>): unshare and setns a mount namespace, make mounts private to it,
# detach a mount (lazily, with what is mounted inside it).
CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
VIEWS_KEPT = 16  # host views one holder makes at most (each set of paths a view of its own; a host's few)
# A host view's mounts, read-only (a bind's flags change with MS_BIND | MS_REMOUNT, a file system's without MS_BIND).
READ_ONLY = MS_RDONLY | MS_NOSUID | MS_NODEV
# What bwrap's --dev puts in a sandbox's /dev: these devices bound from the host's, and these links.
STANDARD_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
DEVICE_LINKS = (("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"),
                ("fd", "/proc/self/fd"), ("core", "/proc/kcore"), ("ptmx", "pts/ptmx"))
# A view a holder makes: ("host", its binds) or ("devices", the devices of a /dev besides the standard ones).
ViewKey = tuple[str, tuple[Any, ...]]
# Mounts no sandbox shows, by filesystem type: the host's cgroup hierarchies (a sandbox has a cgroup namespace of
# its own), terminals, message queues and huge pages (a sandbox has a /dev of its own), and the kernel's debugging,
# tracing, security, BPF, crash-record, configuration, FUSE-control and binary-format interfaces, and other processes'
# namespaces kept as files (nsfs). By mount point: what is mounted inside /proc (a sandbox mounts a /proc of its own),
# the host's shared memory, anything in its cgroup folder, and the folder `ip netns` keeps network namespaces in. Device
# nodes bound into /dev stay: an accelerator is bound from there.
UNSHOWN_TYPES = frozenset({"cgroup", "cgroup2", "devpts", "mqueue", "hugetlbfs", "debugfs", "tracefs", "securityfs",
                           "bpf", "pstore", "configfs", "fusectl", "binfmt_misc", "nsfs"})
UNSHOWN_POINTS = ("/dev/shm", "/sys/fs/cgroup", "/run/netns")


def write_atomically(path: Path, text: str) -> None:
    """Readers see the whole file or none of it."""
    partial = path.with_name(f".{path.name}.tmp")
    partial.write_text(text)
    partial.replace(path)


def exit_fields(code: int, *, started: bool) -> dict[str, object]:
    # A process killed by signal N reports -N; shells report 128+N. Use the shell convention.
    return {"exit_code": 128 - code if code < 0 else code, "started": started,
            "exited_at": datetime.now(UTC).isoformat()}


def exit_record(fields: dict[str, object]) -> str:
    """What `exit.json` holds: the fields of `exit_fields`."""
    return json.dumps(fields, separators=(",", ":"))


def start_ticks(pid: int, *, ended: bool = False) -> int | None:
    """When `pid` started, in clock ticks since boot (None: no such process, or one that ended, unless
    `ended`: a child not reaped yet): with the pid, it names a process for as long as the system runs."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") and not ended else int(fields[19])


def unshown_mounts(mountinfo: bytes) -> list[bytes]:
    """The mount points, in a mount table as /proc/<pid>/mountinfo gives it, of the mounts no sandbox shows
    (UNSHOWN_TYPES, UNSHOWN_POINTS, inside /proc), deepest first; one for each mount (a point mounted over twice
    is named twice)."""
    found: list[bytes] = []
    for line in mountinfo.splitlines():
        fields = line.split()
        try:
            point, kind = _unescaped(fields[4]), fields[fields.index(b"-") + 1].decode(errors="replace")
        except (IndexError, ValueError):
            continue
        if point == b"/":
            continue
        if (kind in UNSHOWN_TYPES or point.startswith(b"/proc/")
                or any(point == p.encode() or point.startswith(p.encode() + b"/") for p in UNSHOWN_POINTS)):
            found.append(point)
    return sorted(found, key=lambda point: point.count(b"/"), reverse=True)


def _unescaped(field: bytes) -> bytes:
    """A mountinfo path: the kernel writes a space, tab, newline and backslash as an octal escape (\\040)."""
    return re.sub(rb"\\([0-7]{3})", lambda found: bytes([int(found[1], 8)]), field)


class ViewAsked(NamedTuple):
    """A host view a start asks for: the placeholder its argv binds at the view's place, each host path with the name
    it is shown at, and where the holder's /dev is asked for too, the placeholder argv binds at /dev and the
    accelerator devices in it (besides `STANDARD_DEVICES`)."""

    source: str
    binds: tuple[tuple[str, str], ...]
    devices_source: str | None = None
    devices: tuple[str, ...] = ()


def view_of(text: object) -> ViewAsked | None:
    """A start's `view`, JSON text of {"source": ..., "binds": [[host path, name], ...], "devices": {"source": ...,
    "paths": [device, ...]}} ("devices" optional): names relative, without `..`, devices under /dev; None when it is
    not one. Every sandbox of a node carries the same few: each is read once."""
    return _read_view(text) if isinstance(text, str) else None


@functools.lru_cache(maxsize=64)
def _read_view(text: str) -> ViewAsked | None:
    try:
        found = json.loads(text)
        source, binds = str(found["source"]), tuple((str(path), str(name)) for path, name in found["binds"])
        asked = found.get("devices")
        devices_source = None if asked is None else str(asked["source"])
        devices = () if asked is None else tuple(str(path) for path in asked["paths"])
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    for path, name in binds:
        if not os.path.isabs(path) or not _plain(name):
            return None
    if not all(device.startswith("/dev/") and _plain(device.removeprefix("/dev/")) for device in devices):
        return None
    return ViewAsked(source, binds, devices_source, devices)


def _plain(name: str) -> bool:
    """A relative path that stays where it starts (no empty, `.` or `..` part)."""
    return not name.startswith("/") and all(part not in ("", ".", "..") for part in name.split("/"))


def with_view(argv: list[str], source: str, binds: tuple[tuple[str, str], ...], place: str | None) -> list[str]:
    """bwrap's `argv` with its `--ro-bind <source> <dest>` of a host view made real: the view's `place`, or where
    there is none, `dest` made and each host path bound in it on its own (the same files, more mounts). Only bwrap's
    options are looked at (what follows `--` is the job's); a command that binds no view is left as it is."""
    for at in range(1, len(argv) - 1):
        if argv[at] == "--":
            break
        if argv[at] == source and argv[at - 1] == "--ro-bind":
            dest = argv[at + 1]
            if place is not None:
                return [*argv[:at], place, *argv[at + 1:]]
            each = [arg for path, name in binds for arg in ("--ro-bind", path, f"{dest.rstrip('/')}/{name}")]
            return [*argv[:at - 1], "--dir", dest, *each, *argv[at + 2:]]
    return argv


def with_devices(argv: list[str], source: str, devices: tuple[str, ...], place: str | None) -> list[str]:
    """bwrap's `argv` with its `--dev-bind <source> <dest>` of the holder's /dev made real: that /dev's `place`, or
    where there is none, bwrap's own /dev with each device bound in it (`--dev`, as a sandbox without a view has)."""
    for at in range(1, len(argv) - 1):
        if argv[at] == "--":
            break
        if argv[at] == source and argv[at - 1] == "--dev-bind":
            if place is not None:
                return [*argv[:at], place, *argv[at + 1:]]
            each = [arg for device in devices for arg in ("--dev-bind-try", device, device)]
            return [*argv[:at - 1], "--dev", argv[at + 1], *each, *argv[at + 2:]]
    return argv


class SandboxMounts:
    """The mount namespace the holder starts sandboxes from: the host's, without the mounts no sandbox shows
    (`unshown_mounts`), made again once the host's mount table changed. The holder itself stays in the host's
    namespace and goes into this one only to start a sandbox (`entered`). `prepared()` is None where it cannot be
    made (not root, not Linux): sandboxes then start from the host's namespace, as any command.

    It also holds host views (`view`): a read-only tmpfs with host paths bound in it read-only, made once in this
    namespace, which a sandbox binds whole (one bind where it took one for each path: bwrap reads its whole mount
    table again after each, agent/isolation/sandbox.py), and views of /dev (`devices`): what bwrap's --dev makes but
    its devpts, the same way. A view is made again with the namespace, at the same place, so a sandbox's command
    stays valid; on the host its place is an empty folder the holder removes as it ends."""

    def __init__(self, libc: Any, host: int, table: Any) -> None:
        self._libc = libc
        self._host = host  # the host's namespace
        self._table = table  # the host's mount table, open: its poll tells a change
        self._changes = select.poll()
        self._changes.register(table.fileno(), select.POLLPRI | select.POLLERR)
        self._copy: int | None = None  # the namespace sandboxes start from, once made
        self._views: dict[ViewKey, str] = {}  # each view (its binds, or its /dev's devices), and its place
        self._unmade: set[ViewKey] = set()  # views that could not be made in this copy
        self._places: str | None = None  # the folder the views' places are made in, once there is one
        self._made_views = 0  # views made so far: the next one's place is named after the count

    @classmethod
    def prepared(cls) -> SandboxMounts | None:
        if not sys.platform.startswith("linux") or os.geteuid() != 0:
            return None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            host = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            table = open("/proc/self/mountinfo", "rb")  # noqa: SIM115 - open for as long as the holder runs
        except (OSError, AttributeError):
            return None
        mounts = cls(libc, host, table)
        return mounts if mounts._made() else None

    def _made(self) -> bool:
        """Make the copy again from the host's namespace, where the holder is; whether there is one."""
        if self._copy is not None:
            os.close(self._copy)  # the sandboxes started from it have copies of their own
            self._copy = None
        for place in self._views.values():  # on the host, an empty folder a cleaner of old files may have taken
            with contextlib.suppress(OSError):
                os.makedirs(place, mode=0o755, exist_ok=True)
        if self._libc.unshare(CLONE_NEWNS) != 0:
            return False
        try:
            # Private first, so that nothing detached here is detached on the host.
            if self._libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
                return False
            with open("/proc/self/mountinfo", "rb") as table:
                for point in unshown_mounts(table.read()):
                    self._libc.umount2(point, MNT_DETACH)  # one already gone with its parent: EINVAL, ignored
            self._unmade.clear()
            for key, place in list(self._views.items()):
                if not self._mount(place, key):
                    del self._views[key]  # later sandboxes of it bind each path on their own
                    self._unmade.add(key)
            self._copy = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            return True
        finally:
            self._enter(self._host)

    def view(self, binds: tuple[tuple[str, str], ...]) -> str | None:
        """The place of a view holding each host path of `binds` at its name, made now unless it was already (None:
        it cannot be made here, sandboxes bind each path themselves)."""
        return self._view(("host", binds))

    def devices(self, devices: tuple[str, ...]) -> str | None:
        """The place of a sandbox's /dev as bwrap's --dev makes it, with `devices` in it too and no devpts (the
        sandbox mounts its own), made now unless it was already (None: it cannot be made here, sandboxes make their
        own /dev)."""
        return self._view(("devices", devices))

    def _view(self, key: ViewKey) -> str | None:
        if self._changes.poll(0):
            self._made()
        if self._copy is None:  # sandboxes start from the host's namespace, where no view is mounted
            return None
        if (known := self._views.get(key)) is not None:
            return known
        if key in self._unmade or len(self._views) >= VIEWS_KEPT:
            return None
        try:
            if self._places is None:
                # 0700, the holder's user's (root); named after the holder, so that one left by a holder killed is
                # known for whose it was.
                self._places = tempfile.mkdtemp(prefix=f"trainyard-views-{os.getpid()}-")
            place = os.path.join(self._places, str(self._made_views))
            self._made_views += 1
            os.mkdir(place, 0o755)
        except OSError:
            self._unmade.add(key)
            return None
        self._enter(self._copy)
        try:
            made = self._mount(place, key)
        finally:
            self._enter(self._host)
        if not made:
            self._unmade.add(key)
            with contextlib.suppress(OSError):
                os.rmdir(place)
            return None
        self._views[key] = place
        return place

    def _mount(self, place: str, key: ViewKey) -> bool:
        kind, what = key
        return self._mount_view(place, what) if kind == "host" else self._mount_devices(place, what)

    def _mount_devices(self, place: str, devices: tuple[str, ...]) -> bool:
        """In the namespace entered: at `place`, what bwrap's --dev makes but the devpts (the six devices of the
        host's /dev, the links to the process's own descriptors, pts/ptmx, an empty shm), and each of `devices` that
        is there, the whole read-only, without set-user-ID programs. Each device is a node of the same number, mode
        and owner made there rather than a bind (a folder of devices is bound): the view is one mount, where each
        mount more in this namespace costs every sandbox's start some 40 us of CPU (copied with the namespace, read
        with each look at the table, taken down at its end). Whether it was made."""
        def fill() -> None:
            for name in STANDARD_DEVICES:
                self._device_node(f"/dev/{name}", os.path.join(place, name))
            for device in devices:  # one gone since it was listed is left out, as bwrap's --dev-bind-try does
                with contextlib.suppress(FileNotFoundError):
                    self._device_node(device, os.path.join(place, device.removeprefix("/dev/")))
            for name, target in DEVICE_LINKS:
                os.symlink(target, os.path.join(place, name))
            for name in ("pts", "shm"):
                os.mkdir(os.path.join(place, name), 0o755)

        return self._made_view(place, fill, devices=True)

    def _device_node(self, source: str, target: str) -> None:
        """The host's device `source` made again at `target` (a folder of devices bound there)."""
        found = os.stat(source)
        if not (stat.S_ISCHR(found.st_mode) or stat.S_ISBLK(found.st_mode)):
            self._bind(source, target, MS_NOSUID)
            return
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        os.mknod(target, stat.S_IFMT(found.st_mode) | stat.S_IMODE(found.st_mode), found.st_rdev)
        os.chown(target, found.st_uid, found.st_gid)
        os.chmod(target, stat.S_IMODE(found.st_mode))  # as the host has it, whatever the holder's umask

    def _mount_view(self, place: str, binds: tuple[tuple[str, str], ...]) -> bool:
        """In the namespace entered: a tmpfs at `place` with each host path in it at its name (with what is mounted
        inside it), then all of it read-only. A folder is bound; a file (trainyard-drop) is copied, a mount less for
        every sandbox's start to go through (`_mount_devices`). Whether it was made."""
        def fill() -> None:
            for source, name in binds:
                target = os.path.join(place, name)
                if os.path.isfile(source):
                    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
                    shutil.copyfile(source, target)
                    os.chmod(target, 0o555)
                else:
                    self._bind(source, target, READ_ONLY)

        return self._made_view(place, fill)

    def _made_view(self, place: str, fill: Callable[[], None], *, devices: bool = False) -> bool:
        """A tmpfs at `place` (whose device nodes work, with `devices`), filled, then read-only; whether it was made
        (what was made of it otherwise is detached)."""
        flags = MS_NOSUID | (0 if devices else MS_NODEV)
        if self._libc.mount(b"tmpfs", place.encode(), b"tmpfs", flags, b"mode=0755") != 0:
            return False
        try:
            fill()
            if self._libc.mount(None, place.encode(), None, MS_REMOUNT | MS_RDONLY | flags, b"mode=0755") != 0:
                raise OSError(ctypes.get_errno(), "cannot make the view read-only")
        except OSError:
            self._libc.umount2(place.encode(), MNT_DETACH)
            return False
        return True

    def _bind(self, source: str, target: str, flags: int) -> None:
        """The host's `source` (a file or a folder, with what is mounted inside it) bound at `target` in a view, with
        the mount `flags`."""
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        if os.path.isdir(source):
            os.mkdir(target, 0o755)
        elif os.path.exists(source):
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444))
        else:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), source)
        if (self._libc.mount(source.encode(), target.encode(), None, MS_BIND | MS_REC, None) != 0
                or self._libc.mount(None, target.encode(), None, MS_BIND | MS_REMOUNT | flags, None) != 0):
            raise OSError(ctypes.get_errno(), f"cannot bind {source}")

    def close(self) -> None:
        """Remove the views' places on the host (empty folders there)."""
        if self._places is not None:
            shutil.rmtree(self._places, ignore_errors=True)

    def _enter(self, namespace: int) -> None:
        if self._libc.setns(namespace, CLONE_NEWNS) != 0:
            number = ctypes.get_errno()
            raise OSError(number, f"cannot enter a mount namespace: {os.strerror(number)}")

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """In the sandboxes' namespace (the host's, where it could not be made), then back in the host's."""
        if self._changes.poll(0):  # reading the table's poll also marks the change seen
            self._made()
        if self._copy is None:
            yield
            return
        self._enter(self._copy)
        try:
            yield
        finally:
            self._enter(self._host)


def spawn(argv: list[str], env: dict[str, str], cwd: str, output: int) -> int:
    """Start `argv` as the leader of a new session, in `cwd`, reading nothing and writing to `output`;
    found on the PATH of `env` as subprocess finds it. Its pid; OSError when it cannot start."""
    name = argv[0]
    paths = [name] if os.sep in name else [os.path.join(d, name) for d in os.get_exec_path(env)]
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
               (os.POSIX_SPAWN_DUP2, output, 1), (os.POSIX_SPAWN_DUP2, output, 2)]
    missing: OSError | None = None  # as execvp: a name found nowhere, unless found somewhere but refused
    refused: OSError | None = None
    os.chdir(cwd)  # posix_spawn has no working directory of its own: the child takes the holder's
    try:
        for path in paths:
            if len(paths) > 1 and not os.path.exists(path):  # a look is cheaper than a process that fails
                missing = missing or FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
                continue
            try:
                return os.posix_spawn(path, argv, env, file_actions=actions, setsid=True,
                                      setsigdef=RESTORED_SIGNALS)
            except (FileNotFoundError, NotADirectoryError) as exc:
                missing = exc
            except OSError as exc:
                refused = refused or exc
    finally:
        os.chdir("/")
    error = refused or missing
    number = error.errno if error is not None and error.errno is not None else errno.ENOENT
    raise OSError(number, os.strerror(number), name)


def start(request: bytes, mounts: SandboxMounts | None = None) -> tuple[int, Path] | None:
    """Start the command a request line describes: its pid and folder; pid 0 when it could not start (its
    output says why, its exit is recorded); None when nothing could be recorded. A sandbox starts from `mounts`."""
    try:
        spec = json.loads(request)
        folder, argv, env, cwd = str(spec["folder"]), list(spec["argv"]), dict(spec["env"]), str(spec["cwd"])
        sandbox = spec.get("sandbox") is True
        output = os.open(os.path.join(folder, OUTPUT_NAME), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except Exception:  # not a request it can even record: the agent is told, and nothing else changes
        return None
    try:
        if sandbox and "view" in spec:  # a host view, made once here, bound whole (else each of its paths)
            if (view := view_of(spec["view"])) is None:
                raise ValueError("the request's host view is not one")
            argv = with_view(argv, view.source, view.binds, mounts.view(view.binds) if mounts is not None else None)
            if view.devices_source is not None:  # and its /dev (else bwrap's own)
                argv = with_devices(argv, view.devices_source, view.devices,
                                    mounts.devices(view.devices) if mounts is not None else None)
        with mounts.entered() if sandbox and mounts is not None else contextlib.nullcontext():
            return spawn(argv, env, cwd, output), Path(folder)
    except Exception as exc:  # whatever a request holds, the holder goes on holding every other command
        try:
            os.write(output, f"[trainyard] cannot start {argv[0] if argv else ''!r}: {exc}\n".encode())
            write_atomically(Path(folder, EXIT_NAME), exit_record(exit_fields(127, started=False)))
        except OSError:
            return None
        return 0, Path(folder)
    finally:
        os.close(output)


def _reaped() -> list[tuple[int, int]]:
    """The commands that ended since the last look, reaped: each pid and exit code (and what they left behind,
    `become_subreaper`, reaped the same)."""
    ended: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append((pid, os.waitstatus_to_exitcode(status)))


def told_exit(folder: Path, fields: dict[str, object]) -> str:
    """An exit as the agent is told it, on one line: the rank's folder with the record (a pid alone could name
    an earlier command whose exit is not read yet)."""
    return json.dumps({"folder": str(folder), **fields}, separators=(",", ":"))


def record_exit(folder: Path, record: str) -> None:
    with contextlib.suppress(OSError):  # the folder is gone: the agent counts it as killed
        write_atomically(folder / EXIT_NAME, record)


def serve(tell_exits: bool = False, mounts: SandboxMounts | None = None) -> int:
    """Start a command for each request line on standard input, answering `started <pid>` on standard
    output (`started 0`: it could not start, and says so in its output; `failed`: not even that could be
    recorded), and tell `ended <pid>` once one ended, so the agent learns it at once. `tell_exits`: with
    its folder and exit record (`ended <pid> <told_exit>`), the record written to the rank's folder only
    when the agent goes away before it answers `reported <pid>`; otherwise every exit is written there before
    it is told.
    Once the input ends (the agent is gone), wait for the commands, then end."""
    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_write)  # SIGCHLD wakes the select below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    running: dict[int, Path] = {}  # pid -> its rank's folder
    told: dict[int, tuple[Path, str]] = {}  # pid -> its folder and exit record, told and not yet reported
    pending, listening, telling = b"", True, True
    while listening or running:
        lines: list[str] = []
        for key, _ in selector.select():
            if key.fd == wake_read:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_read, 4096)
                continue
            data = os.read(0, 65536)
            if not data:
                listening = False
                selector.unregister(0)
            pending += data
            while b"\n" in pending:
                line, _, pending = pending.partition(b"\n")
                if line.startswith(b"reported "):  # the agent reported that exit: nothing to keep of it
                    with contextlib.suppress(ValueError):
                        told.pop(int(line.split()[1]), None)
                    continue
                started = start(line, mounts)
                if started is None:
                    lines.append("failed\n")
                    continue
                pid, folder = started
                if pid:
                    running[pid] = folder
                lines.append(f"started {pid}\n")
        for pid, code in _reaped():  # after the answers: a command's start is told before its end
            if (rank := running.pop(pid, None)) is not None:
                fields = exit_fields(code, started=True)
                record = exit_record(fields)
                if tell_exits and telling and listening:
                    if pid in told:  # its pid was used again before the agent reported the last exit under it
                        record_exit(rank, record)
                    else:
                        told[pid] = (rank, record)
                    lines.append(f"ended {pid} {told_exit(rank, fields)}\n")
                else:
                    record_exit(rank, record)
                    lines.append(f"ended {pid}\n")
        if lines and telling:
            try:
                os.write(1, "".join(lines).encode())
            except BrokenPipeError:  # the agent is gone: its commands are still waited for
                telling = False
        if told and not (telling and listening):  # nobody will report these: a next agent reads them
            for rank, record in told.values():
                record_exit(rank, record)
            told.clear()
    return 0


def become_subreaper() -> None:
    """Have the processes the commands leave behind reaped here rather than by the machine's init: bwrap ends
    once its sandbox's first process told it the command's exit, before that process ends, so without this the
    sandbox's first process and the command (most of a short job's CPU) would be nobody's child's time here."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def main() -> int:
    # A terminal's hang-up or interrupt is not meant for the holder; a stop is sent to the command.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    become_subreaper()
    mounts = SandboxMounts.prepared()
    try:
        return serve(tell_exits="--tell-exits" in sys.argv[1:], mounts=mounts)
    finally:
        if mounts is not None:
            mounts.close()


if __name__ == "__main__":
    sys.exit(main())
