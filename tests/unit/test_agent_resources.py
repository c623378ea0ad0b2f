"""What a node agent registers: the real machine, plus simulated boards when configured."""

from __future__ import annotations

import os

import psutil
import pytest

from agent.presence.resources import describe_host, parse_accelerators
from libs.contracts.cluster import Accelerators, AgentConfig


def test_unset_resources_are_read_from_the_machine() -> None:
    info = describe_host(AgentConfig(name="node-a", pools=["team-a"], labels={"zone": "a"}))
    assert info.cpus == len(os.sched_getaffinity(0))
    assert info.memory_mib == psutil.virtual_memory().total // 2**20
    assert info.kernel == os.uname().release
    assert info.os
    assert (info.pools, info.labels, info.accelerators) == (["team-a"], {"zone": "a"}, [])


def test_configured_resources_and_simulated_boards_are_presented() -> None:
    boards = [Accelerators(board="sim-a100", count=4, driver_version="535.104")]
    info = describe_host(AgentConfig(name="gpu-1", address="10.0.0.7", cpus=16, memory_mib=65536,
                                     accelerators=boards))
    assert (info.cpus, info.memory_mib, info.address) == (16, 65536, "10.0.0.7")
    assert (info.accelerator_count, info.board, info.driver_version) == (4, "sim-a100", "535.104")


@pytest.mark.parametrize(("text", "expected"), [
    ("sim-a100:4", Accelerators(board="sim-a100", count=4)),
    ("mlu370:8:4.20.18", Accelerators(board="mlu370", count=8, driver_version="4.20.18")),
])
def test_accelerator_flags_are_parsed(text: str, expected: Accelerators) -> None:
    assert parse_accelerators(text) == expected


@pytest.mark.parametrize("text", ["a100", "a100:four", "a100:1:2:3"])
def test_bad_accelerator_flags_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="BOARD:COUNT"):
        parse_accelerators(text)
