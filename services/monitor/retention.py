"""Debug environments (J15): kept after an abnormal end for the retention time, then released.

Agents keep the workspaces of a job with the debug terminal on after its processes end. When the job
fails or expires the monitor records DebugEnvironmentKept (its last placement's nodes, until the end
plus the retention: the spec's, else the administrator's `debug_retention`); once that time is past,
it asks each node's agent to remove them and records DebugEnvironmentReleased. A job that ends any
other way keeps nothing: its workspaces are released at once. What is kept, and when, is decided in
`rules`; this module does the asking.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import UTC, datetime, timedelta

from nats.aio.client import Client
from nats.errors import Error as NatsError

from libs.contracts import subjects
from libs.contracts.agent import Released, ReleaseWorkspaces
from libs.contracts.operations.base import CommandError
from libs.controlsign import ControlSigner
from libs.messaging.rpc import ServiceUnavailable, call
from libs.telemetry.logs import get_logger
from libs.telemetry.tracing import context_from_headers, current_trace_headers, send_span, span_failed, tracer
from services.monitor.kept import KeptEnvironment
from services.monitor.state import MonitoredNode

log = get_logger(__name__)
span_tracer = tracer("trainyard.monitor")
AGENT_TIMEOUT_SECONDS = 10.0
RETRY_SECONDS = 30.0
CHECK_SECONDS = 5.0


async def release(nc: Client, signer: ControlSigner, job_id: str, nodes: Iterable[str]) -> set[str]:
    """Ask every node's agent to remove the job's kept workspaces; the nodes that confirmed."""
    async def one(node: str) -> str | None:
        with send_span(span_tracer, subjects.agent_release, node, job_id=job_id) as span:
            try:
                reply = await call(nc, subjects.agent_release(node), ReleaseWorkspaces(job_id=job_id),
                                   timeout=AGENT_TIMEOUT_SECONDS, reply_type=Released | CommandError, signer=signer)
            except (ServiceUnavailable, NatsError) as exc:  # no answer, or the connection is closing
                log.warning("debug.release_unanswered", job_id=job_id, node=node, error=str(exc))
                span_failed(span, "unavailable", str(exc)[:200])
                return None
            if isinstance(reply, CommandError):
                log.warning("debug.release_refused", job_id=job_id, node=node, error=reply.message)
                span_failed(span, reply.code, reply.message[:200])
                return None
            log.info("debug.released", job_id=job_id, node=node, removed=reply.removed)
            return node
    return {n for n in await asyncio.gather(*(one(node) for node in dict.fromkeys(nodes))) if n}


class Retention:
    """Releases kept environments whose time is over, and workspaces nobody needs any more.

    It reads the monitor's state (`kept`: the environments not released yet, so that its walks cost what is
    kept now, not every environment ever kept; `nodes`: read only), starts once `caught_up` returns, and has
    the monitor record each environment it released through `released`.
    """

    def __init__(self, nc: Client, signer: ControlSigner, kept: Mapping[str, KeptEnvironment],
                 nodes: Mapping[str, MonitoredNode],
                 caught_up: Callable[[], Awaitable[None]],
                 released: Callable[[KeptEnvironment], Awaitable[None]]) -> None:
        self.nc = nc
        self.signer = signer
        self.kept = kept
        self.nodes = nodes
        self.caught_up = caught_up
        self.released = released
        self.wake = asyncio.Event()
        self._retry_at: dict[str, datetime] = {}  # job id -> when to ask unanswered nodes again
        # job id, nodes, and the trace of what decided the release
        self._queue: asyncio.Queue[tuple[str, list[str], dict[str, str]]] = asyncio.Queue()

    def forget(self, job_id: str) -> None:
        """The job was archived: no retry of its release is due any more."""
        self._retry_at.pop(job_id, None)

    def release_soon(self, job_id: str, nodes: Iterable[str]) -> None:
        """Release now, in the background (see `run_releases`), in the trace of the caller's span."""
        wanted = list(nodes)
        if wanted:
            self._queue.put_nowait((job_id, wanted, current_trace_headers()))

    async def run_releases(self, attempts: int = 3) -> None:
        """Release what `release_soon` asked for, each job on its own, retried a few times (an agent may
        be restarting); the releases in flight end with the service."""
        tasks: set[asyncio.Task[None]] = set()

        async def release_with_retries(job_id: str, nodes: list[str], trace: dict[str, str]) -> None:
            left = set(nodes)
            for attempt in range(attempts):
                if attempt:
                    await asyncio.sleep(2.0 ** attempt)
                with span_tracer.start_as_current_span("monitor release", context=context_from_headers(trace),
                                                       attributes={"trainyard.job.id": job_id}):
                    left -= await release(self.nc, self.signer, job_id, left)
                if not left:
                    return
            log.warning("debug.release_given_up", job_id=job_id, nodes=sorted(left))

        try:
            while True:
                job_id, nodes, trace = await self._queue.get()
                task = asyncio.create_task(release_with_retries(job_id, nodes, trace),
                                           name=f"monitor.release.{job_id}")
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            for task in tasks:
                task.cancel()

    async def run(self) -> None:
        await self.caught_up()
        while True:
            self.wake.clear()
            for kept in self._due(datetime.now(UTC)):
                await self._release(kept)
            with contextlib.suppress(TimeoutError):  # (asyncio.timeout: see Mailer.run)
                async with asyncio.timeout(self._seconds_to_next(datetime.now(UTC))):
                    await self.wake.wait()

    def _due(self, now: datetime) -> list[KeptEnvironment]:
        return [k for k in self.kept.values()
                if not k.released and k.until <= now and self._retry_at.get(k.job_id, now) <= now]

    def _seconds_to_next(self, now: datetime) -> float:
        times = [self._retry_at.get(k.job_id, k.until) for k in self.kept.values() if not k.released]
        return max(0.05, min([CHECK_SECONDS, *((t - now).total_seconds() for t in times)]))

    async def _release(self, kept: KeptEnvironment) -> None:
        with span_tracer.start_as_current_span("monitor release", context=context_from_headers(kept.trace),
                                               attributes={"trainyard.job.id": kept.job_id}):
            nodes = self._reachable(kept.nodes)
            confirmed = await release(self.nc, self.signer, kept.job_id, nodes)
            if set(nodes) - confirmed:
                self._retry_at[kept.job_id] = datetime.now(UTC) + timedelta(seconds=RETRY_SECONDS)
                return
            self._retry_at.pop(kept.job_id, None)
            await self.released(kept)

    def _reachable(self, nodes: list[str]) -> list[str]:
        """Nodes whose agents can answer; a lost or unknown node is passed over (and logged)."""
        reachable = []
        for name in nodes:
            node = self.nodes.get(name)
            if node is None or node.lost:
                log.warning("debug.release_skipped", node=name, reason="the node is lost or unknown")
            else:
                reachable.append(name)
        return reachable
