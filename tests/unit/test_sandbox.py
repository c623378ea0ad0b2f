"""The bubblewrap command of a node's sandbox (SPEC L1), built without running bwrap."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.sandbox import EXEC, Bind, HostEntry, SandboxSpec, bwrap_argv
from agent.workspace import (
    BACKEND_VARIABLE,
    BWRAP,
    PLAIN,
    WorkspaceError,
    build_workspace,
    bwrap_problem,
    choose_backend,
)
from libs.contracts.events import Mount, NodeLaunch
from tests.support.bwrap import ops

# A small host: / with the usual entries, /etc with a few files and a relative symlink.
HOST: dict[str, list[HostEntry]] = {
    "/": [HostEntry(name="bin", is_dir=True, link="usr/bin"), HostEntry(name="dev", is_dir=True),
          HostEntry(name="etc", is_dir=True), HostEntry(name="home", is_dir=True),
          HostEntry(name="proc", is_dir=True), HostEntry(name="sys", is_dir=True),
          HostEntry(name="tmp", is_dir=True), HostEntry(name="usr", is_dir=True),
          HostEntry(name="venv", is_dir=True), HostEntry(name="workspace", is_dir=True)],
    "/etc": [HostEntry(name="hosts", is_dir=False), HostEntry(name="mtab", is_dir=False, link="../proc/self/mounts"),
             HostEntry(name="passwd", is_dir=False)],
}
STORAGE = Path("/srv/storage")
SPEC = SandboxSpec(
    binds=[Bind(source=STORAGE / "outputs/run-1", target="/workspace/outputs", read_only=False),
           Bind(source=STORAGE / "datasets/mnist", target="/workspace/dataset/private/mnist", read_only=True),
           Bind(source=Path("/agents/job/files/etc/mpi/hostfile"), target="/etc/mpi/hostfile", read_only=True),
           Bind(source=Path("/agents/job/files/job/hostfile"), target="/job/hostfile", read_only=True)],
    dirs=["/workspace/algorithm", "/workspace/outputs"],
    tmp=Path("/agents/job/tmp"),
    keep=[Path("/venv"), Path("/tmp/python")],
    cwd="/workspace/algorithm",
)


def list_dir(path: str) -> list[HostEntry]:
    return HOST.get(path, [])


def test_the_workspace_mounts_storage_read_only_or_writable_as_asked() -> None:
    argv = bwrap_argv(SPEC, ["python3", "train.py"], list_dir=list_dir)
    found = ops(argv)
    assert argv[0] == "bwrap"
    assert ("--ro-bind", "/srv/storage/datasets/mnist", "/workspace/dataset/private/mnist") in found
    assert ("--bind", "/srv/storage/outputs/run-1", "/workspace/outputs") in found
    assert not any(op[0] == "--bind" and op[2] == "/workspace/dataset/private/mnist" for op in found)
    # The skeleton is made before the mounts that go into it.
    assert found.index(("--dir", "/workspace")) < found.index(("--bind", "/srv/storage/outputs/run-1",
                                                                "/workspace/outputs"))
    assert ("--dir", "/workspace/algorithm") in found


def test_generated_files_appear_at_their_absolute_paths_read_only() -> None:
    found = ops(bwrap_argv(SPEC, ["true"], list_dir=list_dir))
    assert ("--ro-bind", "/agents/job/files/job/hostfile", "/job/hostfile") in found
    assert ("--ro-bind", "/agents/job/files/etc/mpi/hostfile", "/etc/mpi/hostfile") in found
    # /etc must hold /etc/mpi, so it is made in the sandbox and its entries are shown one by one.
    assert ("--dir", "/etc") in found
    assert ("--ro-bind-try", "/etc", "/etc") not in found
    assert ("--ro-bind-try", "/etc/hosts", "/etc/hosts") in found
    assert ("--ro-bind-try", "/etc/passwd", "/etc/passwd") in found
    assert ("--symlink", "../proc/self/mounts", "/etc/mtab") in found
    assert found.index(("--dir", "/etc")) < found.index(("--ro-bind-try", "/etc/hosts", "/etc/hosts"))


def test_the_host_is_shown_read_only_entry_by_entry() -> None:
    found = ops(bwrap_argv(SPEC, ["true"], list_dir=list_dir))
    assert ("--ro-bind-try", "/usr", "/usr") in found
    assert ("--ro-bind-try", "/sys", "/sys") in found
    assert ("--ro-bind-try", "/home", "/home") in found
    assert ("--symlink", "usr/bin", "/bin") in found
    assert ("--proc", "/proc") in found
    assert ("--dev-bind", "/dev", "/dev") in found
    assert ("--bind", "/agents/job/tmp", "/tmp") in found
    # The host's own /workspace is hidden by the job's; the host root is never bound whole.
    assert not any(len(op) == 3 and op[2] == "/workspace" for op in found)
    assert not any(len(op) == 3 and op[1] == "/" for op in found)
    assert found[-2:] == [("--remount-ro", "/"), ("--chdir", "/workspace/algorithm")]


def test_the_python_environment_stays_visible() -> None:
    found = ops(bwrap_argv(SPEC, ["true"], list_dir=list_dir))
    # /venv is already shown by the host's entries; /tmp/python would be hidden by the job's /tmp.
    assert ("--ro-bind", "/venv", "/venv") not in found
    assert ("--ro-bind-try", "/venv", "/venv") in found
    assert ("--ro-bind", "/tmp/python", "/tmp/python") in found
    assert found.index(("--bind", "/agents/job/tmp", "/tmp")) < found.index(("--ro-bind", "/tmp/python",
                                                                             "/tmp/python"))


def test_the_command_keeps_the_host_network_pids_and_process_group() -> None:
    argv = bwrap_argv(SPEC, ["python3", "train.py", "--lr", "0.1"], list_dir=list_dir, bwrap="/usr/bin/bwrap")
    assert argv[0] == "/usr/bin/bwrap"
    assert argv[argv.index("--") + 1:] == [*EXEC, "python3", "train.py", "--lr", "0.1"]
    options = argv[:argv.index("--")]
    for flag in ("--unshare-net", "--unshare-pid", "--unshare-all", "--new-session", "--die-with-parent"):
        assert flag not in options


def test_without_a_tmp_folder_tmp_is_an_empty_tmpfs() -> None:
    spec = SandboxSpec(binds=[], tmp=None)
    found = ops(bwrap_argv(spec, ["true"], list_dir=list_dir))
    assert ("--tmpfs", "/tmp") in found
    assert ("--ro-bind-try", "/etc", "/etc") in found  # nothing new in /etc: shown whole


# --- the workspace on either backend ---------------------------------------------------------------

def launch(*mounts: Mount, files: dict[str, str] | None = None) -> NodeLaunch:
    return NodeLaunch(rank=0, node="node-a", address="127.0.0.1", argv=["python3", "/workspace/algorithm/x.py"],
                      env={}, mounts=list(mounts), files=files or {})


def test_a_bwrap_workspace_uses_the_real_paths(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    (storage / "datasets" / "mnist").mkdir(parents=True)
    node = launch(Mount(source="datasets/mnist", target="dataset/private/mnist", read_only=True),
                  Mount(source="outputs/run", target="outputs", read_only=False),
                  files={"/job/hostfile": "node-a slots=1\n"})
    workspace, files = build_workspace(tmp_path / "rank-0", storage, node, BWRAP)
    assert (workspace.backend, workspace.path, workspace.cwd) == (BWRAP, Path("/workspace"), tmp_path / "rank-0")
    assert workspace.translate("/workspace/algorithm/x.py", files) == "/workspace/algorithm/x.py"
    assert workspace.translate("/job/hostfile", files) == "/job/hostfile"
    assert (storage / "outputs" / "run").is_dir()  # writable mounts are created as on the plain backend
    assert files["/job/hostfile"].read_text() == "node-a slots=1\n"
    assert (tmp_path / "rank-0" / "tmp").is_dir()
    found = ops(workspace.command(["true"]))
    assert ("--ro-bind", str(storage / "datasets" / "mnist"), "/workspace/dataset/private/mnist") in found
    assert ("--ro-bind", str(files["/job/hostfile"]), "/job/hostfile") in found


@pytest.mark.parametrize("backend", [BWRAP, PLAIN])
def test_a_missing_read_only_source_is_an_error(tmp_path: Path, backend: str) -> None:
    node = launch(Mount(source="datasets/nope", target="dataset/private/nope", read_only=True))
    with pytest.raises(WorkspaceError, match="datasets/nope does not exist"):
        build_workspace(tmp_path / "rank-0", tmp_path / "storage", node, backend)


def test_the_backend_setting() -> None:
    assert choose_backend({BACKEND_VARIABLE: "plain"})[0] == PLAIN
    with pytest.raises(WorkspaceError, match="use bwrap, plain or auto"):
        choose_backend({BACKEND_VARIABLE: "docker"})
    chosen, reason = choose_backend({})
    assert chosen == (PLAIN if bwrap_problem() else BWRAP), reason
