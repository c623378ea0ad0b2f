"""The bubblewrap command of a node's sandbox (SPEC L1), built without running bwrap."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from agent.isolation import sandbox
from agent.isolation.sandbox import (
    DEVICES_SOURCE,
    DROP_INSIDE,
    EXEC,
    HOST,
    VIEW_DROP,
    VIEW_SOURCE,
    Bind,
    Hidden,
    HostEntry,
    HostListing,
    HostView,
    SandboxSpec,
    bwrap_argv,
    host_view,
    list_host_dir,
)
from agent.isolation.workspace import (
    BACKEND_VARIABLE,
    BWRAP,
    JOBS_AS_ROOT_VARIABLE,
    PLAIN,
    WorkspaceError,
    accelerator_devices,
    agent_paths,
    build_workspace,
    bwrap_problem,
    choose_backend,
    give_to,
    hidden_entries,
    job_user,
    jobs_as_root,
)
from libs.contracts.cluster import JobUsers
from libs.contracts.events import Mount, NodeLaunch
from libs.jobusers import job_uid
from tests.support.bwrap import ops

# A small host: / with the usual entries, /etc with a few files and a relative symlink.
MACHINE: dict[str, list[HostEntry]] = {
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


JOB_UID = 1_000_000_007  # a job's user, in the default range


def list_dir(path: str) -> list[HostEntry]:
    return MACHINE.get(path, [])


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
    # /etc must hold /etc/mpi, so it is made in the sandbox, each of its entries a link to the host's.
    assert ("--dir", "/etc") in found
    assert not any(op[-1] == "/etc" and op[0] != "--dir" for op in found)
    assert ("--symlink", "../.host/etc/hosts", "/etc/hosts") in found
    assert ("--symlink", "../.host/etc/passwd", "/etc/passwd") in found
    assert ("--symlink", "../proc/self/mounts", "/etc/mtab") in found  # a link of the host's, as written
    assert found.index(("--dir", "/etc")) < found.index(("--symlink", "../.host/etc/hosts", "/etc/hosts"))


def test_only_the_host_s_system_folders_are_bound_read_only_and_its_entries_link_into_them() -> None:
    found = ops(bwrap_argv(SPEC, ["true"], list_dir=list_dir))
    hosts = [op for op in found if op[0] == "--ro-bind" and op[2].startswith(HOST + "/")]
    # Of the host's root, only the system folders: never / whole, nor /home or anything else of the host's.
    assert hosts == [("--ro-bind", "/etc", f"{HOST}/etc"), ("--ro-bind", "/sys", f"{HOST}/sys"),
                     ("--ro-bind", "/usr", f"{HOST}/usr")]
    assert not any(op[0] in ("--bind", "--ro-bind") and op[1] in ("/", "/home") for op in found)
    first = found.index(hosts[0])
    # The sandbox's own mounts first: bwrap reads the whole mount table after each mount, and the host's folders
    # make it longer. Whatever lies under HOST (the hidden host paths) comes after them.
    own = [("--proc", "/proc"), ("--dev", "/dev"), ("--bind", "/agents/job/tmp", "/tmp"),
           *((("--ro-bind" if b.read_only else "--bind"), str(b.source), b.target) for b in SPEC.binds)]
    assert all(found.index(op) < first for op in own)
    assert all(index >= first for index, op in enumerate(found) if op[-1].startswith(HOST + "/"))
    assert ("--symlink", ".host/usr", "/usr") in found
    assert ("--symlink", ".host/sys", "/sys") in found
    assert not any(op[-1] == "/home" for op in found)  # not shown at all
    assert ("--symlink", "usr/bin", "/bin") in found
    assert ("--bind", "/agents/job/tmp", "/tmp") in found
    # The host's own /workspace and /tmp are neither shown nor bound under HOST.
    assert not any(op[-1] == "/workspace" for op in found if op[0] != "--dir")
    assert not any(op[-1].startswith((f"{HOST}/tmp", f"{HOST}/workspace", f"{HOST}/proc", f"{HOST}/dev"))
                   for op in found)
    assert found[-2:] == [("--remount-ro", "/"), ("--chdir", "/workspace/algorithm")]


def test_the_job_has_namespaces_and_a_dev_of_its_own_with_the_host_s_accelerators() -> None:
    spec = SandboxSpec(binds=SPEC.binds, dirs=SPEC.dirs, tmp=SPEC.tmp, keep=SPEC.keep, cwd=SPEC.cwd,
                       devices=["/dev/nvidia0", "/dev/nvidiactl", "/dev/infiniband"])
    argv = bwrap_argv(spec, ["true"], list_dir=list_dir)
    found = ops(argv)
    for flag in ("--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"):
        assert (flag,) in found
    assert ("--dev", "/dev") in found and not any(op[0] == "--dev-bind" and op[1] == "/dev" for op in found)
    for device in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/infiniband"):
        assert ("--dev-bind-try", device, device) in found
        assert found.index(("--dev", "/dev")) < found.index(("--dev-bind-try", device, device))
    # Shared memory of its own, which the job's user may write (bwrap's /dev/shm is root's alone).
    assert ("--perms", "1777") in found and found.index(("--perms", "1777")) + 1 == found.index(("--tmpfs", "/dev/shm"))
    assert found.index(("--dev", "/dev")) < found.index(("--tmpfs", "/dev/shm"))


def test_as_root_the_job_drops_to_its_own_user_without_capabilities() -> None:
    spec = SandboxSpec(binds=SPEC.binds, dirs=SPEC.dirs, tmp=SPEC.tmp, keep=SPEC.keep, cwd=SPEC.cwd, run_as=1_000_123)
    argv = bwrap_argv(spec, ["/usr/bin/python3", "train.py"], list_dir=list_dir, as_root=True,
                      executable=lambda _: True)
    assert command_after_options(argv) == [
        "/usr/bin/setpriv", "--reuid=1000123", "--regid=1000123", "--clear-groups", "--inh-caps=-all",
        "--bounding-set=-all", "--no-new-privs", "--", "/usr/bin/python3", "train.py"]
    assert ("--unshare-user",) not in ops(argv)  # bwrap mounts as root what the agent may read
    # In an image, whose files may lack setpriv, the agent's own Python drops the privileges.
    image = SandboxSpec(binds=SPEC.binds, dirs=SPEC.dirs, tmp=SPEC.tmp, cwd=SPEC.cwd, root=Path(IMAGE), run_as=7000)
    command = command_after_options(bwrap_argv(image, ["true"], list_dir=image_dir, as_root=True, python="/py"))
    assert command[:4] == ["/py", "-I", "-S", "-c"] and command[5:] == ["7000", *EXEC, "true"]
    # Where trainyard-drop was built, it drops, in a plain sandbox or an image alike, bound read-only inside.
    for shown in (spec, image):
        built = bwrap_argv(shown, ["true"], list_dir=image_dir if shown is image else list_dir, as_root=True,
                           executable=lambda _: True, drop_program="/venv/bin/trainyard-drop")
        assert ("--ro-bind", "/venv/bin/trainyard-drop", "/.trainyard-drop") in ops(built)
        assert command_after_options(built)[:2] == ["/.trainyard-drop", str(shown.run_as)]
        assert "/usr/bin/setpriv" not in built and "/py" not in built
    # Root allowed (no user to drop to): root all the same, without any capability.
    rooted = ops(bwrap_argv(SPEC, ["true"], list_dir=list_dir, as_root=True))
    assert ("--cap-drop", "ALL") in rooted
    # An agent that is not root: bwrap makes a user namespace, the job runs as the agent's user.
    plain = bwrap_argv(spec, ["true"], list_dir=list_dir, as_root=False)
    assert ("--unshare-user",) in ops(plain) and "/usr/bin/setpriv" not in plain


def test_through_a_host_view_the_host_s_folders_and_the_dropper_are_one_bind_and_the_rest_as_before() -> None:
    drop = "/venv/bin/trainyard-drop"
    spec = dataclasses.replace(SPEC, run_as=JOB_UID)
    view = host_view(spec, list_dir=list_dir, drop_program=drop, as_root=True)
    assert view == HostView(binds=(("/etc", "etc"), ("/sys", "sys"), ("/usr", "usr"), (drop, ".trainyard-drop")),
                            devices=())
    # Where the job does not drop to a user of its own (the agent is not root), the view holds no dropper, and no
    # /dev: nothing in the sandbox would mount its devpts, so bwrap makes its /dev.
    assert host_view(spec, list_dir=list_dir, drop_program=drop, as_root=False) == HostView(binds=view.binds[:-1])
    each = bwrap_argv(spec, ["true"], list_dir=list_dir, as_root=True, drop_program=drop)
    viewed = bwrap_argv(spec, ["true"], list_dir=list_dir, as_root=True, drop_program=drop, host_view=view)
    found = ops(viewed)
    # The view at HOST instead of a folder there with a bind of each shown entry, and of the dropper at the root.
    assert ("--ro-bind", VIEW_SOURCE, HOST) in found and ("--dir", HOST) not in found
    assert not any(op[0] == "--ro-bind" and op[1] in ("/etc", "/sys", "/usr", drop) for op in found)
    # The holder's /dev instead of bwrap's, the sandbox's devpts mounted by the dropper before it drops.
    assert ("--dev-bind", DEVICES_SOURCE, "/dev") in found and ("--dev", "/dev") not in found
    assert command_after_options(viewed)[:4] == [VIEW_DROP, "--devpts", "/dev/pts", str(JOB_UID)]
    assert ("--ro-bind", drop, DROP_INSIDE) in ops(each) and command_after_options(each)[:2] == [DROP_INSIDE,
                                                                                                 str(JOB_UID)]
    # Everything else the same, in the same order: what is hidden under HOST still goes over what the view shows.
    replaced = {("--dir", HOST), *(("--ro-bind", path, f"{HOST}/{name}") for path, name in view.binds[:-1]),
                ("--ro-bind", drop, DROP_INSIDE), ("--dev", "/dev")}
    assert [op for op in found if op not in (("--ro-bind", VIEW_SOURCE, HOST), ("--dev-bind", DEVICES_SOURCE, "/dev"))
            ] == [op for op in ops(each) if op not in replaced]
    # An accelerator is in the holder's /dev rather than bound on its own.
    gpu = dataclasses.replace(spec, devices=["/dev/nvidia0"])
    gpu_view = host_view(gpu, list_dir=list_dir, drop_program=drop, as_root=True)
    assert gpu_view is not None and gpu_view.devices == ("/dev/nvidia0",)
    in_view = ops(bwrap_argv(gpu, ["true"], list_dir=list_dir, as_root=True, drop_program=drop, host_view=gpu_view))
    assert ("--dev-bind", DEVICES_SOURCE, "/dev") in in_view and not any(op[0] == "--dev-bind-try" for op in in_view)
    # A view of other devices (one came or went since it was asked for) is not used.
    assert ("--dev", "/dev") in ops(bwrap_argv(gpu, ["true"], list_dir=list_dir, as_root=True, drop_program=drop,
                                               host_view=view))
    assert found.index(("--ro-bind", VIEW_SOURCE, HOST)) < found.index(("--remount-ro", "/"))
    # A view of other folders (the host's root changed since it was made) is not used; nor under an image.
    stale = HostView(binds=(("/etc", "etc"), (drop, ".trainyard-drop")))
    assert ops(bwrap_argv(spec, ["true"], list_dir=list_dir, as_root=True, drop_program=drop, host_view=stale)) == ops(
        each)
    image = SandboxSpec(binds=[], root=Path("/images/abc/rootfs"), run_as=JOB_UID)
    assert host_view(image, list_dir=list_dir, drop_program=drop, as_root=True) is None


def test_the_python_environment_stays_visible() -> None:
    found = ops(bwrap_argv(SPEC, ["true"], list_dir=list_dir))
    # /venv is not a system folder and /tmp/python would be hidden by the job's /tmp: each bound where it is.
    assert ("--ro-bind", "/venv", "/venv") in found
    assert not any(op[0] == "--symlink" and op[-1] == "/venv" for op in found)
    assert ("--ro-bind", "/tmp/python", "/tmp/python") in found
    assert found.index(("--bind", "/agents/job/tmp", "/tmp")) < found.index(("--ro-bind", "/tmp/python",
                                                                             "/tmp/python"))


def command_after_options(argv: list[str]) -> list[str]:
    return argv[argv.index("--") + 1:]


@pytest.mark.parametrize(("argv", "search_path", "direct"), [
    (["python3", "train.py"], "/usr/local/bin:/usr/bin", True),  # found where the job sees the host's file
    (["/usr/bin/python3", "train.py"], None, True),
    (["python3"], "/workspace/bin:/usr/bin", False),  # a folder the job sees otherwise comes first
    # A folder the job has nowhere (of the agent's user's home, say) is passed over, as the shell passes over it.
    (["python3"], "/home/me/bin:/srv/tools:/usr/bin", True),
    (["python3"], "/job:/usr/bin", False),  # a folder the sandbox makes holds what it puts there
    (["python3"], "/home/secret/bin:/usr/bin", False),  # in a hidden folder
    (["python3"], "bin:/usr/bin", False),  # relative to where it starts: as the shell finds it
    (["python3"], None, False),  # no PATH given
    (["trainer"], "/usr/bin", False),  # not found: the shell says so, with exit code 127
    (["/tmp/python/bin/python3"], None, False),  # the job's /tmp is its own
    (["/workspace/algorithm/run.sh"], None, False),
    (["/home/secret/tool"], None, False),  # hidden from the job
])
def test_an_executable_the_job_sees_as_on_the_host_runs_without_a_shell_in_between(
        argv: list[str], search_path: str | None, direct: bool) -> None:
    on_host = {"/usr/bin/python3", "/tmp/python/bin/python3", "/workspace/algorithm/run.sh", "/home/secret/tool"}
    spec = SandboxSpec(binds=SPEC.binds, dirs=SPEC.dirs, tmp=SPEC.tmp, keep=SPEC.keep, cwd=SPEC.cwd,
                       hidden=[Hidden(path=Path("/home/secret"), is_dir=True)])
    command = command_after_options(bwrap_argv(spec, argv, list_dir=list_dir, search_path=search_path,
                                               executable=on_host.__contains__))
    assert command == (argv if direct else [*EXEC, *argv])


def test_a_path_folder_reached_through_a_host_link_is_not_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """A link at the host's root is shown as written, so a folder through one may be there inside."""
    monkeypatch.setattr(sandbox, "_real_path", lambda path: "/usr/lib/tools/bin" if path == "/linked/bin"
                        else path)
    command = command_after_options(bwrap_argv(SPEC, ["python3"], list_dir=list_dir, search_path="/linked/bin:/usr/bin",
                                               executable={"/usr/bin/python3"}.__contains__))
    assert command == [*EXEC, "python3"]


