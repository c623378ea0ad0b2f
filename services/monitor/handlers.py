"""The requests the monitor answers: the agents' registrations, and what people ask it with their token.

Each handler is thin: it checks who asks, takes the service lock for what it reads or changes, has the rules
(rules.py) decide what to record and the service record it. Agents register with their node credential, which
the handler checks itself; people's requests come with a token the request plumbing has checked already. The
runs (R2) are answered by `runs.reader.RunReader`. A job the monitor no longer holds (archived) is read back from
the events stream (`archive`) for the alerts about it and its debug terminal.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Protocol

import nats.errors
from nats.aio.client import Client

from libs.auth import AuthError, node_from_headers
from libs.contracts.agent import NodeAccepted, RegisterNode
from libs.contracts.datacache import CacheReport
from libs.contracts.events import AlertRaised
from libs.contracts.health import COMPONENT_PATTERN
from libs.contracts.identity import Identity
from libs.contracts.operations.agents import REGISTER_NODE
from libs.contracts.operations.alerts import LIST_ALERTS, AlertPage, ListAlerts
from libs.contracts.operations.base import CommandError, Done
from libs.contracts.operations.cache import LIST_CACHE, CacheListing, ListCache
from libs.contracts.operations.cluster import MARK_COMPONENT, MarkComponent
from libs.contracts.operations.runs import OPEN_TERMINAL, OpenTerminal, TerminalOpened
from libs.controlsign import ControlSigner
from libs.eventstore import EventStore, Tracking
from libs.jobstatus import JobLifecycle
from libs.messaging.responder import Route
from libs.telemetry.logs import get_logger
from services.monitor import alerts, caches, rules, terminal
from services.monitor.rules import Outcome
from services.monitor.runs.archive import PastJobs, events_unavailable
from services.monitor.state import MonitorState

log = get_logger(__name__)


class Monitoring(Protocol):
    """What the handlers use of the monitor: service.py gives it; a test may give anything that has it."""

    @property
    def lock(self) -> asyncio.Lock:
        """Held by every decision: folds, reactions, the patrol and the requests that change nodes."""

    @property
    def state(self) -> MonitorState: ...

    @property
    def jobs(self) -> JobLifecycle:
        """The scheduler's jobs and settings, as folded from its events."""

    @property
    def past(self) -> PastJobs:
        """The jobs archived, read back when asked about."""

    @property
    def operators(self) -> Sequence[str]:
        """Who gets every alert's mail."""

    @property
    def reports(self) -> Mapping[str, CacheReport]:
        """Each node's latest cache report."""

    def version(self, aggregate_type: str, aggregate_id: str) -> int: ...

    async def carry_out(self, outcome: Outcome, tracking: Tracking | None = None) -> bool:
        """Record the outcome's events and alerts in one append, then have its workspaces released."""


def node_credential(secret: str, headers: Mapping[str, str] | None) -> str | AuthError:
    """The node the message's node credential names, or why it has none that is valid (an HS256 check)."""
    try:
        return node_from_headers(secret, headers)
    except AuthError as exc:
        return exc


class AgentRequests:
    """An agent's registration (M2), accepted only with the node credential of exactly that node."""

    def __init__(self, monitor: Monitoring, *, secret: str, heartbeat_seconds: float) -> None:
        self.monitor = monitor
        self.secret = secret
        self.heartbeat_seconds = heartbeat_seconds  # what an accepted node is told to heartbeat at

    def routes(self) -> list[Route]:
        return [(REGISTER_NODE, self.register_with_credential)]

    def register_with_credential(self, request: RegisterNode,
                                 headers: Mapping[str, str] | None) -> Awaitable[NodeAccepted | CommandError]:
        return self.register(request, node_credential(self.secret, headers))

    async def register(self, request: RegisterNode, credential: str | AuthError) -> NodeAccepted | CommandError:
        """Accept a node whose credential names exactly it; anything else is refused and records nothing."""
        info = request.node
        refusal = rules.credential_refusal(info.name, credential)
        if refusal is not None:
            log.warning("node.registration_refused", node=info.name, code=refusal.code, reason=refusal.message)
            return refusal
        async with self.monitor.lock:
            await self.monitor.carry_out(rules.registration(info, self.monitor.state.nodes.get(info.name)))
            self.monitor.state.nodes[info.name].last_seen = time.monotonic()
        return NodeAccepted(heartbeat_seconds=self.heartbeat_seconds,
                            cache=rules.cache_policy(self.monitor.jobs.settings))


