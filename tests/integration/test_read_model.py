"""O2 search over the job read model, projected from the scheduler's events in a real PostgreSQL."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest
import pytest_asyncio
from nats.js.client import JetStreamContext

from libs.contracts.cluster import ClusterConfig, Flavor
from libs.contracts.events import (
    Event,
    JobAdmitted,
    JobDeleted,
    JobDurationChanged,
    JobExpired,
    JobFailed,
    JobPriorityChanged,
    JobRequeued,
    JobStopped,
    JobSubmitted,
    JobSucceeded,
    Placement,
    SettingsChanged,
)
from libs.contracts.identity import Identity
from libs.contracts.jobspec import AlgorithmRef, BatchTask, JobSpec, OutputRef
from libs.contracts.operations.jobs import JobSummary, SearchJobs
from libs.contracts.scheduling import AdminSettings
from libs.eventstore import EventStore, NewEvent
from services.scheduler.domain.state import SchedulerState
from services.scheduler.handlers.queries import JobQueries
from services.scheduler.interfaces import Scheduling
from services.scheduler.read_model import MAX_LIMIT, JobSearchProjection
from tests.support.stores import StoreFactory

pytestmark = pytest.mark.asyncio(loop_scope="session")

ADMIN = Identity(user="root", admin=True)
ALICE = Identity(user="alice", projects=["vision"])
BOB = Identity(user="bob", projects=["vision"])
DAVE = Identity(user="dave", projects=["vision"])
ERIN = Identity(user="erin", projects=["nlp"])  # shares carol's project, created nothing
FRANK = Identity(user="frank", projects=["audio"])  # a project with no jobs

# The jobs of `populate`, oldest first.
RESNET, SWEEP, BATCH, NLP, GONE = ("job-00000000000a", "job-00000000000b", "job-00000000000c",
                                   "job-00000000000d", "job-00000000000e")
LATER = "job-00000000000f"  # submitted after them, where a test needs one more


class Log:
    """Appends job events to the store, keeping each job's version."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.versions: dict[str, int] = {}

    async def add(self, aggregate_id: str, *events: Event, aggregate_type: str = "job") -> None:
        version = self.versions.get(aggregate_id, 0)
        await self.store.append([NewEvent(aggregate_type, aggregate_id, event) for event in events],
                                expected_versions={(aggregate_type, aggregate_id): version})
        self.versions[aggregate_id] = version + len(events)

    async def submit(self, job_id: str, creator: str, **spec: Any) -> None:
        base = JobSpec(name="train", mode="single-node", flavors=["cpu-1"], algorithm=AlgorithmRef(name="algo"),
                       command="python3 train.py", output=OutputRef(name="out"))
        await self.add(job_id, JobSubmitted(job_id=job_id, spec=msgspec.structs.replace(base, **spec),
                                            creator=creator))


def admitted(job_id: str, flavor: str) -> JobAdmitted:
    return JobAdmitted(job_id=job_id, attempt=1, flavor=flavor,
                       placement=[Placement(rank=0, node="n1", address="10.0.0.1", slots=1)])


async def populate(log: Log) -> None:
    """Five jobs of four users in two projects, in every state the filters need."""
    await log.submit(RESNET, "alice", name="ResNet_Train", project="vision", access="read-only",
                     flavors=["gpu-1", "gpu-2"], algorithm=AlgorithmRef(name="resnet"),
                     output=OutputRef(name="out-a"), mode="pytorch", nodes=2)
    await log.add(RESNET, JobDurationChanged(job_id=RESNET, duration="4h", by="alice"))
    await log.add(RESNET, admitted(RESNET, "gpu-2"))

    await log.submit(SWEEP, "alice", name="secret-sweep", project="vision", access="none",
                     algorithm=AlgorithmRef(name="bert", source="favorite", version="v1"),
                     output=OutputRef(name="out-b"))
    await log.add(SWEEP, admitted(SWEEP, "cpu-1"), JobFailed(job_id=SWEEP, reason="exit 1", exit_code=1))

    await log.submit(BATCH, "bob", name="100%_done-batch", project="vision", access="read-write", type="batch",
                     algorithm=None, command=None, output=OutputRef(name="out-a"),
                     tasks=[BatchTask(algorithm=AlgorithmRef(name="prep"), command="python3 prep.py"),
                            BatchTask(algorithm=AlgorithmRef(name="bert", source="favorite", version="v2"),
                                      command="python3 tune.py"),
                            BatchTask(algorithm=AlgorithmRef(name="prep"), command="python3 again.py")])

    await log.add("platform", SettingsChanged(settings=AdminSettings(), by="root"), aggregate_type="settings")

    await log.submit(NLP, "carol", name="resnet-for-text", project="nlp", access="read-write",
                     flavors=["gpu-1"], algorithm=AlgorithmRef(name="resnet"), output=OutputRef(name="out-c"))
    await log.add(NLP, admitted(NLP, "gpu-1"), JobSucceeded(job_id=NLP))

    await log.submit(GONE, "dave", name="resnet-deleted", project="vision", access="read-write",
                     algorithm=AlgorithmRef(name="resnet"), output=OutputRef(name="out-a"))
    await log.add(GONE, JobStopped(job_id=GONE, by="dave"), JobDeleted(job_id=GONE, by="dave"))


