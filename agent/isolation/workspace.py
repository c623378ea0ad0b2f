"""The per-job workspace of one node (SPEC L1), on one of two backends.

- `bwrap`: the node runs under bubblewrap in a mount namespace of its own (see agent/isolation/sandbox.py).
  /workspace and the generated files (/etc/mpi/hostfile, /job/hostfile, ...) are the real paths,
  each mount is a bind mount of shared storage, and read-only mounts are really read-only.
- `plain`: for machines without a usable bwrap. The /workspace tree is built under a per-job root:
  each mount is a symlink into shared storage and generated files are written beside it. Paths the
  job was given as `/workspace/...` or as an absolute file path are mapped to their place under the
  root, and the job is told where it is through TRAINYARD_WORKSPACE.

The agent picks one at start (`choose_backend`): TRAINYARD_WORKSPACE_BACKEND=bwrap|plain|auto,
where auto (the default) is bwrap when a trial run of it works, else plain.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.caches.imagecache import ImageRoot
from agent.isolation.checkpoints import prepare_checkpoints
from agent.isolation.sandbox import (
    ACCELERATOR_DEVICES,
    WORKSPACE,
    Bind,
    Hidden,
    HostEntry,
    HostView,
    SandboxSpec,
    built_drop_program,
    built_program,
    bwrap_argv,
    host_listing,
    host_view,
)
from libs.contracts.events import NodeLaunch
from libs.jobusers import unnamed_plan_uid
from libs.storage import CHECKPOINT_TARGET

PLAIN = "plain"
RUN_FOLDER = "/run/trainyard"  # where a bubblewrapped job finds its run socket (agent/output/runs.py)
BWRAP = "bwrap"
BUILT_BWRAP = "trainyard-bwrap"  # bubblewrap as `make install` builds it, beside the agent's Python
BACKEND_VARIABLE = "TRAINYARD_WORKSPACE_BACKEND"
# An administrator's leave for the jobs of this node (of its pool) to run as root, in their sandbox and without any
# capability all the same: `1`. Otherwise an agent running as root runs each job as its unprivileged user (L1).
JOBS_AS_ROOT_VARIABLE = "TRAINYARD_JOBS_AS_ROOT"
# The skeleton every node gets, even when the job mounts nothing there.
SKELETON = ("algorithm", "anno_dataset", "dataset/private", "dataset/favorite", "model/pretrained",
            "model/private", "model/favorite", "outputs", "volume")
SKELETON_DIRS = tuple(f"{WORKSPACE}/{part}" for part in SKELETON)
PROBE_TIMEOUT_SECONDS = 10.0
PROBE_UID = 65534  # nobody: who the trial run of a sandbox runs as, where the agent is root
# What a job in an image sees of the host's /etc: how names resolve here, so ranks find each other as on the host.
HOST_FILES_IN_IMAGE = (Path("/etc/hosts"), Path("/etc/resolv.conf"))
# Said at the agent's start when jobs run without a sandbox.
PLAIN_WARNING = ("jobs run without a sandbox (plain backend): they can read every file the agent's user can, "
                 "including the platform's secrets and other jobs' files")


class WorkspaceError(Exception):
    """The workspace cannot be built; the message names the missing piece."""


@dataclass(frozen=True)
class Workspace:
    root: Path  # per job attempt and rank
    path: Path  # what /workspace means for this job: a folder under `root` (plain), or /workspace
    backend: str = PLAIN
    sandbox: SandboxSpec | None = None  # bwrap only
    # Writable mounts whose folder in shared storage belongs to another user, who keeps it (`give_to`): the job
    # cannot write there, which its log is told before it starts ("/workspace/outputs", the owner's uid).
    not_writable: tuple[tuple[str, int], ...] = ()

    def translate(self, text: str, files: Mapping[str, Path]) -> str:
        """Map `/workspace/...` and generated file paths to their real places (plain only)."""
        if self.backend == BWRAP:
            return text  # the paths are real inside the sandbox
        if text in files:
            return str(files[text])
        if text == "/workspace" or text.startswith("/workspace/"):
            return str(self.path) + text.removeprefix("/workspace")
        return text.replace("=/workspace/", f"={self.path}/")

    def command(self, argv: list[str], search_path: str | None = None, host_view: HostView | None = None) -> list[str]:
        """What the agent starts: the job's command itself, or bwrap running it (`search_path`: the PATH it is
        started with; `host_view`: the host's files shown through that view, for a holder to start)."""
        if self.sandbox is None:
            return argv
        return bwrap_argv(self.sandbox, argv, bwrap=_bwrap_path(), search_path=search_path,
                          drop_program=built_drop_program(), host_view=host_view)

    def host_view(self) -> HostView | None:
        """The host view a holder makes for this workspace's sandbox (None: none, it shows no host files or runs
        without a sandbox)."""
        if self.sandbox is None:
            return None
        return host_view(self.sandbox, drop_program=built_drop_program())

    @property
    def cwd(self) -> Path:
        """Where the agent starts the command (bwrap moves into /workspace/algorithm itself)."""
        if self.backend == BWRAP:
            return self.root
        algorithm = self.path / "algorithm"
        return algorithm if algorithm.exists() else self.path