def test_a_folder_hidden_from_one_job_only_is_looked_at_for_each() -> None:
    """Where the command is found is remembered per start's hidden paths: one job's sandbox hiding a folder
    on the PATH must not make another's skip the shell, nor the other way round."""
    plain = SandboxSpec(binds=SPEC.binds, dirs=SPEC.dirs, tmp=SPEC.tmp, keep=SPEC.keep, cwd=SPEC.cwd)
    hiding = SandboxSpec(binds=SPEC.binds, dirs=SPEC.dirs, tmp=SPEC.tmp, keep=SPEC.keep, cwd=SPEC.cwd,
                         hidden=[Hidden(path=Path("/opt/tools"), is_dir=True)])

    def command(spec: SandboxSpec) -> list[str]:
        return command_after_options(bwrap_argv(spec, ["tool"], list_dir=list_dir, search_path="/opt/tools/bin",
                                                executable={"/opt/tools/bin/tool"}.__contains__, as_root=False))

    assert [command(plain), command(hiding), command(plain)] == [["tool"], [*EXEC, "tool"], ["tool"]]


def test_a_job_in_an_image_always_starts_through_the_shell_of_the_image() -> None:
    spec = SandboxSpec(binds=SPEC.binds, dirs=SPEC.dirs, tmp=SPEC.tmp, cwd=SPEC.cwd, root=Path("/images/x"))
    command = command_after_options(bwrap_argv(spec, ["/usr/bin/python3"], list_dir=list_dir,
                                               search_path="/usr/bin", executable=lambda _: True))
    assert command == [*EXEC, "/usr/bin/python3"]


