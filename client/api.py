"""The Python client: everything a user does with Trainyard, over NATS alone (SPEC X6).

    async with TrainyardClient.connect("nats://127.0.0.1:4222") as client:
        accepted = await client.submit(spec)
        job = await client.wait(accepted.job_id)

Refused requests raise `TrainyardError` carrying the service's code, message and hint.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import os
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from libs.contracts import subjects
from libs.contracts.agent import LogChunk, UsageSample
from libs.contracts.codec import decode
from libs.contracts.events import EventEnvelope
from libs.contracts.ids import new_job_id
from libs.contracts.jobspec import JobSpec
from libs.contracts.messages import (
    TERMINAL_STATUSES,
    CommandError,
    DeleteJobs,
    Done,
    GetJob,
    GetQueueStatus,
    JobAccepted,
    JobDetails,
    JobList,
    JobStatus,
    JobView,
    ListJobs,
    ListNodes,
    NodeList,
    NodeView,
    QueueStatus,
    StopJobs,
    SubmitJob,
)
from libs.messaging.connection import connect_once
from libs.messaging.rpc import ServiceUnavailable, call


class TrainyardError(Exception):
    """A request the platform refused."""

    def __init__(self, error: CommandError) -> None:
        self.error = error
        super().__init__(error.message)


def default_nats_url() -> str:
    """NATS_URL, else the URL a local stack started with `make up` wrote, else the NATS default."""
    from libs.devstack.stack import read_stack_env

    return os.environ.get("NATS_URL") or read_stack_env().get("NATS_URL") or "nats://127.0.0.1:4222"


def current_user() -> str:
    return os.environ.get("TRAINYARD_USER") or getpass.getuser()


class TrainyardClient:
    def __init__(self, nc: Client, *, user: str | None = None, timeout: float = 10.0) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.user = user or current_user()
        self.timeout = timeout

    @classmethod
    async def open(cls, nats_url: str | None = None, *, user: str | None = None) -> TrainyardClient:
        url = nats_url or default_nats_url()
        try:
            nc = await connect_once(url, "trainyard-client")
        except Exception as exc:
            reason = str(exc) or type(exc).__name__
            raise ServiceUnavailable(f"cannot connect to NATS at {url} ({reason})") from None
        return cls(nc, user=user)

    @classmethod
    def connect(cls, nats_url: str | None = None, *, user: str | None = None) -> _ClientContext:
        return _ClientContext(nats_url, user)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.drain()

    async def _call(self, subject: str, request: Any, expected: type[Any]) -> Any:
        reply = await call(self.nc, subject, request, timeout=self.timeout)
        if isinstance(reply, CommandError):
            raise TrainyardError(reply)
        if not isinstance(reply, expected):
            raise TypeError(f"unexpected reply {type(reply).__name__} on {subject}")
        return reply

    # --- commands ---------------------------------------------------------------------------------

    async def submit(self, spec: JobSpec, *, job_id: str | None = None) -> JobAccepted:
        """Create a job; passing the same `job_id` again is safe (it is created once)."""
        request = SubmitJob(job_id=job_id or new_job_id(), spec=spec, user=self.user)
        result: JobAccepted = await self._call(subjects.SUBMIT_JOB, request, JobAccepted)
        return result

    async def stop(self, job_ids: list[str]) -> Done:
        result: Done = await self._call(subjects.STOP_JOBS, StopJobs(job_ids=job_ids, user=self.user), Done)
        return result

    async def delete(self, job_ids: list[str]) -> Done:
        result: Done = await self._call(subjects.DELETE_JOBS, DeleteJobs(job_ids=job_ids, user=self.user), Done)
        return result

    # --- queries ----------------------------------------------------------------------------------

    async def list_jobs(self, statuses: list[JobStatus] | None = None, project: str | None = None,
                        limit: int = 200) -> list[JobView]:
        reply: JobList = await self._call(
            subjects.LIST_JOBS, ListJobs(statuses=statuses or [], project=project, limit=limit), JobList)
        return reply.jobs

    async def get_job(self, job_id: str) -> JobDetails:
        result: JobDetails = await self._call(subjects.GET_JOB, GetJob(job_id=job_id), JobDetails)
        return result

    async def nodes(self) -> list[NodeView]:
        reply: NodeList = await self._call(subjects.LIST_NODES, ListNodes(), NodeList)
        return reply.nodes

    async def queue_status(self) -> QueueStatus:
        result: QueueStatus = await self._call(subjects.QUEUE_STATUS, GetQueueStatus(), QueueStatus)
        return result

    async def wait(self, job_id: str, *, poll_seconds: float = 0.5,
                   on_change: Callable[[JobView], None] | None = None, timeout: float | None = None) -> JobView:
        """Wait until the job ends; `on_change` sees every status it passes through."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout else None
        last: tuple[str, int] | None = None
        while True:
            job = (await self.get_job(job_id)).job
            state = (job.status, sum(1 for i in job.instances if i.state == "running"))
            if on_change and state != last:
                on_change(job)
            last = state
            if job.status in TERMINAL_STATUSES:
                return job
            if deadline is not None and loop.time() > deadline:
                raise TimeoutError(f"job {job_id} is still {job.status} after {timeout:g}s")
            await asyncio.sleep(poll_seconds)

    async def usage(self, job_id: str) -> list[UsageSample]:
        """The latest resource usage of each node of the job that reported any (L9), by rank."""
        kv = await self.js.key_value(subjects.USAGE_BUCKET)
        watcher = await kv.watch(f"{job_id}.>")
        samples: list[UsageSample] = []
        try:
            while (entry := await watcher.updates(timeout=5)) is not None:  # type: ignore[no-untyped-call]
                if entry.value:
                    samples.append(decode(entry.value, UsageSample))
        finally:
            await watcher.stop()  # type: ignore[no-untyped-call]
        latest = max((s.attempt for s in samples), default=0)
        return sorted((s for s in samples if s.attempt == latest), key=lambda s: s.rank)

    # --- streams: events and logs -------------------------------------------------------------------

    async def events(self, job_id: str) -> list[EventEnvelope]:
        """The job's full history across services, in the order it was published (O6)."""
        messages = [m async for m in self._read(subjects.EVENTS_STREAM, subjects.events_of_job(job_id),
                                                  follow=None)]
        return [decode(m.data, EventEnvelope) for m in messages]

    async def logs(self, job_id: str, rank: int | None = None, *, follow: bool = False) -> AsyncIterator[LogChunk]:
        """Log chunks of every node (or one rank); with `follow`, until the job has ended."""
        subject = subjects.job_logs(job_id, "*" if rank is None else rank)
        until = self._until_ended(job_id) if follow else None
        async for msg in self._read(subjects.LOGS_STREAM, subject, follow=until):
            yield decode(msg.data, LogChunk)

    async def _until_ended(self, job_id: str) -> None:
        # Poll the status; a short drain after the end lets the last chunks arrive.
        while (await self.get_job(job_id)).job.status not in TERMINAL_STATUSES:
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)

    async def _read(self, stream: str, subject: str, *, follow: Any) -> AsyncIterator[Msg]:
        """Read `subject` from the start of `stream`; stop at its end, or when `follow` completes."""
        queue: asyncio.Queue[Msg] = asyncio.Queue()

        async def on_message(msg: Msg) -> None:
            await queue.put(msg)

        sub = await self.js.subscribe(subject, stream=stream, ordered_consumer=True,
                                      deliver_policy=DeliverPolicy.ALL, cb=on_message)
        stopper = asyncio.ensure_future(follow) if follow is not None else None
        try:
            info = await sub.consumer_info()
            if stopper is None and not info.num_pending and not (info.delivered and info.delivered.consumer_seq):
                return
            while True:
                getter = asyncio.ensure_future(queue.get())
                waiting: set[asyncio.Future[Any]] = {getter}
                if stopper is not None:
                    waiting.add(stopper)
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    while not queue.empty():
                        yield queue.get_nowait()
                    return
                msg = getter.result()
                yield msg
                if stopper is None and not msg.metadata.num_pending:
                    return
        finally:
            if stopper is not None:
                stopper.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


class _ClientContext:
    def __init__(self, nats_url: str | None, user: str | None) -> None:
        self.nats_url = nats_url
        self.user = user
        self.client: TrainyardClient | None = None

    async def __aenter__(self) -> TrainyardClient:
        self.client = await TrainyardClient.open(self.nats_url, user=self.user)
        return self.client

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self.client is not None:
            await self.client.close()
