"""Simulated nodes, by the thousand: each registers with the monitor with its own node credential (which the
monitor checks, as for a real agent) and from then on heartbeats with an empty probe, so that the services see
them as ready nodes. What they run is bench/simagents.py's.

Many nodes share one NATS connection (`per_connection`), so the NATS server must be one without role
enforcement (the tests' server, bench/servers.py's): a node's token rides on each of its messages instead.
A test can silence one node's heartbeats (`Heartbeats.silence`), and the monitor then counts it lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import nats
from nats.aio.client import Client

from libs.auth import bearer_headers, issue_node_token
from libs.contracts import subjects
from libs.contracts.agent import Heartbeat, NodeAccepted, RegisterNode
from libs.contracts.cluster import NodeInfo
from libs.contracts.codec import encode
from libs.contracts.operations.agents import REGISTER_NODE
from libs.contracts.operations.base import CommandError
from libs.messaging.rpc import call

HEARTBEAT_SECONDS = 2.0  # the platform's default
REGISTERING_AT_ONCE = 64
NODE_CPUS = 16
NODE_MEMORY_MIB = 65536


def node_name(index: int) -> str:
    return f"sim-{index:05d}"


async def register_all(nc: Client, names: list[str], secret: str, beats: Heartbeats, *,
                       pools: Sequence[str] = ()) -> None:
    """Register `names` (at most REGISTERING_AT_ONCE at once), each a node of NODE_CPUS and NODE_MEMORY_MIB in
    `pools`, then have them heartbeat."""
    gate = asyncio.Semaphore(REGISTERING_AT_ONCE)

    async def one(name: str) -> str:
        token = issue_node_token(secret, name)
        info = NodeInfo(name=name, address="10.0.0.1", cpus=NODE_CPUS, memory_mib=NODE_MEMORY_MIB, pools=list(pools))
        async with gate:
            reply = await call(nc, REGISTER_NODE.subject, RegisterNode(node=info), timeout=60,
                               reply_type=NodeAccepted | CommandError, token=token)
        if isinstance(reply, CommandError):
            raise RuntimeError(f"{name} was refused: {reply.message}")
        return token

    tokens = await asyncio.gather(*(one(name) for name in names))
    beats.start(nc, list(zip(names, tokens, strict=True)))


class Heartbeats:
    """The simulated nodes' heartbeats, each group's from the moment it registered (a node that waited for all
    10,000 to register would be lost meanwhile), every node's every `seconds`, spread evenly; counted. A node
    `silence`d sends none from then on."""

    def __init__(self, seconds: float = HEARTBEAT_SECONDS) -> None:
        self.seconds = seconds
        self.sent = 0
        self.silent: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, nc: Client, nodes: list[tuple[str, str]]) -> None:
        self._tasks.append(asyncio.create_task(self._beat(nc, nodes)))

    def silence(self, name: str) -> None:
        """Stop heartbeating for `name`, as a node that went away."""
        self.silent.add(name)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _beat(self, nc: Client, nodes: list[tuple[str, str]]) -> None:
        gap = self.seconds / max(1, len(nodes))
        while True:
            began = time.monotonic()
            for index, (name, token) in enumerate(nodes):
                if name not in self.silent:
                    beat = Heartbeat(node=name, sent_at=datetime.now(UTC))
                    await nc.publish(subjects.heartbeat(name), encode(beat), headers=bearer_headers(token))
                    self.sent += 1
                if index % 50 == 49 and (ahead := began + gap * (index + 1) - time.monotonic()) > 0:
                    await asyncio.sleep(ahead)
            await asyncio.sleep(max(0.0, began + self.seconds - time.monotonic()))


@dataclass
class Fleet:
    """Simulated nodes registered and heartbeating: their names, NATS connections and heartbeats."""

    names: list[str]
    connections: list[Client]
    beats: Heartbeats
    registered_seconds: float = 0.0


@contextlib.asynccontextmanager
async def simulated_nodes(nats_url: str, secret: str, count: int, *, per_connection: int = 500,
                          heartbeat_seconds: float = HEARTBEAT_SECONDS, pools: Sequence[str] = (),
                          first: int = 0) -> AsyncIterator[Fleet]:
    """`count` simulated nodes (named from index `first`) registered with the monitor (signed with `secret`) and
    heartbeating every `heartbeat_seconds` until the block ends; `per_connection` of them share a connection."""
    names = [node_name(first + i) for i in range(count)]
    groups = [names[i:i + per_connection] for i in range(0, count, per_connection)]
    fleet = Fleet(names, [], Heartbeats(heartbeat_seconds))
    try:
        for _ in groups:
            fleet.connections.append(await nats.connect(nats_url))
        began = time.monotonic()
        await asyncio.gather(*(register_all(nc, group, secret, fleet.beats, pools=pools)
                               for nc, group in zip(fleet.connections, groups, strict=True)))
        fleet.registered_seconds = time.monotonic() - began
        yield fleet
    finally:
        await fleet.beats.stop()
        for nc in fleet.connections:
            await nc.close()
