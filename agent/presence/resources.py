"""What a host offers, read from the machine itself, plus simulated accelerators when asked."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import psutil

from libs.contracts.cluster import Accelerators, AgentConfig, NodeInfo


def _os_name() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return platform.system()


def describe_host(config: AgentConfig) -> NodeInfo:
    """The node as registered: real OS, kernel, CPUs and memory unless the config overrides them."""
    cpus = config.cpus if config.cpus is not None else float(len(os.sched_getaffinity(0)))
    memory = config.memory_mib if config.memory_mib is not None else psutil.virtual_memory().total // 2**20
    return NodeInfo(name=config.name, address=config.address, os=_os_name(), kernel=platform.release(),
                    cpus=cpus, memory_mib=memory, accelerators=list(config.accelerators),
                    pools=list(config.pools), labels=dict(config.labels))


def parse_accelerators(text: str) -> Accelerators:
    """`BOARD:COUNT[:DRIVER]`, e.g. `sim-a100:4:535.104`."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[1].isdigit():
        raise ValueError(f"{text!r} is not BOARD:COUNT[:DRIVER]")
    return Accelerators(board=parts[0], count=int(parts[1]), driver_version=parts[2] if len(parts) == 3 else None)
