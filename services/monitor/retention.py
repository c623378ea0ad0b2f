"""Debug environments (J15): kept after an abnormal end for the retention time, then released.

Agents keep the workspaces of a job with the debug terminal on after its processes end. When the job
fails or expires the monitor records DebugEnvironmentKept (its last placement's nodes, until the end
plus the retention: the spec's, else the administrator's `debug_retention`); once that time is past,
it asks each node's agent to remove them and records DebugEnvironmentReleased. A job that ends any
other way keeps nothing: its workspaces are released at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from nats.aio.client import Client
from nats.errors import Error as NatsError

from libs.contracts import subjects
from libs.contracts.agent import Released, ReleaseWorkspaces
from libs.contracts.events import DebugEnvironmentKept, DebugEnvironmentReleased
from libs.contracts.jobspec import parse_duration
from libs.contracts.messages import CommandError
from libs.contracts.scheduling import AdminSettings
from libs.messaging.rpc import ServiceUnavailable, call
from libs.telemetry.logs import get_logger
from libs.telemetry.tracing import context_from_headers, tracer
from services.monitor.jobs import FollowedJob
from services.monitor.state import KeptEnvironment

if TYPE_CHECKING:
    from services.monitor.service import Monitor

log = get_logger(__name__)
span_tracer = tracer("trainyard.monitor")
AGENT_TIMEOUT_SECONDS = 10.0
RETRY_SECONDS = 30.0
CHECK_SECONDS = 5.0


def retention_seconds(job: FollowedJob, settings: AdminSettings) -> int:
    own = job.spec.debug_terminal.retention if job.spec.debug_terminal else None
    try:
        return parse_duration(own or settings.debug_retention)
    except ValueError:  # validated where it was written; this is a last resort
        return parse_duration(AdminSettings().debug_retention)


def kept_event(job: FollowedJob, ended_at: datetime, settings: AdminSettings) -> DebugEnvironmentKept | None:
    """What to record when a debug-terminal job fails or expires (nothing if it never ran)."""
    if not job.debug_terminal or not job.placement:
        return None
    until = ended_at + timedelta(seconds=retention_seconds(job, settings))
    return DebugEnvironmentKept(job_id=job.job_id, attempt=job.attempt, nodes=job.nodes, until=until)


async def release(nc: Client, job_id: str, nodes: Iterable[str]) -> set[str]:
    """Ask every node's agent to remove the job's kept workspaces; the nodes that confirmed."""
    async def one(node: str) -> str | None:
        try:
            reply = await call(nc, subjects.agent_release(node), ReleaseWorkspaces(job_id=job_id),
                               timeout=AGENT_TIMEOUT_SECONDS, reply_type=Released | CommandError)
        except (ServiceUnavailable, NatsError) as exc:  # no answer, or the connection is closing
            log.warning("debug.release_unanswered", job_id=job_id, node=node, error=str(exc))
            return None
        if isinstance(reply, CommandError):
            log.warning("debug.release_refused", job_id=job_id, node=node, error=reply.message)
            return None
        log.info("debug.released", job_id=job_id, node=node, removed=reply.removed)
        return node
    return {n for n in await asyncio.gather(*(one(node) for node in dict.fromkeys(nodes))) if n}


class Retention:
    """Releases kept environments whose time is over, and workspaces nobody needs any more."""

    def __init__(self, monitor: Monitor) -> None:
        self.m = monitor
        self.wake = asyncio.Event()
        self._retry_at: dict[str, datetime] = {}  # job id -> when to ask unanswered nodes again
        self._queue: asyncio.Queue[tuple[str, list[str]]] = asyncio.Queue()

    def release_soon(self, job_id: str, nodes: Iterable[str]) -> None:
        """Release now, in the background (see `run_releases`)."""
        wanted = list(nodes)
        if wanted:
            self._queue.put_nowait((job_id, wanted))

    async def run_releases(self, attempts: int = 3) -> None:
        """Release what `release_soon` asked for, each job on its own, retried a few times (an agent may
        be restarting); the releases in flight end with the service."""
        tasks: set[asyncio.Task[None]] = set()

        async def release_with_retries(job_id: str, nodes: list[str]) -> None:
            left = set(nodes)
            for attempt in range(attempts):
                if attempt:
                    await asyncio.sleep(2.0 ** attempt)
                left -= await release(self.m.rt.nc, job_id, left)
                if not left:
                    return
            log.warning("debug.release_given_up", job_id=job_id, nodes=sorted(left))

        try:
            while True:
                job_id, nodes = await self._queue.get()
                task = asyncio.create_task(release_with_retries(job_id, nodes), name=f"monitor.release.{job_id}")
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            for task in tasks:
                task.cancel()

    async def run(self) -> None:
        await self.m.caught_up()
        while True:
            self.wake.clear()
            for kept in self._due(datetime.now(UTC)):
                await self._release(kept)
            with contextlib.suppress(TimeoutError):  # (asyncio.timeout: see Mailer.run)
                async with asyncio.timeout(self._seconds_to_next(datetime.now(UTC))):
                    await self.wake.wait()

    def _due(self, now: datetime) -> list[KeptEnvironment]:
        return [k for k in self.m.state.kept.values()
                if not k.released and k.until <= now and self._retry_at.get(k.job_id, now) <= now]

    def _seconds_to_next(self, now: datetime) -> float:
        times = [self._retry_at.get(k.job_id, k.until) for k in self.m.state.kept.values() if not k.released]
        return max(0.05, min([CHECK_SECONDS, *((t - now).total_seconds() for t in times)]))

    async def _release(self, kept: KeptEnvironment) -> None:
        with span_tracer.start_as_current_span("monitor release", context=context_from_headers(kept.trace)):
            nodes = self._reachable(kept.nodes)
            confirmed = await release(self.m.rt.nc, kept.job_id, nodes)
            if set(nodes) - confirmed:
                self._retry_at[kept.job_id] = datetime.now(UTC) + timedelta(seconds=RETRY_SECONDS)
                return
            self._retry_at.pop(kept.job_id, None)
            async with self.m.lock:
                if not kept.released:
                    await self.m.record_job(kept.job_id, [DebugEnvironmentReleased(job_id=kept.job_id,
                                                                                   attempt=kept.attempt)])

    def _reachable(self, nodes: list[str]) -> list[str]:
        """Nodes whose agents can answer; a lost or unknown node is passed over (and logged)."""
        reachable = []
        for name in nodes:
            node = self.m.state.nodes.get(name)
            if node is None or node.lost:
                log.warning("debug.release_skipped", node=name, reason="the node is lost or unknown")
            else:
                reachable.append(name)
        return reachable
