"""The services and a node agent answer exactly the operations of the catalogue (libs/contracts/operations):
none it lacks, and none it names goes unanswered. What each process subscribes to is read from the NATS
server's own monitoring endpoint, with every service and an agent running against it."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest_asyncio

from devstack.servers import free_port, start_nats
from libs.auth import issue_node_token
from libs.contracts.cluster import ClusterConfig
from libs.contracts.operations.catalogue import OPERATIONS, answered_by
from libs.settings import Settings
from libs.skeleton.runtime import ServiceRuntime
from services.autoscaler.service import Autoscaler
from services.launcher.service import Launcher
from services.monitor.service import Monitor
from services.scheduler.service import Scheduler
from tests.support.agents import start_agent
from tests.support.schedulers import CLUSTER, SECRET

NODE = "node-a"
# Where requests are asked: people's commands and queries, an agent's registration, and one agent's requests.
REQUEST_ROOTS = ("trainyard.cmd.", "trainyard.query.", "trainyard.nodes.register", f"trainyard.agent.{NODE}.")


def asked_there(subject: str) -> bool:
    """Whether requests are asked on `subject`: not a debug session's channels, which are plain publishes
    (`trainyard.agent.<node>.session.<owner>.<session>.<channel>`)."""
    return subject.startswith(REQUEST_ROOTS) and not (subject.startswith(f"trainyard.agent.{NODE}.session.")
                                                      and len(subject.split(".")) > 5)


class Monitored:
    """A NATS server of the test's own, with its monitoring endpoint on."""

    def __init__(self, folder: Path) -> None:
        self.http_port = free_port()
        config = folder / "nats.conf"
        config.write_text(f"http_port: {self.http_port}\n")
        port = free_port()
        self.process = start_nats(folder / "nats", port, config)
        self.url = f"nats://127.0.0.1:{port}"

    def subscriptions(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/subsz?subs=1&limit=100000") as answer:
            found: list[dict[str, Any]] = json.load(answer).get("subscriptions_list", [])
        return found


@pytest_asyncio.fixture(loop_scope="session")
async def monitored(tmp_path: Path) -> AsyncIterator[Monitored]:
    server = Monitored(tmp_path)
    yield server
    server.process.terminate()
    server.process.wait(10)


async def started(make: Callable[[ServiceRuntime, ClusterConfig], Any], name: str, settings: Settings,
                  cluster: ClusterConfig, runtimes: list[ServiceRuntime]) -> None:
    runtime = ServiceRuntime(name, settings)
    await runtime.start()
    runtimes.append(runtime)
    service = make(runtime, cluster)
    await service.start()
    await runtime.listen()


async def test_the_processes_answer_the_operations_of_the_catalogue_and_no_others(
        monitored: Monitored, database_url: str, tmp_path: Path) -> None:
    (tmp_path / "storage").mkdir()
    settings = Settings(nats_url=monitored.url, database_url=database_url, storage_root=tmp_path / "storage",
                        auth_secret=SECRET)
    cluster = ClusterConfig.load(CLUSTER)
    runtimes: list[ServiceRuntime] = []
    agent = None
    try:
        for name, make in (("scheduler", Scheduler), ("launcher", Launcher), ("monitor", Monitor),
                           ("autoscaler", Autoscaler)):
            await started(make, name, settings, cluster, runtimes)
        agent = await start_agent(monitored.url, NODE, tmp_path, node_token=issue_node_token(SECRET, NODE))

        answered = {sub["subject"] for sub in monitored.subscriptions() if asked_there(sub["subject"])}
        declared = {operation.subject for operation in OPERATIONS if operation.answered_by != "agent"}
        declared |= {operation.subject_for(NODE) for operation in answered_by("agent")}
        assert answered - declared == set(), "answered, and not in the catalogue"
        assert declared - answered == set(), "in the catalogue, and answered by nobody"
    finally:
        if agent is not None:
            await agent.close()
        for runtime in reversed(runtimes):
            await runtime.close()