class UserRequests:
    """What people ask the monitor, each with their token: component marks (administrators), debug terminals
    (J15), the alerts they may see (M7) and the nodes' dataset caches (D1, D2)."""

    def __init__(self, monitor: Monitoring, *, nc: Client, signer: ControlSigner, store: EventStore) -> None:
        self.monitor = monitor
        self.nc = nc
        self.signer = signer  # the monitor's signature on its requests to agents (libs/controlsign.py)
        self.store = store  # the monitor's own log, where the alerts are read from

    def routes(self) -> list[Route]:
        return [
            (MARK_COMPONENT, self.mark),
            (OPEN_TERMINAL, self.open_terminal),
            (LIST_ALERTS, self.list_alerts),
            (LIST_CACHE, self.list_cache),
        ]

    async def mark(self, request: MarkComponent, identity: Identity) -> Done | CommandError:
        if not identity.admin:
            return CommandError(code="forbidden", message="only administrators mark components",
                                hint="ask an administrator to run the drill")
        if not COMPONENT_PATTERN.match(request.component):
            return CommandError(code="invalid-request", message=f"{request.component!r} is not a component",
                                hint="name it <kind>:<name> with kind nic, board or runtime, "
                                     "e.g. board:0, nic:eth0 or runtime:storage")
        async with self.monitor.lock:
            node = self.monitor.state.nodes.get(request.node)
            if node is None:
                return CommandError(code="not-found", message=f"no such node: {request.node}",
                                    hint="`trainyard nodes` lists the nodes")
            what = f"{request.component} of {request.node}"
            outcome = rules.mark(node, request, identity.user, self.monitor.version("node", node.name),
                                 self.monitor.jobs, self.monitor.operators)
            if outcome is None:
                return Done(job_ids=[], message=f"{what} is already marked faulty" if request.faulty
                            else f"{what} is not marked")
            await self.monitor.carry_out(outcome)
            status = f"the node has problems: {'; '.join(node.problems)}" if node.problems else "the node is healthy"
        return Done(job_ids=[], message=f"{what} {'marked faulty' if request.faulty else 'mark cleared'}; {status}")

    async def list_cache(self, request: ListCache, _: Identity) -> CacheListing | CommandError:
        nodes, reports = self.monitor.state.nodes, self.monitor.reports
        if request.node is not None and request.node not in nodes and request.node not in reports:
            return CommandError(code="not-found", message=f"no such node: {request.node}",
                                hint="`trainyard nodes` lists the nodes")
        return caches.listing(reports, nodes, request.node)

    async def list_alerts(self, request: ListAlerts, identity: Identity) -> AlertPage | CommandError:
        """M7: a page of the alerts this user may see, read from the monitor's own log (one more than
        the limit, to tell whether more follow); `trainyard alerts` pages through them."""
        raised = await self.store.read_type("alert", AlertRaised, after=request.after, limit=request.limit + 1)
        wanted = alerts.jobs_to_look_up(raised, request, identity, self.monitor.jobs)
        try:
            archived = await self.monitor.past.records(wanted) if wanted else {}
        except (nats.errors.Error, OSError) as exc:
            return events_unavailable(exc)
        return alerts.page(raised, request, identity, self.monitor.jobs, archived)

    async def open_terminal(self, request: OpenTerminal, identity: Identity) -> TerminalOpened | CommandError:
        async with self.monitor.lock:
            target = (terminal.target(request, identity, self.monitor.jobs, self.monitor.state, datetime.now(UTC))
                      if request.job_id in self.monitor.jobs.jobs else None)
        if target is None:  # archived (or never there): read back, outside the lock
            try:
                past = await self.monitor.past.find(request.job_id)
            except (nats.errors.Error, OSError) as exc:
                return events_unavailable(exc)
            return terminal.archived_refusal(request, identity, past, self.monitor.jobs, datetime.now(UTC))
        if isinstance(target, CommandError):
            return target
        return await terminal.open_session(self.nc, self.signer, request, identity, target)