def test_the_command_keeps_the_host_network_and_process_group() -> None:
    argv = bwrap_argv(SPEC, ["python3", "train.py", "--lr", "0.1"], list_dir=list_dir, bwrap="/usr/bin/bwrap",
                      as_root=False)
    assert argv[0] == "/usr/bin/bwrap"
    assert argv[argv.index("--") + 1:] == [*EXEC, "python3", "train.py", "--lr", "0.1"]
    options = argv[:argv.index("--")]
    for flag in ("--unshare-net", "--unshare-all", "--new-session", "--die-with-parent"):
        assert flag not in options


def test_without_a_tmp_folder_tmp_is_an_empty_tmpfs() -> None:
    spec = SandboxSpec(binds=[], tmp=None)
    found = ops(bwrap_argv(spec, ["true"], list_dir=list_dir))
    assert ("--tmpfs", "/tmp") in found
    assert ("--symlink", ".host/etc", "/etc") in found  # nothing new in /etc: the host's, whole


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


@pytest.mark.skipif(os.geteuid() != 0, reason="folders are given to a job's user by an agent running as root")
def test_a_writable_folder_of_another_user_stays_theirs_and_is_named(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    (storage / "outputs" / "theirs").mkdir(parents=True)
    os.chown(storage / "outputs" / "theirs", JOB_UID + 1, JOB_UID + 1)  # an earlier job of another user made it
    node = launch(Mount(source="outputs/theirs", target="outputs", read_only=False),
                  Mount(source="volumes/new", target="volumes/new", read_only=False))
    workspace, _ = build_workspace(tmp_path / "rank-0", storage, node, BWRAP, run_as=JOB_UID)
    assert workspace.not_writable == (("/workspace/outputs", JOB_UID + 1),)
    assert (storage / "outputs" / "theirs").stat().st_uid == JOB_UID + 1  # still theirs
    assert (storage / "volumes" / "new").stat().st_uid == JOB_UID  # made by the agent now: the job's


@pytest.mark.parametrize("backend", [BWRAP, PLAIN])
def test_a_link_a_job_left_in_shared_storage_never_leads_a_mount_out_of_it(tmp_path: Path, backend: str) -> None:
    storage, host = tmp_path / "storage", tmp_path / "host-etc"
    host.mkdir()
    (storage / "outputs" / "x").mkdir(parents=True)
    (storage / "outputs" / "x" / "b-1").symlink_to(host)  # planted by an earlier job writing to outputs/x
    (storage / "datasets").mkdir()
    (storage / "datasets" / "out").symlink_to(host)
    writable = launch(Mount(source="outputs/x/b-1", target="outputs", read_only=False))
    through = r"outputs/x/b-1 in shared storage passes through a link \(outputs/x/b-1\)"
    with pytest.raises(WorkspaceError, match=through):
        build_workspace(tmp_path / "rank-0", storage, writable, backend, run_as=JOB_UID)
    assert host.stat().st_uid == os.geteuid()  # not given to the job's user
    reading = launch(Mount(source="datasets/out", target="dataset/private/out", read_only=True))
    with pytest.raises(WorkspaceError, match="datasets/out in shared storage leads out of it through a link"):
        build_workspace(tmp_path / "rank-0", storage, reading, backend)


def test_a_read_only_mount_may_follow_a_link_within_shared_storage(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    (storage / "datasets" / "big-v2").mkdir(parents=True)
    (storage / "datasets" / "big").symlink_to(storage / "datasets" / "big-v2")  # an administrator's
    node = launch(Mount(source="datasets/big", target="dataset/private/big", read_only=True))
    workspace, _ = build_workspace(tmp_path / "rank-0", storage, node, BWRAP)
    assert workspace.sandbox is not None
    assert [b.target for b in workspace.sandbox.binds] == ["/workspace/dataset/private/big"]


def test_a_workspace_made_again_starts_with_an_empty_tmp(tmp_path: Path) -> None:
    build_workspace(tmp_path / "rank-0", tmp_path / "storage", launch(), BWRAP)
    (tmp_path / "rank-0" / "tmp" / "left-over").write_text("from the start before")
    build_workspace(tmp_path / "rank-0", tmp_path / "storage", launch(), BWRAP)  # a start taken up again
    assert list((tmp_path / "rank-0" / "tmp").iterdir()) == []


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


# --- what a job sees in a real sandbox -------------------------------------------------------------

# Each part of what the job sees after a line of its own; $1 a hidden folder, $2 a hidden file.
LOOK = r"""
echo "== etc"; ls -A /etc
echo "== hostfile"; cat /etc/mpi/hostfile
echo "== hidden"; ls -A "$1" "/.host$1"; cat "$2" "/.host$2"
echo "== refused"; for path in /usr/probe /etc/probe /etc/mpi/probe "$1/probe" "/.host$1/probe" /.host/tmp/probe; do
  touch "$path" 2>/dev/null && echo "$path"; done
echo "== tmp"; touch /tmp/mine /workspace/outputs/mine; ls -A /.host/tmp 2>/dev/null; true
"""


def sections(output: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in output.splitlines():
        if line.startswith("== "):
            current = found.setdefault(line[3:], [])
        elif line.strip() and not line.endswith(":"):
            current.append(line)
    return found


@pytest.fixture
def state() -> Iterator[Path]:
    """A platform state folder outside /tmp (a job's /tmp is its own, which hides the host's anyway)."""
    folder = Path(tempfile.mkdtemp(prefix="trainyard-sandbox-", dir="/var/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_job_sees_the_host_read_only_its_own_files_and_nothing_hidden(state: Path) -> None:
    if problem := bwrap_problem():
        pytest.skip(problem)
    (state / "auth-secret").write_text("the-signing-secret")
    storage, rank = state / "storage", state / "agents" / "node-a" / "jobs" / "j" / "1" / "task-0" / "rank-0"
    (storage / "outputs").mkdir(parents=True)
    (rank / "tmp").mkdir(parents=True)
    (rank / "files" / "etc" / "mpi").mkdir(parents=True)
    (rank / "files" / "etc" / "mpi" / "hostfile").write_text("node-a slots=2\n")
    run_as = JOB_UID if os.geteuid() == 0 else None  # as a job runs: its own user where the agent is root
    if run_as is not None:
        give_to(run_as, [rank / "tmp"], [storage / "outputs"], [])
    spec = SandboxSpec(binds=[Bind(storage / "outputs", "/workspace/outputs", read_only=False),
                              Bind(rank / "files" / "etc" / "mpi" / "hostfile", "/etc/mpi/hostfile", read_only=True)],
                       tmp=rank / "tmp", keep=agent_paths(), cwd="/workspace",
                       hidden=hidden_entries([state, state / "auth-secret"]), run_as=run_as)

    result = subprocess.run(bwrap_argv(spec, ["sh", "-c", LOOK, "sh", str(state), str(state / "auth-secret")],
                                       bwrap=shutil.which("bwrap") or "bwrap"),
                            capture_output=True, text=True, check=True, timeout=30)
    seen = sections(result.stdout)

    assert set(seen["etc"]) == {*os.listdir("/etc"), "mpi"}  # every entry of the host's /etc, and its own
    assert seen["hostfile"] == ["node-a slots=2"]
    assert seen["hidden"] == []  # the state folder is empty and the secret reads as nothing, by either path
    assert seen["refused"] == []  # the host's files, hidden paths and the tmpfs take no writes
    assert seen["tmp"] == []  # the host's /tmp is out of sight; the job's own is its rank's folder
    assert (rank / "tmp" / "mine").exists() and (storage / "outputs" / "mine").exists()


def test_a_host_directory_is_listed_once_and_again_after_it_changed(tmp_path: Path) -> None:
    listed: list[str] = []

    def list_dir(path: str) -> list[HostEntry]:
        listed.append(path)
        return list_host_dir(path)

    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "hosts").write_text("")
    listing, settled = HostListing(list_dir), time.time() - 3600
    os.utime(etc, (settled, settled))
    assert [e.name for e in listing(str(etc))] == [e.name for e in listing(str(etc))] == ["hosts"]
    assert len(listed) == 1  # the same listing, for every job

    (etc / "passwd").write_text("")
    os.utime(etc, (settled + 60, settled + 60))
    assert [e.name for e in listing(str(etc))] == ["hosts", "passwd"]
    # Changed just now: listed each time, since a change within the same clock tick would leave its time alone.
    (etc / "group").write_text("")
    assert [e.name for e in listing(str(etc))] == [e.name for e in listing(str(etc))] == ["group", "hosts", "passwd"]
    assert len(listed) == 4
    assert listing(str(tmp_path / "missing")) == ()


def test_jobs_of_one_shape_share_their_sandbox_s_layout_until_the_host_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent works out the host's part of a sandbox once for every job of the same shape (where its mounts go),
    each job's own folders still bound; a host directory that changed is shown as it is now."""
    rootfs, settled = tmp_path / "rootfs", time.time() - 3600
    for name in ("etc", "usr", "srv"):
        (rootfs / name).mkdir(parents=True)
    (rootfs / "etc" / "hosts").write_text("")
    for folder in (rootfs, rootfs / "etc"):
        os.utime(folder, (settled, settled))
    made: list[str] = []
    make_layout = sandbox._make_layout

    def counted(spec: SandboxSpec, targets: tuple[str, ...], list_dir: Any) -> Any:
        made.append(str(spec.tmp))
        return make_layout(spec, targets, list_dir)

    monkeypatch.setattr(sandbox, "_make_layout", counted)

    def spec(job: str) -> SandboxSpec:
        return SandboxSpec(binds=[Bind(source=tmp_path / job / "outputs", target="/workspace/outputs", read_only=False),
                                  Bind(source=tmp_path / job / "hostfile", target="/etc/mpi/hostfile", read_only=True)],
                           tmp=tmp_path / job / "tmp", root=rootfs)

    listing = HostListing()
    for job in ("job-1", "job-2"):
        command = bwrap_argv(spec(job), ["true"], list_dir=listing)
        assert command == bwrap_argv(spec(job), ["true"], list_dir=list_host_dir)  # as worked out afresh
        assert ("--bind", str(tmp_path / job / "outputs"), "/workspace/outputs") in ops(command)
    assert made == [str(tmp_path / "job-1" / "tmp")] + [str(tmp_path / job / "tmp") for job in ("job-1", "job-2")]

    (rootfs / "opt").mkdir()  # the root changed: its new entry is shown
    os.utime(rootfs, (settled + 60, settled + 60))
    command = bwrap_argv(spec("job-3"), ["true"], list_dir=listing)
    assert command == bwrap_argv(spec("job-3"), ["true"], list_dir=list_host_dir)
    assert ("--symlink", ".host/opt", "/opt") in ops(command)
    (rootfs / "etc" / "group").write_text("")  # and so is a folder that must hold new paths (/etc for the hostfile)
    os.utime(rootfs / "etc", (settled + 60, settled + 60))
    command = bwrap_argv(spec("job-4"), ["true"], list_dir=listing)
    assert ("--symlink", "../.host/etc/group", "/etc/group") in ops(command)
    assert command == bwrap_argv(spec("job-4"), ["true"], list_dir=list_host_dir)


# --- J10: a sandbox over an image's root filesystem ------------------------------------------------

IMAGE = "/cache/images/entries/abc/rootfs"
IMAGE_FILES: dict[str, list[HostEntry]] = {
    IMAGE + "/": [HostEntry(name="bin", is_dir=True, link="usr/bin"), HostEntry(name="etc", is_dir=True),
                  HostEntry(name="root", is_dir=True), HostEntry(name="sys", is_dir=True),
                  HostEntry(name="usr", is_dir=True), HostEntry(name="srv", is_dir=True)],
    IMAGE + "/etc": [HostEntry(name="os-release", is_dir=False, link="../usr/lib/os-release"),
                     HostEntry(name="hosts", is_dir=False)],
    IMAGE + "/root": [HostEntry(name=".bashrc", is_dir=False)],
}


def image_dir(path: str) -> list[HostEntry]:
    return IMAGE_FILES.get(path, [])


def test_under_an_image_its_root_filesystem_is_the_jobs_and_the_host_shows_only_where_asked() -> None:
    spec = SandboxSpec(binds=[*SPEC.binds, Bind(source=Path("/etc/hosts"), target="/etc/hosts", read_only=True)],
                       dirs=SPEC.dirs, tmp=SPEC.tmp, cwd="/srv", root=Path(IMAGE),
                       keep=[Path("/opt/agent/venv"), Path("/opt/agent"), Path("/root/.pyenv/versions/3.11")],
                       hidden=[])
    found = ops(bwrap_argv(spec, ["true"], list_dir=image_dir))
    assert ("--ro-bind", IMAGE, HOST) in found  # never the host's /
    assert not any(op[0] in ("--bind", "--ro-bind") and op[1] == "/" for op in found)
    assert ("--symlink", ".host/usr", "/usr") in found  # the image's /usr
    assert ("--symlink", "usr/bin", "/bin") in found
    assert ("--symlink", "../usr/lib/os-release", "/etc/os-release") in found  # the image's link, as written
    # How names resolve is the host's; the image's own /etc/hosts is covered.
    assert ("--ro-bind", "/etc/hosts", "/etc/hosts") in found
    assert not any(op[:2] == ("--symlink", "../.host/etc/hosts") for op in found)
    assert ("--ro-bind", "/sys", "/sys") in found and ("--dev", "/dev") in found
    # The agent's interpreter and code are bound where they are on the host, once each, the image's /root kept.
    assert ("--ro-bind", "/opt/agent", "/opt/agent") in found
    assert not any(op[-1] == "/opt/agent/venv" for op in found)
    assert ("--ro-bind", "/root/.pyenv/versions/3.11", "/root/.pyenv/versions/3.11") in found
    assert ("--dir", "/root") in found and ("--symlink", "../.host/root/.bashrc", "/root/.bashrc") in found
    assert ("--ro-bind", "/srv/storage/datasets/mnist", "/workspace/dataset/private/mnist") in found
    assert found[-1] == ("--chdir", "/srv")


@pytest.mark.parametrize(("base_prefix", "kept"), [
    ("/usr", False),  # Debian's python3.11: an image's /usr would be the host's
    ("/usr/local", False),  # the official python images'
    ("/root/.pyenv/versions/3.11.7", True),  # an interpreter of its own folder: bound where it is
])
def test_an_interpreter_of_the_system_s_own_folders_is_not_kept(monkeypatch: pytest.MonkeyPatch, base_prefix: str,
                                                                   kept: bool) -> None:
    monkeypatch.setattr("sys.prefix", "/srv/agent/.venv")
    monkeypatch.setattr("sys.base_prefix", base_prefix)
    paths = agent_paths.__wrapped__()
    assert Path("/srv/agent/.venv") in paths and (Path(base_prefix) in paths) == kept
    spec = SandboxSpec(binds=[], tmp=SPEC.tmp, cwd="/srv", root=Path(IMAGE), keep=paths, hidden=[])
    found = ops(bwrap_argv(spec, ["true"], list_dir=image_dir))
    assert any(op[0] == "--ro-bind" and op[-1] == base_prefix for op in found) == kept
    assert ("--symlink", ".host/usr", "/usr") in found  # the image's /usr, whichever interpreter the agent runs


def test_a_plain_workspace_cannot_run_a_job_in_an_image(tmp_path: Path) -> None:
    from agent.caches.imagecache import ImageRoot

    image = ImageRoot(key="abc", rootfs=tmp_path / "rootfs", env={}, workdir=None, cold=False)
    with pytest.raises(WorkspaceError, match="needs bubblewrap"):
        build_workspace(tmp_path / "node", tmp_path / "storage", launch(), PLAIN, image=image)


def test_a_job_in_an_image_gets_the_hosts_name_resolution_and_driver_files(tmp_path: Path) -> None:
    from agent.caches.imagecache import ImageRoot

    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    driver = tmp_path / "libcuda.so.1"
    driver.write_text("")
    image = ImageRoot(key="abc", rootfs=rootfs, env={}, workdir="/srv", cold=True)
    workspace, _ = build_workspace(tmp_path / "node", tmp_path / "storage", launch(), BWRAP, image=image,
                                   host_binds=[driver, tmp_path / "absent.so"])
    assert workspace.sandbox is not None and workspace.sandbox.root == rootfs
    binds = {(str(b.source), b.target, b.read_only) for b in workspace.sandbox.binds}
    assert (str(driver), str(driver), True) in binds  # at the same path, read-only
    assert not any(target.endswith("absent.so") for _, target, _ in binds)  # a path the host lacks is skipped
    assert ("/etc/hosts", "/etc/hosts", True) in binds
    assert workspace.sandbox.cwd == "/srv"  # no algorithm of the job's: the image's working directory


def test_under_an_image_the_platforms_secrets_inside_a_kept_path_stay_hidden() -> None:
    spec = SandboxSpec(binds=[], tmp=None, root=Path(IMAGE), keep=[Path("/opt/agent")],
                       hidden=[Hidden(path=Path("/opt/agent/.trainyard"), is_dir=True),
                               Hidden(path=Path("/opt/agent/secret.key"), is_dir=False),
                               Hidden(path=Path("/var/lib/trainyard"), is_dir=True)])
    found = ops(bwrap_argv(spec, ["true"], list_dir=image_dir))
    bound = found.index(("--ro-bind", "/opt/agent", "/opt/agent"))
    assert found.index(("--tmpfs", "/opt/agent/.trainyard")) > bound  # hidden after the bind it lies in
    assert ("--remount-ro", "/opt/agent/.trainyard") in found
    assert found.index(("--ro-bind", "/dev/null", "/opt/agent/secret.key")) > bound
    assert not any("/var/lib/trainyard" in part for op in found for part in op)  # not there to hide


def test_each_folder_the_sandbox_makes_is_made_once() -> None:
    found = ops(bwrap_argv(SPEC, ["true"], list_dir=list_dir))
    made = [op[1] for op in found if op[0] == "--dir"]
    assert "/etc" in made and "/etc/mpi" in made and "/job" in made  # /etc holds the hostfile's folder
    assert len(made) == len(set(made))


def test_a_node_runs_as_the_launchers_user_or_as_root_only_where_an_administrator_allows() -> None:
    launch = NodeLaunch(rank=0, node="n", address="127.0.0.1", argv=["true"], env={}, mounts=[])
    assert job_user(msgspec.structs.replace(launch, run_as=1_000_123), "job-1", as_root=False) == 1_000_123
    assert job_user(launch, "job-1", as_root=False) == job_uid(JobUsers(per="job"), "job-1", "")  # a launcher before
    assert job_user(msgspec.structs.replace(launch, run_as=1_000_123), "job-1", as_root=True) is None
    assert jobs_as_root({JOBS_AS_ROOT_VARIABLE: "1"}) and not jobs_as_root({}) and not jobs_as_root(
        {JOBS_AS_ROOT_VARIABLE: "yes"})


def test_a_sandbox_shows_the_accelerators_dev_lists_now(tmp_path: Path) -> None:
    for name in ("null", "nvidia0", "infiniband"):
        (tmp_path / name).touch()
    os.utime(tmp_path, ns=(time.time_ns() - 10**10, time.time_ns() - 10**10))  # settled: its listing is kept
    assert set(accelerator_devices(str(tmp_path))) == {f"{tmp_path}/nvidia0", f"{tmp_path}/infiniband"}
    assert set(accelerator_devices(str(tmp_path))) == {f"{tmp_path}/nvidia0", f"{tmp_path}/infiniband"}
    (tmp_path / "nvidia1").touch()  # a board added while the agent runs
    assert set(accelerator_devices(str(tmp_path))) == {f"{tmp_path}/nvidia0", f"{tmp_path}/nvidia1",
                                                       f"{tmp_path}/infiniband"}