@pytest_asyncio.fixture(loop_scope="session")
async def store(make_store: StoreFactory) -> EventStore:
    # Every test gets its own database, so the real schema name isolates nothing it should not.
    return await make_store("scheduler")


@pytest_asyncio.fixture(loop_scope="session")
async def log(store: EventStore) -> Log:
    return Log(store)


async def projection_of(store: EventStore, *, batch_size: int = 500) -> JobSearchProjection:
    projection = JobSearchProjection(store, batch_size=batch_size)
    await projection.migrate()
    return projection


async def ids(projection: JobSearchProjection, identity: Identity = ADMIN, *, sharing: bool = True,
              **filters: Any) -> list[str]:
    found = await projection.search(SearchJobs(**filters), identity, sharing_enabled=sharing)
    return [job.job_id for job in found.jobs]


async def total(projection: JobSearchProjection, identity: Identity = ADMIN, **filters: Any) -> int | None:
    return (await projection.search(SearchJobs(**filters), identity, sharing_enabled=True)).total


async def event_count(store: EventStore) -> int:
    return int(await store.pool.fetchval(f"SELECT count(*) FROM {store.schema}.events"))


async def table(projection: JobSearchProjection) -> list[dict[str, Any]]:
    rows = await projection.pool.fetch(f"SELECT * FROM {projection.schema}.job_search ORDER BY job_id")
    return [dict(row) for row in rows]


# --- filters ---------------------------------------------------------------------------------------


async def test_each_filter_matches_only_its_jobs(store: EventStore, log: Log) -> None:
    await populate(log)
    projection = await projection_of(store)
    await projection.catch_up()

    assert await ids(projection) == [NLP, BATCH, SWEEP, RESNET]  # newest first, the deleted job left out
    # Name: a case-insensitive part; LIKE wildcards in it are literal.
    assert await ids(projection, name="RESNET") == [NLP, RESNET]
    assert await ids(projection, name="%") == [BATCH]
    assert await ids(projection, name="_") == [BATCH, RESNET]
    assert await ids(projection, name="sweep") == [SWEEP]
    # Status after admission, failure, success, and still queued; several statuses are any of.
    assert await ids(projection, statuses=["running"]) == [RESNET]
    assert await ids(projection, statuses=["failed"]) == [SWEEP]
    assert await ids(projection, statuses=["queued"]) == [BATCH]
    assert await ids(projection, statuses=["succeeded", "running"]) == [NLP, RESNET]
    assert await ids(projection, statuses=["stopped"]) == []  # only the deleted job was stopped
    assert await ids(projection, creator="alice") == [SWEEP, RESNET]
    assert await ids(projection, creator="ali") == []
    # Own and favourite algorithms are separate filters; a batch job's task algorithms count.
    assert await ids(projection, algorithm="resnet") == [NLP, RESNET]
    assert await ids(projection, algorithm="prep") == [BATCH]
    assert await ids(projection, algorithm="bert") == []
    assert await ids(projection, favorite_algorithm="bert") == [BATCH, SWEEP]
    assert await ids(projection, favorite_algorithm="resnet") == []
    assert await ids(projection, flavor="gpu-2") == [RESNET]
    assert await ids(projection, flavor="cpu-1") == [BATCH, SWEEP]
    assert await ids(projection, output="out-a") == [BATCH, RESNET]
    assert await ids(projection, project="nlp") == [NLP]
    # Every filter given must match.
    assert await ids(projection, creator="alice", statuses=["running"], flavor="gpu-1") == [RESNET]
    assert await ids(projection, creator="alice", output="out-c") == []
    assert await ids(projection, limit=2) == [NLP, BATCH]


