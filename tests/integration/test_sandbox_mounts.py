"""The mount namespace a root holder starts sandboxes from (agent/processes/holder.py, SandboxMounts): the host's
mounts without those no sandbox shows, made again once the host's table changed, and the host left as it was."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

import pytest

from agent.isolation.sandbox import (
    DEVICES_SOURCE,
    VIEW_DROP,
    Hidden,
    SandboxSpec,
    built_drop_program,
    bwrap_argv,
    host_view,
)
from agent.processes.holder import unshown_mounts
from agent.processes.holder_client import HeldProcess, HoldServer
from tests.support.bwrap import ops

on_loop = pytest.mark.asyncio(loop_scope="session")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace of the holder's needs root")

# A host's table as a container on cgroup v1 gives it (trimmed), with a path holding a space.
MOUNTINFO = b"""\
20 25 0:19 / /proc rw,nosuid - proc proc rw
21 25 0:20 / /sys rw,nosuid - sysfs sysfs rw
22 25 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw
23 22 0:21 / /dev/shm rw - tmpfs tmpfs rw
24 22 0:22 / /dev/pts rw - devpts devpts rw,mode=600
25 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
26 22 0:22 / /dev/pts rw - devpts devpts rw,mode=600
27 21 0:23 / /sys/fs/cgroup ro - tmpfs tmpfs ro
28 27 0:24 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
29 27 0:25 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
30 21 0:26 / /sys/kernel/debug rw - debugfs debugfs rw
31 20 0:27 / /proc/sys/fs/binfmt_misc rw - binfmt_misc binfmt_misc rw
32 25 0:28 / /mnt/shared\\040storage rw - nfs4 server:/export rw
33 22 0:5 /nvidia0 /dev/nvidia0 rw - devtmpfs udev rw
34 25 0:29 / /run/user/0 rw - tmpfs tmpfs rw
35 25 8:1 /run/netns /run/netns rw shared:5 - ext4 /dev/vda rw
36 35 0:4 net:[4026532280] /run/netns/node-1 rw shared:6 - nsfs nsfs rw
"""


def test_the_mounts_no_sandbox_shows_are_named_deepest_first_and_the_rest_kept() -> None:
    unshown = unshown_mounts(MOUNTINFO)
    assert sorted(unshown) == sorted([b"/dev/shm", b"/dev/pts", b"/dev/pts", b"/sys/fs/cgroup",
                                      b"/sys/fs/cgroup/memory", b"/sys/fs/cgroup/unified", b"/sys/kernel/debug",
                                      b"/proc/sys/fs/binfmt_misc", b"/run/netns", b"/run/netns/node-1"])
    depths = [point.count(b"/") for point in unshown]
    assert depths == sorted(depths, reverse=True)
    # What jobs are given or bound from stays: the system folders, storage (its escaped space read), devices.
    for kept in (b"/", b"/proc", b"/sys", b"/dev", b"/mnt/shared storage", b"/dev/nvidia0", b"/run/user/0"):
        assert kept not in unshown
    assert unshown_mounts(b"garbage\n\n1 2 3\n") == []


@pytest.fixture
def drop() -> str:
    found = built_drop_program()
    if found is None:
        pytest.skip("trainyard-drop is not built (make install)")
    return found


def mount_points(table: str) -> list[str]:
    return [line.split()[4] for line in table.splitlines()]


async def output_of(folder: Path, argv: list[str], server: HoldServer, *, sandbox: bool,
                    view: str | None = None) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    process = await HeldProcess.start(folder, argv, {"PATH": os.environ["PATH"]}, folder, server, sandbox=sandbox,
                                      view=view)
    code, _ = await asyncio.wait_for(process.wait_exit(), 30)
    assert code == 0, (folder / "output.log").read_text()
    return (folder / "output.log").read_text()


@as_root
@on_loop
async def test_sandboxes_start_without_the_host_s_unshown_mounts_and_the_host_keeps_them(tmp_path: Path) -> None:
    host_before = Path("/proc/self/mountinfo").read_text()
    read_table = [sys.executable, "-c", "print(open('/proc/self/mountinfo').read(), end='')"]
    server = HoldServer()
    try:
        in_sandbox = await output_of(tmp_path / "sandbox", read_table, server, sandbox=True)
        plain = await output_of(tmp_path / "plain", read_table, server, sandbox=False)
    finally:
        server.close()
    unshown = {point.decode() for point in unshown_mounts(host_before.encode())}
    if not unshown:
        pytest.skip("this host mounts nothing a sandbox goes without")
    assert not unshown & set(mount_points(in_sandbox))
    assert "/" in mount_points(in_sandbox) and "/proc" in mount_points(in_sandbox)
    # A command that is not a sandbox runs among the host's mounts, and the host lost none of them (other tests may
    # mount more meanwhile).
    assert unshown <= set(mount_points(plain))
    assert unshown <= set(mount_points(Path("/proc/self/mountinfo").read_text()))


async def host_command(*argv: str) -> None:
    process = await asyncio.create_subprocess_exec(*argv)
    assert await process.wait() == 0, argv


@as_root
@on_loop
async def test_what_the_host_mounts_after_the_holder_started_is_there_for_the_next_sandbox(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    storage.mkdir()
    server = HoldServer()
    listing = ["ls", str(storage)]
    try:
        assert await output_of(tmp_path / "before", listing, server, sandbox=True) == ""
        await host_command("mount", "-t", "tmpfs", "storage", str(storage))
        try:
            (storage / "mounted-later").write_text("on the host's new mount")
            assert await output_of(tmp_path / "after", listing, server, sandbox=True) == "mounted-later\n"
        finally:
            await host_command("umount", str(storage))
        assert await output_of(tmp_path / "gone", listing, server, sandbox=True) == ""
    finally:
        server.close()


# What a job looks at through a host view: where /.host is mounted from, what it holds, whether it takes a write,
# and what a hidden folder inside a shown one holds.
LOOK_AT_THE_VIEW = """
echo $(stat -c '%d' /.host) $(grep -c ' /.host ' /proc/self/mountinfo)
ls -A /.host | tr '\\n' ' '; echo
touch /.host/x 2>/dev/null && echo written || echo refused
ls -A "$1" | wc -l
id -u
"""


@as_root
@on_loop
async def test_sandboxes_see_the_host_through_one_read_only_view_made_once_and_again_after_a_change(
        tmp_path: Path, drop: str) -> None:
    if not Path("/opt").is_dir():
        pytest.skip("this host has no /opt to hide a folder in")
    secret = Path("/opt") / f"trainyard-test-{os.getpid()}"  # a platform folder inside a shown one, hidden
    secret.mkdir()
    (secret / "auth-secret").write_text("the-signing-secret")
    storage = tmp_path / "storage"
    storage.mkdir()
    spec = SandboxSpec(binds=[], tmp=None, keep=[], cwd="/", hidden=[Hidden(path=secret, is_dir=True)], run_as=65534)
    view = host_view(spec, drop_program=drop)
    assert view is not None and view.binds[-1] == (drop, VIEW_DROP.removeprefix("/.host/"))
    look = bwrap_argv(spec, ["sh", "-c", LOOK_AT_THE_VIEW, "sh", str(secret)], drop_program=drop, host_view=view)
    server = HoldServer()
    looks: list[list[str]] = []
    try:
        # Sandboxes in a row until two after each other bind the same view (the holder makes it again when the host's
        # mounts change, as other tests' may meanwhile).
        while len(looks) < 5 and not (len(looks) > 1 and looks[-1][0] == looks[-2][0]):
            looks.append((await output_of(tmp_path / str(len(looks)), look, server, sandbox=True,
                                          view=view.request)).splitlines())
        first, second = looks[-2:]
        holder = server.pid  # its views' places are named after it (other tests' holders may have theirs meanwhile)
        assert len(list(Path("/tmp").glob(f"trainyard-views-{holder}-*"))) == 1
        await host_command("mount", "-t", "tmpfs", "storage", str(storage))  # the holder makes its namespace again
        try:
            third = (await output_of(tmp_path / "third", look, server, sandbox=True, view=view.request)).splitlines()
        finally:
            await host_command("umount", str(storage))
    finally:
        server.close()
        (secret / "auth-secret").unlink()
        secret.rmdir()
    shown = {path.removeprefix("/") for path, _ in view.binds[:-1]}
    for seen in (first, second, third):
        assert set(seen[1].split()) == {*shown, ".trainyard-drop"}  # the host's shown folders and the dropper
        assert seen[2:] == ["refused", "0", "65534"]  # read-only, the secret's folder empty, run as the job's user
    assert first[0] == second[0] and first[0].endswith(" 1")  # one view for both, mounted at /.host
    assert third[0].endswith(" 1")  # made again with the holder's namespace (a new one may take the same device)
    for _ in range(100):  # the holder ends once its input did, and removes the views' places on the host
        if not list(Path("/tmp").glob(f"trainyard-views-{holder}-*")):
            break
        await asyncio.sleep(0.05)
    assert not list(Path("/tmp").glob(f"trainyard-views-{holder}-*"))


# What a job finds in its /dev: the devices at work, no way to add to it, and shared memory and a terminal of its own,
# looked at while another sandbox has made its own (a terminal's name from a new devpts starts at 0). $1: a name of
# this sandbox's own.
LOOK_AT_DEV = """
head -c 3 /dev/zero | od -An -tx1 | tr -d ' \\n'; echo
echo gone > /dev/null && echo null-written
touch /dev/new 2>/dev/null && echo dev-written || echo dev-refused
touch "/dev/shm/$1"
grep -c ' /dev/pts ' /proc/self/mountinfo
awk '$5 == "/dev" || index($5, "/dev/") == 1' /proc/self/mountinfo | wc -l
script -qc 'tty; sleep 1; ls /dev/pts | tr "\\n" " "; echo' /dev/null | tr -d '\\r'
ls -A /dev/shm
id -u
"""


@as_root
@on_loop
async def test_sandboxes_share_the_holder_s_dev_but_not_their_terminals_or_shared_memory(tmp_path: Path,
                                                                                        drop: str) -> None:
    if shutil.which("script") is None:
        pytest.skip("no script(1) here to open a terminal with")
    spec = SandboxSpec(binds=[], tmp=None, keep=[], cwd="/", run_as=65534)
    view = host_view(spec, drop_program=drop)
    assert view is not None and view.devices == ()
    looks = [bwrap_argv(spec, ["sh", "-c", LOOK_AT_DEV, "sh", name], drop_program=drop, host_view=view)
             for name in ("first", "second")]
    assert ("--dev-bind", DEVICES_SOURCE, "/dev") in ops(looks[0])
    server = HoldServer()
    try:  # at once: each holds its terminal open and its shared memory made while the other looks
        seen = await asyncio.gather(*(output_of(tmp_path / str(at), look, server, sandbox=True, view=view.request)
                                      for at, look in enumerate(looks)))
    finally:
        server.close()
    for name, output in zip(("first", "second"), seen, strict=True):
        lines = output.splitlines()
        # The devices read and written by the job's user, /dev itself read-only.
        assert lines[:3] == ["000000", "null-written", "dev-refused"]
        assert lines[3] == "1"  # one devpts, of its own
        assert lines[4] == "3"  # /dev, its devpts and its shm: the holder's /dev bound whole, not bwrap's --dev
        assert lines[5] == "/dev/pts/0" and lines[6].split() == ["0", "ptmx"]  # a new devpts: no other sandbox's
        assert lines[7:] == [name, "65534"]  # its shared memory alone, written by the job's user


@as_root
@on_loop
async def test_the_host_s_accelerators_are_in_the_holder_s_dev_as_the_host_has_them(tmp_path: Path, drop: str) -> None:
    # Stand-ins for accelerators this host lacks: a device node, a folder of them, and one gone since it was listed.
    node = next((Path(p) for p in ("/dev/kvm", "/dev/loop-control", "/dev/fuse") if Path(p).exists()), None)
    folder = next((Path(p) for p in ("/dev/net", "/dev/cpu", "/dev/input") if Path(p).is_dir()), None)
    if node is None or folder is None:
        pytest.skip("this host has no device node and folder of devices to stand in for accelerators")
    spec = SandboxSpec(binds=[], tmp=None, keep=[], cwd="/", run_as=65534,
                       devices=[str(node), str(folder), "/dev/no-such-accelerator"])
    view = host_view(spec, drop_program=drop)
    assert view is not None and view.devices == (str(node), str(folder), "/dev/no-such-accelerator")
    look = ["sh", "-c", f"stat -c '%t:%T %a %u:%g' {node}; ls -A {folder} | tr '\\n' ' '; echo; "
                        "ls /dev/no-such-accelerator 2>/dev/null || echo absent"]
    server = HoldServer()
    try:
        seen = (await output_of(tmp_path / "look", bwrap_argv(spec, look, drop_program=drop, host_view=view), server,
                                sandbox=True, view=view.request)).splitlines()
    finally:
        server.close()
    found = node.stat()
    assert seen[0] == (f"{os.major(found.st_rdev):x}:{os.minor(found.st_rdev):x} {found.st_mode & 0o7777:o} "
                       f"{found.st_uid}:{found.st_gid}")  # the same device, mode and owner
    assert set(seen[1].split()) == set(os.listdir(folder))  # a folder of devices bound whole
    assert seen[2] == "absent"
