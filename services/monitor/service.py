"""The monitor service: node registration, heartbeats and the patrol that marks nodes lost (M2).

A node that stops sending heartbeats for `node_lost_seconds` is recorded as lost; the scheduler
then stops placing work there and fails the jobs that ran on it. Heartbeats themselves are not
events (they would flood the log): after a restart every known node gets a full grace period.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import msgspec
from faststream.nats.annotations import NatsMessage

from libs.contracts import subjects
from libs.contracts.agent import Heartbeat, NodeAccepted, RegisterNode
from libs.contracts.codec import decode
from libs.contracts.events import Event, NodeRecovered, NodeRegistered
from libs.eventstore import NewEvent
from libs.messaging.rpc import register_responder
from libs.runtime import ServiceRuntime
from libs.telemetry.logs import get_logger
from services.monitor.state import MonitorState, lost_event

SERVICE = "monitor"
log = get_logger(__name__)


class Monitor:
    def __init__(self, runtime: ServiceRuntime) -> None:
        self.rt = runtime
        self.state = MonitorState()
        self.lock = asyncio.Lock()
        self.heartbeat_seconds = runtime.settings.heartbeat_seconds
        self.lost_after = runtime.settings.node_lost_seconds

    async def start(self) -> None:
        now = time.monotonic()
        async for envelope in self.rt.store.read_all():
            self.state.apply(envelope, now)
        log.info("monitor.rebuilt", nodes=len(self.state.nodes))
        register_responder(self.rt.broker, SERVICE, subjects.REGISTER_NODE, RegisterNode, self.register)
        self.rt.broker.subscriber(subjects.HEARTBEAT_ALL, queue="trainyard-monitor")(self.on_heartbeat)
        self.rt.spawn(self.patrol(), "patrol")

    async def _append(self, node_name: str, event: Event) -> None:
        node = self.state.nodes.get(node_name)
        stored = await self.rt.store.append(
            [NewEvent("node", node_name, event)],
            expected_versions={("node", node_name): node.version if node else 0},
        )
        for envelope in stored:
            self.state.apply(envelope, time.monotonic())
            log.info("node.event", node=node_name, event_type=type(event).name())

    async def register(self, request: RegisterNode) -> NodeAccepted:
        info = request.node
        async with self.lock:
            known = self.state.nodes.get(info.name)
            if known is None or known.info != info:
                await self._append(info.name, NodeRegistered(node=info))
            elif known.lost:
                await self._append(info.name, NodeRecovered(node_name=info.name))
            self.state.nodes[info.name].last_seen = time.monotonic()
        return NodeAccepted(heartbeat_seconds=self.heartbeat_seconds)

    async def on_heartbeat(self, msg: NatsMessage) -> None:
        try:
            beat = decode(msg.body, Heartbeat)
        except msgspec.ValidationError:
            return
        async with self.lock:
            node = self.state.nodes.get(beat.node)
            if node is None:
                return
            node.last_seen = time.monotonic()
            if node.lost:
                await self._append(beat.node, NodeRecovered(node_name=beat.node))

    async def patrol(self) -> None:
        while True:
            await asyncio.sleep(min(self.heartbeat_seconds, self.lost_after / 4))
            async with self.lock:
                now = time.monotonic()
                for node in self.state.overdue(now, self.lost_after):
                    await self._append(node.info.name, lost_event(node, now, datetime.now(UTC)))