async def test_summaries_carry_what_the_events_said(store: EventStore, log: Log) -> None:
    await populate(log)
    projection = await projection_of(store)
    await projection.catch_up()
    jobs = {job.job_id: job for job in (await projection.search(SearchJobs(), ADMIN, sharing_enabled=True)).jobs}

    resnet = jobs[RESNET]
    assert (resnet.name, resnet.project, resnet.creator, resnet.status) == ("ResNet_Train", "vision", "alice",
                                                                           "running")
    assert (resnet.flavors, resnet.flavor, resnet.mode, resnet.priority) == (["gpu-1", "gpu-2"], "gpu-2",
                                                                            "pytorch", "normal")
    assert (resnet.algorithm, resnet.algorithm_source, resnet.output) == ("resnet", "private", "out-a")
    assert resnet.ended_at is None
    assert jobs[SWEEP].status == "failed" and jobs[SWEEP].ended_at is not None
    assert (jobs[SWEEP].algorithm, jobs[SWEEP].algorithm_source) == ("bert", "favorite")
    assert (jobs[BATCH].status, jobs[BATCH].flavor, jobs[BATCH].algorithm) == ("queued", None, "prep")
    assert jobs[NLP].submitted_at > jobs[SWEEP].submitted_at
    assert (resnet.nodes, jobs[SWEEP].nodes, jobs[BATCH].nodes) == (2, 1, 1)
    assert all(job.master is None for job in jobs.values())  # where a job runs is the live state's to tell


async def test_later_events_update_rows(store: EventStore, log: Log) -> None:
    await populate(log)
    projection = await projection_of(store)
    await projection.catch_up()

    await log.add(BATCH, JobPriorityChanged(job_id=BATCH, priority="urgent", by="bob"))
    await log.add(RESNET, JobExpired(job_id=RESNET, reason="past its duration"))
    assert await projection.catch_up() == 2

    jobs = {job.job_id: job for job in (await projection.search(SearchJobs(), ADMIN, sharing_enabled=True)).jobs}
    assert jobs[BATCH].priority == "urgent"
    assert jobs[RESNET].status == "expired" and jobs[RESNET].ended_at is not None
    assert await ids(projection, statuses=["expired"]) == [RESNET]


async def test_a_job_moved_after_a_fault_is_queued_again(store: EventStore, log: Log) -> None:
    await populate(log)
    projection = await projection_of(store)
    await projection.catch_up()
    assert RESNET in await ids(projection, statuses=["running"])

    await log.add(RESNET, JobRequeued(job_id=RESNET, attempt=1, reason="node n1 was lost", resumes=1))
    await projection.catch_up()

    assert RESNET in await ids(projection, statuses=["queued"])
    assert RESNET not in await ids(projection, statuses=["running"])


