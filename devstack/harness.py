"""The whole platform on given servers for one run: the four services and the node agents as separate
processes with fast fault timings, helpers to crash and restart them, and waits on what a client sees.

The end-to-end tests and the fault drills drive it. It reaches the platform through a client its
caller opens (`connect`, e.g. `TrainyardClient.open`).
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import yaml

from devstack.hosts import Hosts
from devstack.natscluster import NatsCluster, jetstream_ready
from devstack.natslogins import provision_nats_logins, service_login
from devstack.pglogins import is_superuser, provision_service_logins, run_to_end
from devstack.servers import free_port, start_nats
from devstack.stack import (
    REPO_ROOT,
    SERVICES,
    ProcessSet,
    end_platform,
    provision_auth,
    seed_storage,
    stack_env,
    start_agent,
    start_gateway,
    start_service,
)
from libs.contracts.agent import LogChunk
from libs.contracts.cluster import ClusterConfig
from libs.contracts.operations.autoscaler import QueueStatus
from libs.contracts.operations.cluster import NodeView
from libs.contracts.operations.jobs import JobDetails, JobView
from libs.messaging.connection import STREAM_REPLICAS_VARIABLE
from libs.messaging.rpc import ServiceUnavailable

CLUSTER = REPO_ROOT / "deploy" / "local" / "cluster.yaml"
NODES = ("node-a", "node-b")  # when the cluster config names none
TESTER = "tester"  # the administrator the stack's token is issued to
TESTER_EMAIL = "tester@example.com"
# Short enough for a lost node, a stop and a health change to play out within seconds.
FAST_TIMINGS = {"TRAINYARD_HEARTBEAT_SECONDS": "0.5", "TRAINYARD_NODE_LOST_SECONDS": "3",
                "TRAINYARD_STOP_GRACE_SECONDS": "3", "TRAINYARD_STOP_GIVE_UP_SECONDS": "3",
                "TRAINYARD_HEALTH_PROBE_SECONDS": "1"}


class StackClient(Protocol):
    """What the harness itself asks of the client it is given."""

    async def nodes(self) -> list[NodeView]: ...

    async def queue_status(self) -> QueueStatus: ...

    async def get_job(self, job_id: str) -> JobDetails: ...

    def logs(self, job_id: str, rank: int | None = None) -> AsyncIterator[LogChunk]: ...

    async def close(self) -> None: ...

    @property
    def closed(self) -> bool: ...


ClientT = TypeVar("ClientT", bound=StackClient)
OpenedClientT = TypeVar("OpenedClientT", bound=StackClient, covariant=True)


class Connect(Protocol[OpenedClientT]):
    """Opens a client on the stack's NATS server with the stack's token."""

    def __call__(self, nats_url: str, *, token: str) -> Awaitable[OpenedClientT]: ...


class Stack(Generic[ClientT]):
    """Processes of one run's platform, with helpers to crash and restart them."""

    def __init__(self, home: Path, nats_url: str | None, database_url: str, *, connect: Connect[ClientT],
                 cluster: Path = CLUSTER, smtp_url: str | None = None, algorithms: Path | None = None,
                 timings: dict[str, str] | None = None, env: Mapping[str, str] | None = None,
                 nats_servers: int = 1, separate_hosts: bool = False, sync_nats_writes: bool = False) -> None:
        """`database_url`: the database the services keep their event logs in; when its user is a superuser (as
        with the tests' own servers), each service logs in as a role of its own there, as with `make up`.
        `nats_url`: a server to use as it is; None starts one of the stack's own that enforces a login
        per role (libs/natsroles.py), as `make up` does. `algorithms`: a folder whose algorithms are copied
        into shared storage beside the examples. `timings`: the fault timings (FAST_TIMINGS unless given;
        `{}` for the platform's defaults, as a benchmark of steady work wants). `env`: more variables for every
        process (traces or metrics exported, say). `nats_servers`: with no `nats_url`, a cluster of that many
        servers of the stack's own, every stream kept on three of them (or all, when fewer). `separate_hosts`: each
        node agent on a host of its own (a network namespace with its own address, devstack/hosts.py), the
        stack's own NATS listening on the control host's address; the cluster config's addresses become the hosts'.
        `sync_nats_writes`: the stack's own NATS syncs every write to disk before it acknowledges it, as deploy/ runs it
        (by default, as `make up` runs it, it hands each to the operating system only)."""
        self.home = home
        self.sync_nats_writes = sync_nats_writes
        self.nats_process: subprocess.Popen[bytes] | None = None
        self.nats_cluster: NatsCluster | None = None
        self.nats_port = 0
        self.hosts: Hosts | None = None
        if separate_hosts:
            config = ClusterConfig.load(cluster)
            self.hosts = Hosts([node.name for node in config.nodes])
            self.hosts.create()
            cluster = self._on_hosts(cluster, self.hosts)
        replicas: dict[str, str] = {}
        try:
            if nats_url is None and nats_servers > 1:
                self.nats_cluster = NatsCluster(home, self._nats_config(), size=nats_servers)
                self.nats_cluster.start_all()
                jetstream_ready(self.nats_cluster.url, service_login(home, "scheduler"))
                nats_url = self.nats_cluster.url
                replicas = {STREAM_REPLICAS_VARIABLE: str(min(3, nats_servers))}
            elif nats_url is None:
                self.nats_port = free_port()
                address = self.hosts.control if self.hosts is not None else "127.0.0.1"
                self.nats_process = start_nats(home / "nats", self.nats_port, self._nats_config(),
                                               address=address)
                nats_url = f"nats://{address}:{self.nats_port}"
        except BaseException:  # no stack to close yet: leave no server, namespace or bridge behind
            if self.nats_cluster is not None:
                self.nats_cluster.stop_all()
            if self.hosts is not None:
                self.hosts.delete()
            raise
        self.cluster = cluster
        config = ClusterConfig.load(cluster)
        # A cluster the autoscaler grows may start without a node.
        self.nodes = [node.name for node in config.nodes] or ([] if config.autoscaler.instance_types else list(NODES))
        self.storage = home / "storage"
        seed_storage(self.storage)
        for algorithm in algorithms.iterdir() if algorithms else ():
            shutil.copytree(algorithm, self.storage / "algorithms" / algorithm.name)
        # Each service logs in as its own role where the URL's user can make them (a superuser: the tests' own
        # servers), as with `make up`; on a server of the caller's choosing otherwise, with that URL.
        roles = run_to_end(is_superuser(database_url))
        provision_service_logins(home, SERVICES, database_url, admin_url=database_url if roles else None)
        env = stack_env(nats_url=nats_url, storage=self.storage, cluster=cluster,
                        extra={**(FAST_TIMINGS if timings is None else timings),
                               **({"TRAINYARD_SMTP_URL": smtp_url} if smtp_url else {}),
                               **provision_auth(home, user=TESTER, email=TESTER_EMAIL), **replicas, **(env or {})})
        self.token = Path(env["TRAINYARD_TOKEN_FILE"]).read_text()
        self.processes = ProcessSet(home, env)
        self.nats_url = nats_url
        self.connect = connect
        self.client: ClientT | None = None

    def _on_hosts(self, cluster: Path, hosts: Hosts) -> Path:
        """A copy of the cluster config whose nodes have their hosts' addresses."""
        config = yaml.safe_load(cluster.read_text())
        for node in config.get("nodes") or []:
            node["address"] = hosts.address(node["name"])
        self.home.mkdir(parents=True, exist_ok=True)
        path = self.home / f"cluster-on-hosts-{cluster.name}"
        path.write_text(yaml.safe_dump(config))
        return path

    def start(self, name: str) -> None:
        if name in SERVICES:
            start_service(self.processes, name)
        else:
            node = name.removeprefix("agent-")
            start_agent(self.processes, node, self.cluster, self.home / "agents",
                        self.hosts.prefix(node) if self.hosts is not None else None)

    async def start_gateway(self, timeout: float = 30) -> str:
        """Start the gateway (the HTTP API and the console) on a free port of 127.0.0.1; its base URL, once it
        listens there."""
        port = free_port()
        start_gateway(self.processes, f"127.0.0.1:{port}")
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"the gateway did not listen on 127.0.0.1:{port} within {timeout:.0f} s; "
                                       f"see {self.home / 'logs' / 'gateway.log'}") from None
                await asyncio.sleep(0.1)
                continue
            writer.close()
            await writer.wait_closed()
            return f"http://127.0.0.1:{port}"

    def start_standby(self, service: str) -> str:
        """A second process of `service` (`<service>-2`), waiting to take over from the active one."""
        instance = f"{service}-2"
        start_service(self.processes, service, instance)
        return instance

    def start_all(self, *, agents: bool = True) -> None:
        for name in SERVICES:
            self.start(name)
        if agents:
            for node in self.nodes:
                self.start(f"agent-{node}")

    async def up(self) -> ClientT:
        """Start every service and agent; return a client once all nodes are ready."""
        self.start_all()
        await self.wait_for_nodes()
        return await self.api()

    def crash(self, name: str) -> None:
        """kill -9: no shutdown code runs."""
        self.processes.kill(name, signal.SIGKILL)

    def pause(self, name: str) -> None:
        """kill -STOP: the process holds its connections and does nothing, as a hung or cut-off one."""
        self.processes.send(name, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.processes.send(name, signal.SIGCONT)

    def _nats_config(self) -> Path:
        return provision_nats_logins(self.home, sync_every_write=self.sync_nats_writes)

    def restart_nats(self, down_seconds: float = 0.0) -> None:
        """kill -9 the stack's own NATS server, then start it again on the same port, store and logins."""
        assert self.nats_process is not None, "the stack was given a NATS server: it is not the stack's to kill"
        self.nats_process.kill()
        self.nats_process.wait(timeout=10)
        time.sleep(down_seconds)
        self.nats_process = start_nats(self.home / "nats", self.nats_port, self._nats_config(),
                                       address=self.hosts.control if self.hosts is not None else "127.0.0.1")

    async def api(self, timeout: float = 30) -> ClientT:
        """The stack's client, opened on first use: retried while NATS refuses the login, as it does until
        a service answering its auth callout runs."""
        if self.client is not None and self.client.closed:  # closed: its token ran out while NATS was away
            self.client = None
        if self.client is None:
            deadline = asyncio.get_running_loop().time() + timeout
            while self.client is None:
                try:
                    self.client = await self.connect(self.nats_url, token=self.token)
                except Exception:
                    if asyncio.get_running_loop().time() > deadline:
                        raise
                    await asyncio.sleep(0.2)
        return self.client

    async def wait_for_nodes(self, count: int | None = None, timeout: float = 60) -> None:
        """Wait until `count` nodes (all by default) are ready and every service answers."""
        api = await self.api()
        count = len(self.nodes) if count is None else count
        nodes_seen, unavailable = "none listed", ""  # what the last looks saw, said if the wait runs out
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        nodes = await api.nodes()
                        nodes_seen = ", ".join(f"{n.info.name} {n.status}" + "".join(f" ({p})" for p in n.problems)
                                               for n in nodes) or "no nodes"
                        unavailable = ""
                        if sum(n.status == "ready" for n in nodes) >= count:
                            await api.queue_status()  # the autoscaler, the one service the rest do not wait for
                            return
                    except ServiceUnavailable as exc:
                        unavailable = f"; then {exc}"
                    await asyncio.sleep(0.2)
        except TimeoutError:
            raise TimeoutError(f"{count} ready nodes and every service answering were awaited for {timeout:g}s; "
                               f"nodes last listed: {nodes_seen}{unavailable}") from None

    async def wait_until(self, job_id: str, check: str, timeout: float = 60) -> JobView:
        """Wait until the job is `running` with every instance started, or ended (`ended`)."""
        api = await self.api()
        async with asyncio.timeout(timeout):
            while True:
                try:
                    job = (await api.get_job(job_id)).job
                except ServiceUnavailable:  # a service being restarted by the caller
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

    async def close(self) -> None:
        """Close the client and stop every process this stack still runs."""
        if self.client is not None:
            await self.client.close()
        self.processes.stop_all()
        end_platform(self.nodes, self.home)  # a stopped agent leaves its jobs running
        if self.nats_cluster is not None:
            self.nats_cluster.stop_all()
        if self.nats_process is not None:
            self.nats_process.terminate()
            self.nats_process.wait(timeout=10)
        if self.hosts is not None:
            self.hosts.delete()
