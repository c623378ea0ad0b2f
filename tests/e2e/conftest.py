"""The whole stack as separate processes: four services and two node agents per test."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from agent.process import kill_leftovers
from client.api import TrainyardClient
from libs.contracts.cluster import ClusterConfig
from libs.contracts.messages import JobView
from libs.devstack.stack import (
    REPO_ROOT,
    SERVICES,
    ProcessSet,
    agent_argv,
    provision_auth,
    seed_storage,
    service_argv,
    stack_env,
)
from libs.messaging.rpc import ServiceUnavailable
from tests.mailbox import Mailbox

CLUSTER = REPO_ROOT / "deploy" / "local" / "cluster.yaml"
NODES = ("node-a", "node-b")
TEST_ALGORITHMS = Path(__file__).parent / "algorithms"
TESTER_EMAIL = "tester@example.com"


def process_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie nobody reaped (an orphan under a container's init) is dead."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class Stack:
    """Processes of one test's platform, with helpers to crash and restart them."""

    def __init__(self, home: Path, nats_url: str, database_url: str, cluster: Path = CLUSTER,
                 smtp_url: str | None = None) -> None:
        self.home = home
        self.cluster = cluster
        self.nodes = [node.name for node in ClusterConfig.load(cluster).nodes] or list(NODES)
        self.storage = home / "storage"
        seed_storage(self.storage)
        for algorithm in TEST_ALGORITHMS.iterdir():
            shutil.copytree(algorithm, self.storage / "algorithms" / algorithm.name)
        env = stack_env(nats_url=nats_url, database_url=database_url, storage=self.storage, cluster=cluster,
                        extra={"TRAINYARD_HEARTBEAT_SECONDS": "0.5", "TRAINYARD_NODE_LOST_SECONDS": "3",
                               "TRAINYARD_STOP_GRACE_SECONDS": "3", "TRAINYARD_STOP_GIVE_UP_SECONDS": "3",
                               "TRAINYARD_HEALTH_PROBE_SECONDS": "1",
                               **({"TRAINYARD_SMTP_URL": smtp_url} if smtp_url else {}),
                               **provision_auth(home, user="tester", email=TESTER_EMAIL)})
        self.token = Path(env["TRAINYARD_TOKEN_FILE"]).read_text()
        self.processes = ProcessSet(home, env)
        self.nats_url = nats_url
        self.client: TrainyardClient | None = None

    def start(self, name: str) -> None:
        if name in SERVICES:
            self.processes.start(name, service_argv(name))
        else:
            self.processes.start(name, agent_argv(name.removeprefix("agent-"), self.cluster, self.home / "agents"))

    def start_all(self, *, agents: bool = True) -> None:
        for name in SERVICES:
            self.start(name)
        if agents:
            for node in self.nodes:
                self.start(f"agent-{node}")

    async def up(self) -> TrainyardClient:
        """Start every service and agent; return a client once all nodes are ready."""
        self.start_all()
        await self.wait_for_nodes()
        return await self.api()

    def crash(self, name: str) -> None:
        """kill -9: no shutdown code runs."""
        self.processes.kill(name, signal.SIGKILL)

    async def api(self) -> TrainyardClient:
        if self.client is None:
            self.client = await TrainyardClient.open(self.nats_url, token=self.token)
        return self.client

    async def wait_for_nodes(self, count: int | None = None, timeout: float = 60) -> None:
        api = await self.api()
        count = len(self.nodes) if count is None else count
        async with asyncio.timeout(timeout):
            while True:
                with contextlib.suppress(ServiceUnavailable):
                    if sum(n.status == "ready" for n in await api.nodes()) >= count:
                        return
                await asyncio.sleep(0.2)

    async def wait_until(self, job_id: str, check: str, timeout: float = 60) -> JobView:
        """Wait until the job is `running` with every instance started, or ended (`ended`)."""
        api = await self.api()
        async with asyncio.timeout(timeout):
            while True:
                try:
                    job = (await api.get_job(job_id)).job
                except ServiceUnavailable:  # a service being restarted by the test
                    await asyncio.sleep(0.2)
                    continue
                if check == "running" and job.instances and all(i.state == "running" for i in job.instances):
                    return job
                if check == "ended" and job.status in ("succeeded", "failed", "stopped", "expired"):
                    return job
                await asyncio.sleep(0.2)

    async def logs(self, job_id: str, rank: int | None = None) -> list[str]:
        api = await self.api()
        return [f"[{c.rank}] {line}" for c in [c async for c in api.logs(job_id, rank)] for line in c.lines]

    def dump_logs(self) -> str:
        parts = []
        for path in sorted((self.home / "logs").glob("*.log")):
            parts.append(f"----- {path.name}\n{path.read_text(errors='replace')[-4000:]}")
        return "\n".join(parts)


@pytest.fixture
def mailbox() -> Iterator[Mailbox]:
    box = Mailbox()
    box.controller.start()
    try:
        yield box
    finally:
        box.controller.stop()


@pytest_asyncio.fixture(loop_scope="session")
async def stack(tmp_path: Path, nats_url: str, database_url: str, mailbox: Mailbox,
                request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    tmp_path.chmod(0o755)
    # A test marked `@pytest.mark.cluster(path)` runs on that cluster config instead of the local one.
    marker = request.node.get_closest_marker("cluster")
    platform = Stack(tmp_path, nats_url, database_url, cluster=marker.args[0] if marker else CLUSTER,
                     smtp_url=mailbox.url)
    yield platform
    if platform.client is not None:
        await platform.client.close()
    platform.processes.stop_all()
    # Jobs of agents the test killed are not anyone's children any more: end them here.
    for node in platform.nodes:
        kill_leftovers(tmp_path / "agents" / node)
    # Shown by pytest only when the test failed.
    print(platform.dump_logs())