async def test_a_batch_of_interleaved_jobs_leaves_each_row_as_its_last_event_did(store: EventStore, log: Log) -> None:
    """Jobs submitted, admitted, moved and ended in turn, all caught up in one batch: each row ends where its
    own events, in their order, left it."""
    jobs = [f"job-{n:012x}" for n in range(1, 13)]
    for job_id in jobs:
        await log.submit(job_id, "alice")
    for job_id in jobs[:9]:
        await log.add(job_id, admitted(job_id, "cpu-1"))
    for job_id in jobs[:3]:
        await log.add(job_id, JobSucceeded(job_id=job_id))
    for job_id in jobs[3:6]:  # moved after a fault, then admitted again: running, not queued
        await log.add(job_id, JobRequeued(job_id=job_id, attempt=1, reason="node n1 was lost", resumes=1))
    for job_id in jobs[3:6]:
        await log.add(job_id, admitted(job_id, "cpu-2"))
    for job_id in jobs[6:9]:  # moved and left waiting
        await log.add(job_id, JobRequeued(job_id=job_id, attempt=1, reason="node n1 was lost", resumes=1))
    await log.add(jobs[9], JobPriorityChanged(job_id=jobs[9], priority="urgent", by="alice"))
    await log.add(jobs[9], JobStopped(job_id=jobs[9], by="alice"), JobDeleted(job_id=jobs[9], by="alice"))

    projection = await projection_of(store)
    assert await projection.catch_up() == await event_count(store)

    rows = {row["job_id"]: row for row in await table(projection)}
    assert [rows[job_id]["status"] for job_id in jobs] == (["succeeded"] * 3 + ["running"] * 3 + ["queued"] * 3
                                                           + ["stopped", "queued", "queued"])
    assert [rows[job_id]["flavor"] for job_id in jobs[:9]] == ["cpu-1"] * 3 + ["cpu-2"] * 3 + ["cpu-1"] * 3
    assert rows[jobs[9]]["deleted"] and rows[jobs[9]]["priority"] == "urgent"
    assert all(rows[job_id]["ended_at"] is not None for job_id in jobs[:3])
    assert await ids(projection, statuses=["running"]) == sorted(jobs[3:6], reverse=True)


async def test_limit_is_capped(store: EventStore) -> None:
    job_ids = [f"job-{n:012x}" for n in range(MAX_LIMIT + 5)]
    spec = JobSpec(name="many", flavors=["cpu-1"], algorithm=AlgorithmRef(name="algo"), command="python3 a.py",
                   output=OutputRef(name="out"))
    await store.append([NewEvent("job", job_id, JobSubmitted(job_id=job_id, spec=spec, creator="alice"))
                        for job_id in job_ids],
                       expected_versions={("job", job_id): 0 for job_id in job_ids})
    projection = await projection_of(store)
    assert await projection.catch_up() == len(job_ids)
    assert len(await ids(projection, limit=5000)) == MAX_LIMIT
    assert await ids(projection, limit=0) == []


# --- pages ---------------------------------------------------------------------------------------------


def paged_job(n: int) -> str:
    """The id of the `n`th job of `submit_many`. Ids fall as jobs are submitted, so that two recorded in the same
    microsecond (ordered by id) still list newest first."""
    return f"job-{0xffff - n:012x}"


async def submit_many(log: Log, count: int) -> None:
    """`count` jobs, oldest first, one append each: every fifth is bob's, private to him; alice has the others.
    Every other one is named "even-…"."""
    for n in range(count):
        name = f"{'even' if n % 2 == 0 else 'odd'}-{n:03d}"
        await log.submit(paged_job(n), "bob" if n % 5 == 0 else "alice", name=name, project="vision", access="none")


async def every_page(projection: JobSearchProjection, identity: Identity, size: int,
                     **filters: Any) -> tuple[list[list[str]], set[int | None]]:
    """The ids of each page of `size`, from the first until one comes back empty (within 50), and the totals they
    told."""
    pages: list[list[str]] = []
    totals: set[int | None] = set()
    for _ in range(50):
        query = SearchJobs(limit=size, offset=size * len(pages), **filters)
        page = await projection.search(query, identity, sharing_enabled=True)
        totals.add(page.total)
        if not page.jobs:
            return pages, totals
        pages.append([job.job_id for job in page.jobs])
    raise AssertionError(f"pages of {size} never ran out: {[len(page) for page in pages]}")


async def test_pages_cover_every_job_once_newest_first(store: EventStore, log: Log) -> None:
    await submit_many(log, 250)
    projection = await projection_of(store)
    await projection.catch_up()
    newest = [paged_job(n) for n in reversed(range(250))]

    pages, totals = await every_page(projection, ADMIN, 100)
    assert [len(page) for page in pages] == [100, 100, 50]
    assert [job_id for page in pages for job_id in page] == newest
    assert totals == {250}

    # Bob's private jobs are neither on alice's pages nor in her count.
    hers = [paged_job(n) for n in reversed(range(250)) if n % 5]
    pages, totals = await every_page(projection, ALICE, 64)
    assert [job_id for page in pages for job_id in page] == hers
    assert totals == {200}

    # Under a filter, the pages and the count are those of the jobs that match.
    even = [paged_job(n) for n in reversed(range(250)) if n % 2 == 0 and n % 5]
    pages, totals = await every_page(projection, ALICE, 30, name="even")
    assert [job_id for page in pages for job_id in page] == even
    assert totals == {len(even)} == {100}
    pages, totals = await every_page(projection, BOB, 7, creator="bob")
    assert [job_id for page in pages for job_id in page] == [paged_job(n) for n in reversed(range(0, 250, 5))]
    assert totals == {50}


