"""A cluster of NATS servers on one machine, for the local stack (`make up NATS=3`), the tests and the failover drill.

Each server has its own client port, route port, JetStream store and name, the same logins and role permissions as
a single server (devstack/natslogins.py), and routes to the others. With three servers, the stack keeps every
stream on all three (`TRAINYARD_STREAM_REPLICAS=3`), so that any one server, the streams' leader included, may be
killed without losing an acknowledged message; every process is given all the servers' URLs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from devstack.servers import ServerError, free_port, start_nats
from libs.messaging.connection import NatsLogin, server_urls

CLUSTER_NAME = "trainyard"


@dataclass
class NatsCluster:
    """`size` servers under `home/nats-<i>/` (i from 1), configured from `config` (a single server's, logins
    included); ports chosen free unless given."""

    home: Path
    config: Path
    size: int = 3
    ports: list[int] = field(default_factory=list)
    route_ports: list[int] = field(default_factory=list)
    servers: list[subprocess.Popen[bytes] | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ports = self.ports or [free_port() for _ in range(self.size)]
        self.route_ports = self.route_ports or [free_port() for _ in range(self.size)]
        self.servers = [None] * self.size

    @property
    def url(self) -> str:
        """Every server's URL, comma-separated: what NATS_URL is for the stack's processes."""
        return ",".join(self.server_url(i) for i in range(self.size))

    def server_url(self, index: int) -> str:
        return f"nats://127.0.0.1:{self.ports[index]}"

    def name(self, index: int) -> str:
        return f"{CLUSTER_NAME}-{index + 1}"

    def folder(self, index: int) -> Path:
        return self.home / f"nats-{index + 1}"

    def _server_config(self, index: int) -> Path:
        """The single server's configuration with this server's name and its routes to the others."""
        routes = ", ".join(f'"nats-route://127.0.0.1:{port}"' for i, port in enumerate(self.route_ports) if i != index)
        path = self.folder(index) / "server.conf"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(self.config.read_text() + f'server_name: "{self.name(index)}"\n'
                        f'cluster {{\n name: "{CLUSTER_NAME}"\n listen: "127.0.0.1:{self.route_ports[index]}"\n'
                        f" routes: [{routes}]\n}}\n")
        return path

    def start(self, index: int) -> subprocess.Popen[bytes]:
        """Start server `index` (again: on its ports and store, as after a crash)."""
        process = start_nats(self.folder(index), self.ports[index], self._server_config(index))
        self.servers[index] = process
        return process

    def start_all(self) -> None:
        for index in range(self.size):
            self.start(index)

    def kill(self, index: int) -> None:
        """kill -9 server `index`: no shutdown, as a crash of its machine."""
        process = self.servers[index]
        if process is not None:
            process.kill()
            process.wait(timeout=10)
            self.servers[index] = None

    def stop_all(self) -> None:
        for index, process in enumerate(self.servers):
            if process is not None:
                process.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=10)
                if process.poll() is None:
                    process.kill()
                self.servers[index] = None

    def index_of(self, server_name: str) -> int:
        """The index of the server of that name (a stream's leader, say)."""
        return next(i for i in range(self.size) if self.name(i) == server_name)


async def wait_for_jetstream(url: str, login: NatsLogin, timeout: float = 30.0) -> None:
    """Wait until the cluster's JetStream answers (its servers have elected a meta leader), so that the first
    service to declare its streams does not find JetStream still forming."""
    import nats
    from nats.js.errors import NotFoundError

    from libs.contracts import subjects

    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            nc = await nats.connect(server_urls(url), connect_timeout=2, allow_reconnect=False, **login.options())
        except Exception as exc:
            last = exc
            await asyncio.sleep(0.3)
            continue
        try:
            # A role may not ask for the account's JetStream info; the event history's stream info it may: an answer,
            # even "no such stream", says JetStream's meta leader is there.
            await nc.jetstream().stream_info(subjects.EVENTS_STREAM)
            return
        except NotFoundError:
            return
        except Exception as exc:
            last = exc
            await asyncio.sleep(0.3)
        finally:
            await nc.close()
    raise ServerError(f"the NATS cluster at {url} did not offer JetStream within {timeout:g}s: {last!r}")


def jetstream_ready(url: str, login: NatsLogin, timeout: float = 30.0) -> None:
    """`wait_for_jetstream` from code that is not a coroutine (a harness made inside a test's event loop)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, wait_for_jetstream(url, login, timeout)).result()


async def stream_leader(url: str, login: NatsLogin, stream: str, timeout: float = 30.0) -> tuple[str, int]:
    """The name of the server that leads `stream` now, once one does (waiting through an election), and how many
    servers keep the stream."""
    import nats

    nc = await nats.connect(server_urls(url), **login.options())
    try:
        async with asyncio.timeout(timeout):
            while True:
                with contextlib.suppress(Exception):  # no leader for a moment: JetStream answers an error
                    info = await nc.jetstream().stream_info(stream)
                    if info.cluster is not None and info.cluster.leader:
                        return info.cluster.leader, int(info.config.num_replicas or 1)
                await asyncio.sleep(0.1)
    finally:
        await nc.close()


async def published_events(url: str, login: NatsLogin, services: list[str]) -> dict[str, int]:
    """Per service, the events the event history's stream holds (each once, those of bundles counted one by one)."""
    import contextlib

    import nats

    from libs.contracts import subjects
    from libs.contracts.bundles import stored_envelopes
    from libs.messaging.reader import read_subject

    nc = await nats.connect(server_urls(url), **login.options())
    try:
        found = {}
        for service in services:
            events: set[str] = set()
            reading = read_subject(nc.jetstream(), subjects.EVENTS_STREAM, subjects.events_of_service(service))
            async with contextlib.aclosing(reading) as msgs:
                async for msg in msgs:
                    events.update(envelope.event_id for envelope in stored_envelopes(msg.subject, msg.data))
            found[service] = len(events)
        return found
    finally:
        await nc.close()
