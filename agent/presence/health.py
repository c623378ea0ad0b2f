"""What the agent probes about its node (SPEC M1, M2): NICs, accelerator boards, runtime environment.

Every probe reads the machine through roots given as parameters (sysfs, /proc, the nvidia-smi
executable), so that tests can describe a machine instead of having one. Probes may block (a hung
nvidia-smi, slow shared storage): the agent runs them in a thread.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import psutil

from libs.contracts.agent import PrecheckNode
from libs.contracts.cluster import NodeInfo
from libs.contracts.health import ComponentHealth

SYS_NET = Path("/sys/class/net")
PROC = Path("/proc")
MIN_FREE_DISK_VARIABLE = "TRAINYARD_MIN_FREE_DISK_MIB"
DEFAULT_MIN_FREE_DISK_MIB = 1024
NVIDIA_SMI_TIMEOUT_SECONDS = 10.0
# Link states in which a NIC carries traffic; virtual links (lo, some bonds) report "unknown".
GOOD_OPERSTATES = ("up", "unknown")
IFF_UP = 0x1  # in /sys/class/net/<if>/flags: the interface was brought up


def min_free_disk_mib(environ: Mapping[str, str] = os.environ) -> int:
    return int(environ.get(MIN_FREE_DISK_VARIABLE, DEFAULT_MIN_FREE_DISK_MIB))


# --- NICs ------------------------------------------------------------------------------------------


def host_addresses() -> dict[str, list[str]]:
    """The addresses of every interface of this host, by interface name."""
    return {name: [a.address for a in found] for name, found in psutil.net_if_addrs().items()}


def _resolve(address: str) -> str:
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        pass
    try:  # a host name: the interface that holds what it resolves to
        return socket.gethostbyname(address)
    except OSError:
        return address


def _administratively_down(directory: Path) -> bool:
    flags = _read(directory / "flags")
    try:
        return flags is not None and not int(flags, 16) & IFF_UP
    except ValueError:
        return False


def watched_interfaces(address: str, *, sys_net: Path = SYS_NET,
                       addresses: Mapping[str, Iterable[str]] | None = None) -> list[str]:
    """The physical interfaces (those backed by a device) plus the one holding the node's address.

    A physical port the administrator left down (a spare port without a cable) is not a fault of the
    node; the interface holding the node's address is watched whatever its state."""
    watched = {entry.name for entry in _entries(sys_net)
               if (entry / "device").exists() and not _administratively_down(entry)}
    wanted = _resolve(address)
    for name, held in (host_addresses() if addresses is None else addresses).items():
        # IPv6 addresses of a link carry the zone (fe80::1%eth0).
        if any(a.split("%", 1)[0] == wanted for a in held):
            watched.add(name.split(":", 1)[0])  # an alias label (eth0:1) is its link's
    return sorted(watched)


def _entries(directory: Path) -> list[Path]:
    try:
        return list(directory.iterdir())
    except OSError:
        return []


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # carrier of a link that is down reads as EINVAL
        return None


def nic_state(name: str, *, sys_net: Path = SYS_NET) -> ComponentHealth:
    if name == "lo":
        return ComponentHealth(kind="nic", name=name, healthy=True)
    directory = sys_net / name
    state = _read(directory / "operstate")
    if state is None:
        return ComponentHealth(kind="nic", name=name, healthy=False, detail=f"{name} is not in {sys_net}")
    if state not in GOOD_OPERSTATES:
        return ComponentHealth(kind="nic", name=name, healthy=False, detail=f"link {state}")
    if _read(directory / "carrier") == "0":
        return ComponentHealth(kind="nic", name=name, healthy=False, detail=f"link {state} without carrier")
    return ComponentHealth(kind="nic", name=name, healthy=True)


def nic_health(address: str, *, sys_net: Path = SYS_NET,
               addresses: Mapping[str, Iterable[str]] | None = None) -> list[ComponentHealth]:
    return [nic_state(name, sys_net=sys_net)
            for name in watched_interfaces(address, sys_net=sys_net, addresses=addresses)]


# --- boards ----------------------------------------------------------------------------------------