# --- who sees what (J2) ----------------------------------------------------------------------------


async def test_visibility_follows_creator_project_access_and_sharing(store: EventStore, log: Log) -> None:
    await populate(log)
    projection = await projection_of(store)
    await projection.catch_up()

    # Sharing on: own jobs, plus the project's jobs whose access is not "none".
    assert await ids(projection, ALICE) == [BATCH, SWEEP, RESNET]
    assert await ids(projection, BOB) == [BATCH, RESNET]  # alice's read-only job; not her "none" one
    assert await ids(projection, ERIN) == [NLP]
    assert await ids(projection, FRANK) == []
    assert await ids(projection, Identity(user="mallory")) == []
    assert await ids(projection, ADMIN) == [NLP, BATCH, SWEEP, RESNET]
    # Filters cannot widen what one may see.
    assert await ids(projection, BOB, creator="alice") == [RESNET]
    assert await ids(projection, FRANK, project="vision") == []
    # The count of all that match follows the same rules: alice's private job is not bob's to count.
    assert [await total(projection, who) for who in (ADMIN, ALICE, BOB, ERIN, FRANK)] == [4, 3, 2, 1, 0]
    assert await total(projection, BOB, creator="alice") == 1
    assert await total(projection, ADMIN, name="resnet") == 2  # the deleted one is not counted
    assert await total(projection, ADMIN, statuses=["queued", "failed"], limit=1) == 2  # whatever the page

    # Sharing off: only own jobs, except for an administrator.
    assert await ids(projection, ALICE, sharing=False) == [SWEEP, RESNET]
    assert await ids(projection, BOB, sharing=False) == [BATCH]
    assert await ids(projection, ERIN, sharing=False) == []
    assert await ids(projection, ADMIN, sharing=False) == [NLP, BATCH, SWEEP, RESNET]


async def test_deleted_jobs_are_never_returned(store: EventStore, log: Log) -> None:
    await populate(log)
    projection = await projection_of(store)
    await projection.catch_up()

    for identity in (ADMIN, DAVE, BOB):
        assert GONE not in await ids(projection, identity)
    assert await ids(projection, DAVE, creator="dave") == []
    assert await ids(projection, name="deleted") == []
    # The row is kept (marked deleted), so a later event for the job does not resurrect it.
    rows = {row["job_id"]: row for row in await table(projection)}
    assert rows[GONE]["deleted"] is True and rows[GONE]["status"] == "stopped"


# --- keeping the read model ------------------------------------------------------------------------


async def test_catch_up_twice_applies_nothing_twice(store: EventStore, log: Log) -> None:
    await populate(log)
    total = await event_count(store)
    projection = await projection_of(store, batch_size=4)

    assert await projection.catch_up() == total
    assert await projection.checkpoint() == await store.last_position()
    before = await table(projection)
    assert await projection.catch_up() == 0
    assert await table(projection) == before

    await log.submit("job-00000000000f", "bob", name="later", project="vision")
    assert await projection.catch_up() == 1
    assert await projection.catch_up() == 0
    assert len(await table(projection)) == len(before) + 1


async def test_concurrent_catch_ups_apply_each_event_once(store: EventStore, log: Log) -> None:
    await populate(log)
    for n in range(40):
        job_id = f"job-1000000000{n:02x}"
        await log.submit(job_id, "bob", name=f"bulk-{n}", project="vision", access="read-only")
        await log.add(job_id, admitted(job_id, "cpu-1"), JobSucceeded(job_id=job_id))
    total = await event_count(store)
    one = await projection_of(store, batch_size=3)
    other = JobSearchProjection(store, batch_size=5)

    counts = await asyncio.gather(one.catch_up(), other.catch_up(), one.catch_up())
    assert sum(counts) == total
    together = await table(one)
    assert len(together) == 45

    await one.rebuild()  # the same events, applied by a single caller
    assert await table(one) == together


