"""What the agent's probes report (SPEC M1, M2), on machines described by fake sysfs trees."""

from __future__ import annotations

import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agent.presence.health import board_health, nic_health, probe, resource_checks, storage_health
from libs.contracts.agent import PrecheckNode
from libs.contracts.cluster import Accelerators, NodeInfo
from libs.contracts.health import ComponentHealth


def fake_nic(sys_net: Path, name: str, operstate: str, *, carrier: str | None = "1", physical: bool = True,
             flags: str = "0x1003") -> None:
    directory = sys_net / name
    directory.mkdir(parents=True)
    (directory / "operstate").write_text(operstate + "\n")
    (directory / "flags").write_text(flags + "\n")
    if carrier is not None:
        (directory / "carrier").write_text(carrier + "\n")
    if physical:
        (directory / "device").mkdir()


def by_key(components: list[ComponentHealth]) -> dict[str, ComponentHealth]:
    return {c.key: c for c in components}


def test_a_physical_nic_that_is_down_is_faulty_and_says_its_state(tmp_path: Path) -> None:
    fake_nic(tmp_path, "eth0", "up")
    fake_nic(tmp_path, "eth1", "down", carrier="0")
    fake_nic(tmp_path, "lo", "unknown", physical=False)
    fake_nic(tmp_path, "docker0", "down", physical=False)  # virtual, holding no node address: not watched

    nics = by_key(nic_health("127.0.0.1", sys_net=tmp_path, addresses={"lo": ["127.0.0.1"], "eth0": ["10.0.0.5"]}))

    assert set(nics) == {"nic:eth0", "nic:eth1", "nic:lo"}
    assert nics["nic:eth0"].healthy
    assert nics["nic:lo"].healthy
    assert not nics["nic:eth1"].healthy
    assert "down" in nics["nic:eth1"].detail


def test_the_nic_holding_the_node_address_is_watched_even_when_virtual(tmp_path: Path) -> None:
    fake_nic(tmp_path, "bond0", "unknown", physical=False)  # virtual links often report "unknown"
    fake_nic(tmp_path, "br0", "lowerlayerdown", physical=False)

    nics = by_key(nic_health("10.1.0.7", sys_net=tmp_path, addresses={"bond0": ["10.1.0.7"], "br0": ["10.9.0.1"]}))
    assert nics == {"nic:bond0": ComponentHealth(kind="nic", name="bond0", healthy=True)}

    nics = by_key(nic_health("10.9.0.1", sys_net=tmp_path, addresses={"bond0": ["10.1.0.7"], "br0": ["10.9.0.1"]}))
    assert not nics["nic:br0"].healthy
    assert "lowerlayerdown" in nics["nic:br0"].detail


def test_an_up_nic_without_carrier_is_faulty_and_a_spare_port_left_down_is_not_watched(tmp_path: Path) -> None:
    fake_nic(tmp_path, "eth0", "up", carrier="0")
    fake_nic(tmp_path, "eth2", "down", carrier=None, flags="0x1002")  # brought down by the administrator

    nics = by_key(nic_health("127.0.0.1", sys_net=tmp_path, addresses={}))

    assert set(nics) == {"nic:eth0"}
    assert not nics["nic:eth0"].healthy
    assert "carrier" in nics["nic:eth0"].detail


def test_without_nvidia_smi_the_boards_are_simulated_and_healthy() -> None:
    assert board_health(2, None) == [
        ComponentHealth(kind="board", name="0", healthy=True, detail="simulated"),
        ComponentHealth(kind="board", name="1", healthy=True, detail="simulated"),
    ]
    assert board_health(0, None) == []