def build_workspace(root: Path, storage: Path, launch: NodeLaunch, backend: str = PLAIN,
                    hidden: Sequence[Path] = (), staged: Mapping[str, Path] | None = None,
                    run_folder: Path | None = None, image: ImageRoot | None = None,
                    host_binds: Sequence[Path] = (), run_as: int | None = None) -> tuple[Workspace, dict[str, Path]]:
    """Prepare one node's workspace; returns it and where each generated file was written. Under bwrap,
    the `hidden` host paths (the platform's secrets and state) are not visible to the job. `staged`: the
    local copies of datasets (by their source), mounted instead of shared storage (J14). `run_folder`: the
    folder of the rank's run socket (R1), shown as /run/trainyard under bwrap. `image`: the unpacked image the
    job runs in (J10), with the host's name resolution and `host_binds` (an accelerator's driver files) in it.
    `run_as`: the user the job runs as under bwrap, which gets the folders the job writes to (None: as root)."""
    if image is not None and backend != BWRAP:
        raise WorkspaceError("the job runs in an image, which needs bubblewrap, and this node runs jobs without it "
                             f"({BACKEND_VARIABLE}={backend})")
    storage = storage.absolute()
    sources = []
    for mount in launch.mounts:
        source = (staged or {}).get(mount.source) or storage / mount.source
        if source == storage / mount.source:
            check_no_link(storage, mount.source, writable=not mount.read_only)
        if mount.target == CHECKPOINT_TARGET and not mount.read_only:
            prepare_checkpoints(source)  # this attempt's own folder, starting from the last one's
        elif not source.exists():
            if mount.read_only:
                raise WorkspaceError(f"{mount.source} does not exist in shared storage ({storage})")
            source.mkdir(parents=True, exist_ok=True)
        sources.append(source)
    writable = [source for mount, source in zip(launch.mounts, sources, strict=True) if not mount.read_only]
    files: dict[str, Path] = {}
    for name, content in launch.files.items():
        path = root / "files" / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        files[name] = path
    if backend == BWRAP:
        tmp = root / "tmp"  # the node's /tmp: on disk with the rest of its files, not in memory
        try:
            tmp.mkdir()
        except FileNotFoundError:  # a new node folder
            tmp.mkdir(parents=True)
        except FileExistsError:  # a start taken up again
            shutil.rmtree(tmp)
            tmp.mkdir()
        binds = [Bind(source=source, target=f"{WORKSPACE}/{mount.target}", read_only=mount.read_only)
                 for mount, source in zip(launch.mounts, sources, strict=True)]
        binds += [Bind(source=path, target=name, read_only=True) for name, path in files.items()]
        if run_folder is not None:
            binds.append(Bind(source=run_folder, target=RUN_FOLDER, read_only=False))
        cwd = f"{WORKSPACE}/algorithm"
        if image is not None:
            binds += [Bind(source=path, target=str(path), read_only=True)
                      for path in [*HOST_FILES_IN_IMAGE, *host_binds] if path.exists()]
            if not any(mount.target == "algorithm" for mount in launch.mounts):
                cwd = image.workdir or WORKSPACE  # nothing of the job's to start in: where the image says
        kept: list[tuple[str, int]] = []
        if run_as is not None and os.geteuid() == 0:
            others = give_to(run_as, [tmp, *(() if run_folder is None else (run_folder,))], writable,
                             [source for mount, source in zip(launch.mounts, sources, strict=True)
                              if mount.target == CHECKPOINT_TARGET and not mount.read_only])
            kept = [(f"{WORKSPACE}/{mount.target}", others[source]) for mount, source in
                    zip(launch.mounts, sources, strict=True) if not mount.read_only and source in others]
        sandbox = SandboxSpec(binds=binds, dirs=SKELETON_DIRS, tmp=tmp, keep=agent_paths(), cwd=cwd,
                              hidden=hidden_entries(hidden), root=image.rootfs if image is not None else None,
                              run_as=run_as if os.geteuid() == 0 else None, devices=accelerator_devices())
        return Workspace(root=root, path=Path(WORKSPACE), backend=BWRAP, sandbox=sandbox,
                         not_writable=tuple(kept)), files
    workspace = Workspace(root=root, path=root / "workspace")
    if workspace.path.exists():
        shutil.rmtree(workspace.path)
    for part in SKELETON:
        (workspace.path / part).mkdir(parents=True, exist_ok=True)
    for mount, source in zip(launch.mounts, sources, strict=True):
        target = workspace.path / mount.target
        if target.is_dir() and not target.is_symlink():
            target.rmdir()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(source, target_is_directory=True)
    return workspace, files