async def test_a_failed_batch_leaves_rows_and_checkpoint_as_they_were(
    store: EventStore, log: Log, monkeypatch: pytest.MonkeyPatch,
) -> None:
    await populate(log)
    total = await event_count(store)
    projection = await projection_of(store, batch_size=5)
    statement = projection._statement
    seen: list[int] = []

    def crash_on_seventh(envelope: Any) -> Any:
        seen.append(envelope.position)
        if len(seen) == 7:
            raise RuntimeError("crash")
        return statement(envelope)

    monkeypatch.setattr(projection, "_statement", crash_on_seventh)
    with pytest.raises(RuntimeError):
        await projection.catch_up()
    # The first batch committed; nothing of the second (SWEEP's failure, BATCH's submission) did.
    assert await projection.checkpoint() == seen[4]
    assert {row["job_id"]: row["status"] for row in await table(projection)} == {RESNET: "running",
                                                                                  SWEEP: "running"}

    monkeypatch.setattr(projection, "_statement", statement)
    assert await projection.catch_up() == total - 5
    assert await ids(projection) == [NLP, BATCH, SWEEP, RESNET]


async def test_rebuild_from_scratch_gives_identical_results(store: EventStore, log: Log) -> None:
    await populate(log)
    projection = await projection_of(store, batch_size=2)
    await projection.catch_up()
    queries: list[tuple[Identity, bool, dict[str, Any]]] = [
        (ADMIN, True, {}), (ALICE, True, {}), (BOB, True, {}), (BOB, False, {}), (ERIN, True, {}),
        (ADMIN, True, {"name": "resnet"}), (ADMIN, True, {"favorite_algorithm": "bert"}),
        (ADMIN, True, {"statuses": ["failed", "queued"]}),
    ]
    before = [await projection.search(SearchJobs(**f), who, sharing_enabled=s) for who, s, f in queries]
    rows = await table(projection)

    await projection.rebuild()

    assert [await projection.search(SearchJobs(**f), who, sharing_enabled=s) for who, s, f in queries] == before
    assert await table(projection) == rows
    assert await projection.checkpoint() == await store.last_position()


async def test_projection_created_after_the_events_catches_up_from_the_first(store: EventStore, log: Log) -> None:
    await populate(log)
    await log.add(BATCH, JobPriorityChanged(job_id=BATCH, priority="urgent", by="bob"))
    total = await event_count(store)

    projection = await projection_of(store)  # its table did not exist while the events were written
    assert await projection.checkpoint() == 0
    assert await ids(projection) == []
    assert await projection.catch_up() == total
    assert await ids(projection) == [NLP, BATCH, SWEEP, RESNET]
    bobs = await projection.search(SearchJobs(creator="bob"), ADMIN, sharing_enabled=True)
    assert [job.priority for job in bobs.jobs] == ["urgent"]


async def test_migrate_is_idempotent_and_keeps_the_checkpoint(store: EventStore, log: Log) -> None:
    await populate(log)
    projection = JobSearchProjection(store)
    await asyncio.gather(projection.migrate(), projection.migrate())
    await projection.catch_up()
    checkpoint = await projection.checkpoint()
    await projection.migrate()
    assert await projection.checkpoint() == checkpoint
    assert await projection.catch_up() == 0