def board_health(count: int, nvidia_smi: str | None) -> list[ComponentHealth]:
    """One component per board the node offers: from nvidia-smi where there is one, else simulated."""
    if count <= 0:
        return []
    if nvidia_smi is None:
        return [ComponentHealth(kind="board", name=str(i), healthy=True, detail="simulated") for i in range(count)]
    try:
        result = subprocess.run([nvidia_smi, "--query-gpu=index,name", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_SECONDS, check=False,
                                stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return _all_faulty(count, f"nvidia-smi failed: {exc}")
    if result.returncode != 0:
        said = (result.stderr.strip() or result.stdout.strip()).splitlines()
        return _all_faulty(count, f"nvidia-smi exit code {result.returncode}" + (f": {said[-1]}" if said else ""))
    listed: dict[str, str] = {}
    for line in result.stdout.splitlines():
        index, _, name = line.partition(",")
        if index.strip():
            listed[index.strip()] = name.strip()
    boards = [ComponentHealth(kind="board", name=index, healthy=True, detail=name) for index, name in listed.items()]
    # A board the node offers but nvidia-smi does not list is lost (fallen off the bus).
    boards += [ComponentHealth(kind="board", name=str(i), healthy=False, detail="not listed by nvidia-smi")
               for i in range(count) if str(i) not in listed]
    return boards


def _all_faulty(count: int, detail: str) -> list[ComponentHealth]:
    return [ComponentHealth(kind="board", name=str(i), healthy=False, detail=detail) for i in range(count)]


# --- runtime environment ---------------------------------------------------------------------------


def storage_health(storage: Path, node: str) -> ComponentHealth:
    """Shared storage is there and takes writes: a probe file is written and removed. Each probe writes a file of
    its own name, so that a precheck's probe beside the periodic one, or another node's agent of the same name on
    the same storage, never removes the file this one is about to."""
    if not storage.is_dir():
        return ComponentHealth(kind="runtime", name="storage", healthy=False,
                               detail=f"shared storage {storage} is not a directory")
    folder = storage / ".probe"
    try:
        folder.mkdir(exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=f"{node}.", dir=folder)
        try:
            os.write(handle, b"probe\n")
        finally:
            os.close(handle)
            os.unlink(probe)
    except OSError as exc:
        return ComponentHealth(kind="runtime", name="storage", healthy=False,
                               detail=f"cannot write to shared storage {storage}: {exc}")
    return ComponentHealth(kind="runtime", name="storage", healthy=True)


def disk_health(root: Path, min_free_mib: int) -> ComponentHealth:
    """Enough free disk where workspaces are made (the agent's root, or its nearest existing parent)."""
    existing = root.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        free = shutil.disk_usage(existing).free // 2**20
    except OSError as exc:
        return ComponentHealth(kind="runtime", name="disk", healthy=False, detail=f"cannot read {existing}: {exc}")
    healthy = free >= min_free_mib
    return ComponentHealth(kind="runtime", name="disk", healthy=healthy,
                           detail=f"{free} MiB free under {existing}" + ("" if healthy else f", {min_free_mib} needed"))


def python_health(executable: str = sys.executable) -> ComponentHealth:
    if executable and Path(executable).exists():
        return ComponentHealth(kind="runtime", name="python", healthy=True)
    return ComponentHealth(kind="runtime", name="python", healthy=False,
                           detail=f"the Python interpreter {executable!r} is gone")


def runtime_health(storage: Path, root: Path, node: str, min_free_mib: int) -> list[ComponentHealth]:
    return [storage_health(storage, node), disk_health(root, min_free_mib), python_health()]


# --- the whole node --------------------------------------------------------------------------------


def probe(info: NodeInfo, storage: Path, root: Path, *, sys_net: Path = SYS_NET,
          nvidia_smi: str | None = None, min_free_mib: int | None = None) -> list[ComponentHealth]:
    """Every component of the node now. Blocks (subprocess, file system): run it in a thread."""
    return [*nic_health(info.address, sys_net=sys_net),
            *board_health(info.accelerator_count, nvidia_smi),
            *runtime_health(storage, root, info.name, min_free_disk_mib() if min_free_mib is None else min_free_mib)]


def available_memory_mib(proc: Path = PROC) -> int:
    """MemAvailable from meminfo: what new processes can get without swapping."""
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return psutil.virtual_memory().available // 2**20


def resource_checks(request: PrecheckNode, info: NodeInfo, *, proc: Path = PROC,
                    cpu_count: int | None = None) -> list[ComponentHealth]:
    """Whether the node has what the job asks for (M1): memory, CPUs and boards."""
    available = available_memory_mib(proc)
    cpus = (os.cpu_count() or 1) if cpu_count is None else cpu_count
    checks = [
        ComponentHealth(kind="runtime", name="memory", healthy=available >= request.memory_mib,
                        detail=f"{available} MiB available, {request.memory_mib} MiB requested"),
        ComponentHealth(kind="runtime", name="cpus", healthy=request.cpus <= cpus,
                        detail=f"{cpus} CPUs, {request.cpus:g} requested"),
    ]
    if request.accelerators > 0:
        have = info.accelerator_count
        checks.append(ComponentHealth(kind="board", name="count", healthy=request.accelerators <= have,
                                      detail=f"{have} boards, {request.accelerators} requested"))
    return checks