def check_no_link(storage: Path, source: str, *, writable: bool) -> None:
    """Refuse a mount whose path in shared storage leads out of it through a link, and a writable one with a link
    anywhere on its way: a job may leave links in what it writes, and the agent, as root, must neither show another
    place of the host in a later job nor give it to that job's user. Links within storage that an administrator
    made for read-only data (a dataset kept elsewhere in storage) stay usable."""
    where = storage
    for part in Path(source).parts:
        where = where / part
        if writable and where.is_symlink():
            raise WorkspaceError(f"{source} in shared storage passes through a link ({where.relative_to(storage)}); "
                                 "a job writes only to folders there: remove the link")
    inside = os.path.realpath(storage)
    found = os.path.realpath(storage / source)
    if found != inside and not found.startswith(inside + os.sep):
        raise WorkspaceError(f"{source} in shared storage leads out of it through a link (to {found}); a job's "
                             "mounts stay in shared storage: remove the link")


def give_to(uid: int, own: Sequence[Path], writable: Sequence[Path], whole: Sequence[Path]) -> dict[Path, int]:
    """Let the job's user `uid` write where the job writes: the node's own folders (`own`: its /tmp, its run
    socket's folder and what is in it), the writable folders of shared storage it mounts (`writable`) where the
    agent made them (those of another owner stay theirs: a volume another user's job made), and `whole` (its
    checkpoint folder, copied from the last attempt's by the agent) with everything inside. Returns the writable
    folders left to another owner, with the owner's uid."""
    for path in own:
        os.chown(path, uid, uid)
        for child in path.iterdir():
            os.chown(child, uid, uid, follow_symlinks=False)
    others: dict[Path, int] = {}
    for path in writable:
        owner = path.lstat().st_uid  # never through a link (check_no_link refused those): a job may make one later
        if owner == 0:
            os.chown(path, uid, uid, follow_symlinks=False)
        elif owner != uid and path not in whole:
            others[path] = owner
    for path in whole:
        for folder, dirs, names in os.walk(path):
            os.chown(folder, uid, uid)
            for name in [*dirs, *names]:
                os.chown(os.path.join(folder, name), uid, uid, follow_symlinks=False)
    return others


def accelerator_devices(dev: str = "/dev") -> tuple[str, ...]:
    """The host's accelerator and RDMA devices (`ACCELERATOR_DEVICES`), shown in a sandbox's own /dev."""
    listing = host_listing(dev)
    last = _last_devices.get(dev)
    if last is not None and last[0] is listing:  # the same tuple while /dev is unchanged: picked once
        return last[1]
    devices = tuple(f"{dev}/{entry.name}" for entry in listing if entry.name.startswith(ACCELERATOR_DEVICES))
    _last_devices[dev] = (listing, devices)
    return devices


_last_devices: dict[str, tuple[Sequence[HostEntry], tuple[str, ...]]] = {}


def hidden_entries(paths: Sequence[Path]) -> list[Hidden]:
    """The paths to hide that exist, resolved (a bind follows links), each a folder or a file. Whether
    each exists is looked at every time: a secret written after the agent started is hidden too."""
    entries = []
    for path in _resolved(tuple(paths)):
        try:
            found = path.stat()
        except OSError:
            continue
        entries.append(Hidden(path=path, is_dir=stat.S_ISDIR(found.st_mode)))
    return entries