async def test_migrate_adds_the_node_count_to_a_table_made_before_it(store: EventStore, log: Log) -> None:
    await populate(log)
    projection = await projection_of(store)
    await projection.catch_up()
    checkpoint = await projection.checkpoint()
    await store.pool.execute(f"ALTER TABLE {store.schema}.job_search DROP COLUMN nodes")  # as the table once was

    await asyncio.gather(projection.migrate(), JobSearchProjection(store).migrate())  # two processes starting

    assert await projection.checkpoint() == checkpoint
    assert {row["job_id"]: row["nodes"] for row in await table(projection)} == dict.fromkeys(
        [RESNET, SWEEP, BATCH, NLP, GONE])
    await log.submit(LATER, "bob", name="later", project="vision", mode="pytorch", nodes=3)
    await projection.catch_up()
    page = await projection.search(SearchJobs(limit=2), ADMIN, sharing_enabled=True)
    assert [(job.job_id, job.nodes) for job in page.jobs] == [(LATER, 3), (NLP, None)]

    await projection.rebuild()  # fills the rows projected before the column
    assert {row["job_id"]: row["nodes"] for row in await table(projection)} == {
        RESNET: 2, SWEEP: 1, BATCH: 1, NLP: 1, GONE: 1, LATER: 3}


# --- the scheduler's answer: a page with what only its live state knows ----------------------------------

CLUSTER = ClusterConfig(flavors=[Flavor(name=name, cpus=4, memory_mib=8192)
                                 for name in ("cpu-1", "cpu-2", "gpu-1", "gpu-2")])


async def state_of(store: EventStore) -> SchedulerState:
    """The scheduler's state folded from the log the projection reads, as far as it goes now."""
    state = SchedulerState(CLUSTER)
    async for envelope in store.read_all():
        state.apply(envelope)
    return state


def answering(projection: JobSearchProjection, state: SchedulerState) -> JobQueries:
    """The scheduler's queries over the projection and a state (no NATS: search reads neither stream)."""
    scheduler = SimpleNamespace(state=state, search=projection)
    return JobQueries(cast(Scheduling, scheduler), store=projection.store, js=cast(JetStreamContext, None))


def by_id(jobs: list[JobSummary]) -> dict[str, JobSummary]:
    return {job.job_id: job for job in jobs}


async def test_a_running_job_shows_the_node_of_its_rank_0(store: EventStore, log: Log) -> None:
    await populate(log)
    # Moved after a fault onto two nodes, its rank 0 listed last.
    await log.add(RESNET, JobRequeued(job_id=RESNET, attempt=1, reason="node n1 was lost", resumes=1),
                  JobAdmitted(job_id=RESNET, attempt=2, flavor="gpu-2",
                              placement=[Placement(rank=1, node="n3", address="10.0.0.3", slots=1),
                                         Placement(rank=0, node="n2", address="10.0.0.2", slots=1)]))
    projection = await projection_of(store)

    page = await answering(projection, await state_of(store)).search(SearchJobs(), ADMIN)
    assert {job.job_id: job.master for job in page.jobs} == {NLP: None, BATCH: None, SWEEP: None, RESNET: "n2"}
    assert page.total == 4
    # Bob's second job of two: the page and the count are his, the node where it runs is shown to him too.
    page = await answering(projection, await state_of(store)).search(SearchJobs(limit=1, offset=1), BOB)
    assert [(job.job_id, job.master) for job in page.jobs] == [(RESNET, "n2")]
    assert page.total == 2

    await log.add(RESNET, JobSucceeded(job_id=RESNET))
    page = await answering(projection, await state_of(store)).search(SearchJobs(), ADMIN)
    assert by_id(page.jobs)[RESNET].status == "succeeded" and by_id(page.jobs)[RESNET].master is None


async def test_rows_without_a_node_count_take_it_from_the_live_state(store: EventStore, log: Log) -> None:
    await populate(log)
    state = await state_of(store)
    # Submitted after the state was folded: a job the state does not hold.
    await log.submit(LATER, "bob", name="later", project="vision", mode="pytorch", nodes=3)
    projection = await projection_of(store)
    queries = answering(projection, state)

    jobs = by_id((await queries.search(SearchJobs(), ADMIN)).jobs)
    assert {job_id: job.nodes for job_id, job in jobs.items()} == {RESNET: 2, SWEEP: 1, BATCH: 1, NLP: 1, LATER: 3}

    await store.pool.execute(f"UPDATE {store.schema}.job_search SET nodes = NULL")  # as projected before the column
    jobs = by_id((await queries.search(SearchJobs(), ADMIN)).jobs)
    assert {job_id: job.nodes for job_id, job in jobs.items()} == {RESNET: 2, SWEEP: 1, BATCH: 1, NLP: 1,
                                                                   LATER: None}
