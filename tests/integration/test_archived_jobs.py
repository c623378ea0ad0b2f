"""Ended jobs leave the scheduler's memory after the administrator's `job_retention` and are still answered for:
`show`, `events`, `logs`, `why`, `search`, `clone` and `delete` work on them as before, for whoever could before and
for nobody else; a job that never existed is still not found; a restarted scheduler does not hold them again.

A scheduler in the test's process on real NATS and PostgreSQL, whose clock the test moves on."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from libs.contracts import subjects
from libs.contracts.codec import encode
from libs.contracts.events import EventEnvelope, JobArchived, JobStopped, PrecheckCompleted
from libs.contracts.ids import new_job_id
from libs.contracts.operations.arrays import ArraySelection
from services.scheduler import service
from services.scheduler.service import utc_now
from tests.support.schedulers import Login, Schedulers, logins, refused, spec
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
def quick_archiving(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(service, "ARCHIVE_PERIOD", 0.1)
    yield


class Later:
    """A clock the test moves on."""

    def __init__(self) -> None:
        self.ahead = timedelta()

    def __call__(self) -> datetime:
        return utc_now() + self.ahead


async def test_an_archived_job_is_answered_for_as_before(quick_archiving: None, nats_url: str,
                                                         schedulers: Schedulers) -> None:
    await schedulers.start()
    clock = Later()
    schedulers.started[-1].clock = clock
    async with logins(nats_url) as login:
        await archived_jobs_answered(login, schedulers, clock)


async def archived_jobs_answered(login: Login, schedulers: Schedulers, clock: Later) -> None:
    alice = await login("alice", "vision")
    admin = await login("root", admin=True)
    short = await refused(admin.change_settings(job_retention="30s"))
    assert short.error.code == "invalid-request" and "shorter than a minute" in short.error.message
    await admin.change_settings(job_retention="1h")
    ended = await alice.submit(spec("old", project="vision"))
    queued = await alice.submit(spec("waiting", project="vision"))
    array = await alice.submit_array(spec("sweep-{index}", project="vision"), indices="0-2")
    await alice.stop([ended.job_id], arrays=[ArraySelection(array_id=array.array_id)])
    before = await alice.get_job(ended.job_id)
    array_before = await alice.get_array(array.array_id)
    assert array_before.array.statuses == {"stopped": 3}
    assert before.job.status == "stopped"
    scheduler = schedulers.started[-1]

    async def archived() -> bool:
        return ended.job_id not in scheduler.state.jobs

    await asyncio.sleep(0.5)
    assert not await archived()  # within its retention
    clock.ahead = timedelta(hours=2)
    await eventually(archived, timeout=20)
    assert queued.job_id in scheduler.state.jobs  # not ended: it stays
    assert array.array_id not in scheduler.state.arrays  # its jobs left together

    # Shown as it was, explained, its history with its archival last, its logs, found by search.
    shown = await alice.get_job(ended.job_id)
    assert shown.job == before.job and shown.spec == before.spec
    assert (await alice.why(ended.job_id)).status == "stopped"
    history = await alice.events(ended.job_id)
    assert isinstance(history[-1].event, JobArchived) and history[-1].event.retention == "1h"
    assert [chunk async for chunk in alice.logs(ended.job_id)] == []
    assert [found.job_id for found in await alice.search(name="old")] == [ended.job_id]
    assert await alice.get_array(array.array_id) == array_before  # the array's page too, read back whole

    # Nobody else sees it; an id that never existed is not found, as ever.
    bob = await login("bob", "other")
    assert (await refused(bob.get_job(ended.job_id))).error.code == "not-found"
    assert (await refused(bob.events(ended.job_id))).error.code == "not-found"
    assert (await refused(bob.get_array(array.array_id))).error.code == "not-found"
    assert (await refused(alice.get_array("array-000000000000"))).error.code == "not-found"
    assert (await refused(alice.get_job("job-000000000000"))).error.code == "not-found"

    # Commands: changing it is refused as for any ended job; stopping it does nothing; it can be cloned, deleted.
    changed = await refused(alice.change_priority(ended.job_id, "urgent"))
    assert changed.error.code == "invalid-state" and "stopped" in changed.error.message
    assert (await alice.stop([ended.job_id])).message == "stopping 0 job(s)"
    clone = await alice.clone(ended.job_id, {"name": "again"})
    assert (await alice.get_job(clone.job_id)).spec.command == before.spec.command
    await alice.delete([ended.job_id])
    assert (await refused(alice.get_job(ended.job_id))).error.code == "not-found"
    assert await alice.search(name="old") == []
    assert (await refused(alice.delete([ended.job_id]))).error.code == "not-found"

    # A scheduler started again rebuilds its state from the log without it.
    await schedulers.stop_all()
    await schedulers.start()
    assert ended.job_id not in schedulers.started[-1].state.jobs
    assert queued.job_id in schedulers.started[-1].state.jobs


async def monitor_says(login: Login, job_id: str, about: str | None = None) -> int:
    """The monitor publishes a pre-check of `job_id` (recorded under the aggregate `about`, the job's by default), as
    its relay would; its stream sequence."""
    envelope = EventEnvelope(event_id=str(uuid.uuid4()), service="monitor", aggregate_type="job",
                             aggregate_id=about or job_id, version=1, position=1, recorded_at=datetime.now(UTC),
                             event=PrecheckCompleted(job_id=job_id, attempt=1, passed=True, nodes=[]))
    api = await login("root", admin=True)
    ack = await api.nc.jetstream().publish(subjects.event_subject("monitor", "job", "PrecheckCompleted"),
                                           encode(envelope), headers={"Nats-Msg-Id": envelope.event_id})
    return ack.seq


async def test_an_archived_jobs_history_keeps_the_other_services_events_and_nothing_else(
        quick_archiving: None, nats_url: str, schedulers: Schedulers) -> None:
    """Subjects name no job: the scheduler notes where the other services' events about a job are stored, writes them
    beside its log when the job is archived, and reads its history back by them, leaving out what is not about the
    job (a stream made anew holds other messages there), after a restart too."""
    await schedulers.start()
    clock = Later()
    scheduler = schedulers.started[-1]
    scheduler.clock = clock
    async with logins(nats_url) as login:
        alice, admin = await login("alice", "vision"), await login("root", admin=True)
        await admin.change_settings(job_retention="1h")
        job, other = (await alice.submit(spec("old", project="vision"))).job_id, new_job_id()

        async def predicted() -> bool:  # the next cycle predicts it; stopped before, it never would be
            return "JobPredicted" in [type(e.event).name() for e in await alice.events(job)]

        await eventually(predicted)
        await alice.stop([job])
        checked = await monitor_says(login, job)
        elsewhere = await monitor_says(login, other)  # about a job that never existed: noted nowhere

        async def shown() -> list[str]:
            names = [type(e.event).name() for e in await alice.events(job)]
            return names if "PrecheckCompleted" in names else []

        assert await eventually(shown) == ["JobSubmitted", "JobPredicted", "JobStopped", "PrecheckCompleted"]
        clock.ahead = timedelta(hours=2)

        async def archived() -> bool:
            return job not in scheduler.state.jobs

        await eventually(archived, timeout=20)
        history = await alice.events(job)
        assert [type(e.event).name() for e in history] == [
            "JobSubmitted", "JobPredicted", "JobStopped", "PrecheckCompleted", "JobArchived"]
        assert await scheduler.published.of(job) == [checked]
        scheduler.published.note(job, [elsewhere])  # as if the stream held another job's event there
        await scheduler.published.write()

        await schedulers.stop_all()
        await schedulers.start()
        again = await alice.events(job)
        assert again == history and all(e.aggregate_id == job for e in again)


async def test_the_events_stream_holds_as_many_subjects_however_many_jobs_pass(
        nats_url: str, schedulers: Schedulers) -> None:
    """JetStream keeps an index entry per subject: event subjects name no job, so jobs do not add to it."""
    await schedulers.start()
    async with logins(nats_url) as login:
        alice = await login("alice", "vision")

        async def subjects_after(jobs: int) -> set[str]:
            accepted = [(await alice.submit(spec(f"pass-{i}", project="vision"))).job_id for i in range(jobs)]
            await alice.stop(accepted)

            async def stopped_published() -> bool:  # the stops are the last the scheduler records
                return any(isinstance(e.event, JobStopped) for e in await alice.events(accepted[-1]))

            await eventually(stopped_published)
            info = await alice.nc.jetstream().stream_info(subjects.EVENTS_STREAM, subjects_filter=">")
            return set(info.state.subjects or {})

        few = await subjects_after(3)
        assert "trainyard.events.scheduler.job.JobSubmitted" in few
        many = await subjects_after(30)
        # The same subjects, and at most a bundle subject of a kind of aggregate more (appends recording more at once).
        kinds = {subject.rsplit(".", 1)[0] for subject in few}
        assert many - few <= {f"{kind}.{subjects.BUNDLE}" for kind in kinds}