@functools.lru_cache(maxsize=8)
def _resolved(paths: tuple[Path, ...]) -> tuple[Path, ...]:
    """The agent's hidden paths, resolved once: they are its settings, fixed while it runs."""
    return tuple(dict.fromkeys(p.resolve() for p in paths))


# Where an operating system's own interpreter is installed (Debian's python3.11 in /usr, the official images' in
# /usr/local): an image has its own files there, which a bind of the host's would replace whole.
SYSTEM_PREFIXES = frozenset({Path("/"), Path("/usr"), Path("/usr/local")})


@functools.cache
def agent_paths() -> tuple[Path, ...]:
    """What a job needs to see from the agent: its Python environment (the interpreter first on the
    job's PATH, with its packages) and its code (helpers such as `python3 -m agent.lifecycle`). An interpreter
    installed in a system prefix is not among them: a job on the host's files sees it there anyway, and a job in
    an image sees the image's files there (its helpers then run on the image's Python of that version)."""
    prefixes = [Path(sys.prefix), Path(sys.base_prefix)]
    paths = [*prefixes, *(p.resolve() for p in prefixes), Path(__file__).resolve().parents[2]]
    return tuple(path for path in dict.fromkeys(paths) if path not in SYSTEM_PREFIXES)


@functools.cache
def _bwrap_path() -> str:
    """The bwrap jobs start in, looked up once (the backend is chosen once, at the agent's start)."""
    return bwrap_program() or "bwrap"


def bwrap_program(python: str = sys.executable) -> str | None:
    """trainyard-bwrap beside the agent's Python where `make install` built it (Debian's bubblewrap, static with
    musl: half a millisecond of CPU a sandbox's start less), else the system's bwrap; None when there is neither."""
    return built_program(BUILT_BWRAP, python) or shutil.which("bwrap")


def bwrap_problem() -> str | None:
    """Why bwrap cannot run jobs here, or None when a trial run in a sandbox like a job's works."""
    found = bwrap_program()
    if found is None:
        return "bwrap is not installed (Debian package bubblewrap)"
    with tempfile.TemporaryDirectory(prefix="trainyard-bwrap-probe-") as tmp:
        # As a job runs: as its own user where the agent is root, so that a host where that cannot work is known.
        spec = SandboxSpec(binds=[], dirs=[f"{WORKSPACE}/{part}" for part in SKELETON], tmp=Path(tmp),
                           keep=agent_paths(), cwd=WORKSPACE, run_as=PROBE_UID if os.geteuid() == 0 else None)
        try:
            result = subprocess.run(bwrap_argv(spec, ["true"], bwrap=found, drop_program=built_drop_program()),
                                    capture_output=True, text=True,
                                    stdin=subprocess.DEVNULL, timeout=PROBE_TIMEOUT_SECONDS, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"a trial run of {found} failed: {exc}"
    if result.returncode != 0:
        detail = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
        return f"a trial run of {found} failed: {detail}"
    return None


def jobs_as_root(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the administrator lets this node's jobs run as root (`JOBS_AS_ROOT_VARIABLE`)."""
    return environ.get(JOBS_AS_ROOT_VARIABLE, "").strip() == "1"


def job_user(launch: NodeLaunch, job_id: str, *, as_root: bool) -> int | None:
    """The user the node's processes run as (None: root, where the administrator allows it, `as_root`): the
    launcher's choice, or for a plan of a launcher before it, the job's own (`unnamed_plan_uid`)."""
    if as_root:
        return None
    return launch.run_as if launch.run_as is not None else unnamed_plan_uid(job_id)


def choose_backend(environ: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """The backend this agent uses, and why. Raises WorkspaceError for an unknown setting, or for
    TRAINYARD_WORKSPACE_BACKEND=bwrap when bwrap cannot run."""
    setting = environ.get(BACKEND_VARIABLE, "").strip().lower() or "auto"
    if setting not in ("auto", PLAIN, BWRAP):
        raise WorkspaceError(f"{BACKEND_VARIABLE}={environ[BACKEND_VARIABLE]!r} is not a workspace backend; "
                             "use bwrap, plain or auto")
    if setting == PLAIN:
        return PLAIN, f"{BACKEND_VARIABLE}=plain"
    problem = bwrap_problem()
    if problem is None:
        return BWRAP, f"{BACKEND_VARIABLE}={setting} and bwrap works"
    if setting == BWRAP:
        raise WorkspaceError(f"{BACKEND_VARIABLE}=bwrap but bwrap cannot run jobs here: {problem}")
    return PLAIN, problem