def fake_nvidia_smi(tmp_path: Path, script: str) -> str:
    path = tmp_path / "nvidia-smi"
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_nvidia_smi_lists_the_healthy_boards_and_a_missing_one_is_faulty(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(tmp_path, 'echo "0, NVIDIA A100-SXM4-80GB"; echo "2, NVIDIA A100-SXM4-80GB"')

    boards = by_key(board_health(3, smi))

    assert boards["board:0"] == ComponentHealth(kind="board", name="0", healthy=True, detail="NVIDIA A100-SXM4-80GB")
    assert boards["board:2"].healthy
    assert not boards["board:1"].healthy


def test_a_failing_nvidia_smi_marks_every_board_faulty_with_its_error(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(tmp_path, 'echo "Unable to determine the device handle for GPU0000:3B:00.0" >&2; exit 15')

    boards = board_health(2, smi)

    assert [(b.name, b.healthy) for b in boards] == [("0", False), ("1", False)]
    assert all("Unable to determine the device handle" in b.detail for b in boards)


def test_probes_of_one_node_at_once_all_find_its_storage_healthy(tmp_path: Path) -> None:
    """A precheck probes the node while its periodic probe may be running, and two agents of one name may share the
    storage: neither may take the other's probe file for a fault."""
    storage = tmp_path / "storage"
    storage.mkdir()

    def probes(_: int) -> list[ComponentHealth]:
        return [storage_health(storage, "node-a") for _ in range(300)]

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = [health for batch in pool.map(probes, range(4)) for health in batch]

    assert [h.detail for h in results if not h.healthy] == []
    assert list((storage / ".probe").iterdir()) == []


def test_storage_that_takes_no_writes_is_a_faulty_runtime(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    storage.mkdir()
    assert storage_health(storage, "node-a").healthy
    assert list((storage / ".probe").iterdir()) == []  # the probe file is removed again

    (storage / ".probe").rmdir()
    (storage / ".probe").write_text("in the way\n")  # refuses writes even to root
    faulty = storage_health(storage, "node-a")
    assert not faulty.healthy
    assert str(storage) in faulty.detail

    missing = storage_health(tmp_path / "nowhere", "node-a")
    assert (missing.key, missing.healthy) == ("runtime:storage", False)


def test_a_whole_probe_covers_nics_boards_and_the_runtime(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    storage.mkdir()
    fake_nic(tmp_path / "net", "lo", "unknown", physical=False)
    info = NodeInfo(name="node-a", address="127.0.0.1", cpus=2, memory_mib=1024,
                    accelerators=[Accelerators(board="sim-a100", count=2)])

    health = by_key(probe(info, storage, tmp_path / "agents" / "node-a", sys_net=tmp_path / "net",
                          nvidia_smi=None, min_free_mib=1))

    assert {"board:0", "board:1", "runtime:storage", "runtime:disk", "runtime:python"} <= set(health)
    assert all(c.healthy for c in health.values()), [str(c) for c in health.values() if not c.healthy]
    needy = by_key(probe(info, storage, tmp_path, sys_net=tmp_path / "net", nvidia_smi=None, min_free_mib=2**40))
    assert not needy["runtime:disk"].healthy


def test_the_precheck_compares_the_request_with_what_the_node_has(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text("MemTotal:       8000000 kB\nMemAvailable:    2097152 kB\n")
    info = NodeInfo(name="node-a", address="127.0.0.1", cpus=4, memory_mib=8000,
                    accelerators=[Accelerators(board="sim-a100", count=2)])

    fits = by_key(resource_checks(PrecheckNode(job_id="job-1", cpus=2, memory_mib=2048, accelerators=2), info,
                                  proc=tmp_path, cpu_count=4))
    assert all(c.healthy for c in fits.values())
    assert set(fits) == {"runtime:memory", "runtime:cpus", "board:count"}

    too_big = by_key(resource_checks(PrecheckNode(job_id="job-1", cpus=8, memory_mib=4096, accelerators=4), info,
                                     proc=tmp_path, cpu_count=4))
    assert not too_big["runtime:memory"].healthy
    assert "2048 MiB available" in too_big["runtime:memory"].detail
    assert not too_big["runtime:cpus"].healthy
    assert not too_big["board:count"].healthy


def test_the_real_machine_probes_without_errors(tmp_path: Path) -> None:
    info = NodeInfo(name="node-a", address="127.0.0.1", cpus=1, memory_mib=64)
    health = by_key(probe(info, tmp_path, tmp_path, min_free_mib=0))
    assert health["nic:lo"].healthy
    assert health["runtime:python"].healthy
