"""The node's presence at the monitor (M1, M2): its registration, again whenever the monitor asks, its
heartbeats with the latest health probe and whether its disk takes new work, and the pre-checks of a job's
nodes.

The registration carries the node's credential; a refusal at start ends the agent with the monitor's reason,
a later one is logged while the jobs run on. The monitor's answer sets the heartbeat interval and the cache
policy. A probe runs in a thread (nvidia-smi or slow storage never hold up the agent), every
`health_probe_seconds` and for every pre-check.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg

from agent.caches.preparation import DataPreparation
from agent.presence.health import probe, resource_checks
from libs.auth import bearer_headers
from libs.contracts import subjects
from libs.contracts.agent import AnnounceNodes, Heartbeat, NodeAccepted, PrecheckNode, PrecheckReport, RegisterNode
from libs.contracts.cluster import NodeInfo
from libs.contracts.codec import encode
from libs.contracts.health import ComponentHealth
from libs.contracts.operations.agents import REGISTER_NODE
from libs.contracts.operations.base import CommandError
from libs.messaging.responder import decode_bounded
from libs.messaging.rpc import ServiceUnavailable, call
from libs.telemetry.logs import get_logger
from libs.telemetry.metrics import AGENT_PROCESSES, SampledGauge

log = get_logger(__name__)
_processes = SampledGauge(AGENT_PROCESSES)  # set with every heartbeat


class NodePresence:
    """Registers the node with the monitor and keeps it known there: heartbeats, probes, pre-checks."""

    def __init__(self, nc: Client, info: NodeInfo, *, node_token: str | None, storage: Path, root: Path,
                 health_probe_seconds: float, data: DataPreparation, running: Callable[[], list[str]],
                 each_beat: Callable[[], None]) -> None:
        """`running`: the holders of the ranks that run, sent with every heartbeat; `each_beat`: what the
        agent does at every heartbeat besides (frees the ports no live attempt holds, forgets the ranks long
        over)."""
        self.nc = nc
        self.info = info
        self.node_token = node_token
        self.storage = storage
        self.root = root
        self.health_probe_seconds = health_probe_seconds
        self.data = data  # its cache policy comes with the monitor's answer
        self.running = running
        self.each_beat = each_beat
        self.health: list[ComponentHealth] = []  # the latest probe, sent with every heartbeat
        self.heartbeat_seconds = 2.0
        self.disk_pressure: str | None = None  # D1: why the node takes no new work, sent with heartbeats
        self._announcing: asyncio.Task[None] | None = None  # a registration the monitor asked for

    async def register(self) -> None:
        """Probe the node, register it, and register it again whenever the monitor asks (it started anew, or
        lost what it knew of this node)."""
        self.health = await self._probe()
        await self._register()
        await self.nc.subscribe(subjects.ANNOUNCE_NODES, cb=self._on_announce)

    async def _on_announce(self, msg: Msg) -> None:
        asked = decode_bounded(msg.data, AnnounceNodes, strict=False)
        if isinstance(asked, CommandError):  # nobody to answer: a publish, not a request
            log.warning("agent.bad_announce", node=self.info.name, error=asked.message)
            return
        if asked.nodes and self.info.name not in asked.nodes:
            return
        if self._announcing is None or self._announcing.done():
            log.info("agent.registering_again", node=self.info.name)
            self._announcing = asyncio.create_task(self._register(refusal_ends_agent=False))

    async def _register(self, *, refusal_ends_agent: bool = True) -> None:
        delay = 0.2
        while True:
            try:
                reply = await call(self.nc, REGISTER_NODE.subject, RegisterNode(node=self.info), timeout=5.0,
                                   reply_type=NodeAccepted | CommandError, token=self.node_token)
            except ServiceUnavailable as exc:  # the monitor is not up yet: keep trying
                log.info("agent.register_retry", node=self.info.name, error=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if isinstance(reply, CommandError):
                # A refused registration does not fix itself: stop with the monitor's reason (at start; later
                # the agent goes on with its jobs and says so).
                hint = f"; {reply.hint}" if reply.hint else ""
                if refusal_ends_agent:
                    raise SystemExit(f"the monitor refused node {self.info.name}: {reply.message}{hint}")
                log.error("agent.registration_refused", node=self.info.name, error=reply.message, hint=reply.hint)
                return
            self.heartbeat_seconds = reply.heartbeat_seconds
            if reply.cache != self.data.cache.policy:
                self.data.cache.policy = reply.cache
                self.data.wake.set()
            return

    async def heartbeats(self) -> None:
        while True:
            running = self.running()
            _processes.set(len(running))
            beat = Heartbeat(node=self.info.name, sent_at=datetime.now(UTC), running=running, health=self.health,
                             disk_pressure=self.disk_pressure)
            self.each_beat()
            with contextlib.suppress(Exception):
                await self.nc.publish(subjects.heartbeat(self.info.name), encode(beat),
                                      headers=bearer_headers(self.node_token))
            await asyncio.sleep(self.heartbeat_seconds)

    def on_disk_pressure(self, reason: str | None) -> None:
        if reason is not None and self.disk_pressure is None:
            log.warning("agent.disk_pressure", node=self.info.name, reason=reason)
        elif reason is None and self.disk_pressure is not None:
            log.info("agent.disk_relieved", node=self.info.name)
        self.disk_pressure = reason

    async def _probe(self) -> list[ComponentHealth]:
        """A fresh probe of the node, in a thread: nvidia-smi or slow storage never hold up the agent."""
        health = await asyncio.to_thread(probe, self.info, self.storage, self.root,
                                         nvidia_smi=shutil.which("nvidia-smi"))
        before = {c.key: c.healthy for c in self.health}
        for component in health:
            if component.healthy != before.get(component.key, True):
                log.info("agent.health_changed", node=self.info.name, component=str(component))
        return health

    async def probe_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.health_probe_seconds)
            try:
                self.health = await self._probe()
            except Exception as exc:  # a probe that breaks must not end the heartbeats' source
                log.exception("agent.probe_failed", node=self.info.name, error=repr(exc))

    async def precheck(self, request: PrecheckNode) -> PrecheckReport:
        self.health = await self._probe()
        checks = [*self.health, *await asyncio.to_thread(resource_checks, request, self.info)]
        log.info("agent.prechecked", job_id=request.job_id, node=self.info.name,
                 problems=[str(c) for c in checks if not c.healthy])
        return PrecheckReport(node=self.info.name, checks=checks)
