"""J2 in the cluster views: a caller is never told the ids or names of jobs not shared with them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import msgspec
from nats.js.client import JetStreamContext

from libs.contracts.events import JobStopped, SettingsChanged
from libs.contracts.identity import Identity
from libs.contracts.operations.cluster import NodeList, ResourceList
from libs.contracts.operations.jobs import ListJobs
from libs.contracts.operations.planning import WhyReply
from libs.contracts.scheduling import AdminSettings, WhyReport
from libs.eventstore import EventStore
from services.scheduler.domain.views import node_resources, node_views
from services.scheduler.domain.visibility import HIDDEN_JOB, hide_applications, hide_jobs
from services.scheduler.handlers.queries import JobQueries
from services.scheduler.interfaces import Scheduling
from tests.support.scheduler_state import Fold

MINE, SHARED, PRIVATE = "job-00000000000a", "job-00000000000b", "job-00000000000c"
BOB = Identity(user="bob", projects=["default"])


def cluster() -> Fold:
    """alice's jobs: one shared read-only with the project, one not shared; bob's own job."""
    fold = Fold()
    fold.node("gpu-1", "A100", 4)
    fold.job(SHARED, "shared-run", ["a100-1"], access="read-only")
    fold.job(PRIVATE, "secret-run", ["a100-1"])
    fold.job(MINE, "bobs-run", ["a100-1"])
    fold.state.jobs[MINE].creator = "bob"
    for job_id in (SHARED, PRIVATE, MINE):
        fold.admit(job_id, "a100-1", ["gpu-1"])
    return fold


def test_ids_of_hidden_jobs_are_replaced_in_fields_and_sentences() -> None:
    state = cluster().state
    report = WhyReport(job_id=MINE, status="queued", position=3, jobs_ahead=[SHARED, PRIVATE],
                       summary=[f"Waits behind {SHARED} and {PRIVATE}; expected to start when {PRIVATE} ends."])
    shown = hide_jobs(WhyReply(report=report), state, BOB).report
    assert shown.jobs_ahead == [SHARED, HIDDEN_JOB]
    assert shown.summary == [f"Waits behind {SHARED} and {HIDDEN_JOB}; expected to start when {HIDDEN_JOB} ends."]
    nodes = hide_jobs(NodeList(nodes=node_views(state)), state, BOB)
    assert nodes.nodes[0].jobs == [SHARED, HIDDEN_JOB, MINE]
    # alice sees her own jobs, not bob's; an administrator sees the reply as it is.
    assert hide_jobs(WhyReply(report=report), state, Identity(user="alice", projects=["default"])).report == \
        msgspec.structs.replace(report, job_id=HIDDEN_JOB)
    assert hide_jobs(WhyReply(report=report), state, Identity(user="root", projects=[], admin=True)).report == report


def test_switching_sharing_off_hides_shared_jobs_too() -> None:
    fold = cluster()
    fold.apply(SettingsChanged(settings=AdminSettings(sharing_enabled=False), by="root"), aggregate="platform")
    report = WhyReport(job_id=MINE, status="queued", jobs_ahead=[SHARED, PRIVATE])
    assert hide_jobs(WhyReply(report=report), fold.state, BOB).report.jobs_ahead == [HIDDEN_JOB, HIDDEN_JOB]


def test_resources_hide_the_applications_of_hidden_jobs() -> None:
    state = cluster().state
    resources = hide_applications(ResourceList(nodes=node_resources(state, ["a100-1"])), state, BOB)
    assert [str(u) for u in resources.nodes[0].usage] == ["1(1):shared-run", f"1(1):{HIDDEN_JOB}", "1(1):bobs-run"]
    assert "secret-run" not in repr(resources) and PRIVATE not in repr(resources)


async def test_a_listing_of_queued_and_running_jobs_shows_those_the_caller_may_view_newest_first() -> None:
    fold = cluster()
    fold.job("job-00000000000d", "queued-shared", ["a100-4"], access="read-only")
    fold.job("job-00000000000e", "queued-private", ["a100-4"])
    fold.job("job-00000000000f", "ended", ["a100-1"], access="read-only")
    fold.apply(JobStopped(job_id="job-00000000000f", by="alice"), aggregate="job-00000000000f")
    async def no_forecasts(_: object) -> dict[str, object]:
        return {}

    queries = JobQueries(cast(Scheduling, SimpleNamespace(state=fold.state, forecast_queued=no_forecasts)),
                         store=cast(EventStore, None), js=cast(JetStreamContext, None))
    listed = await queries.list_jobs(ListJobs(statuses=["queued", "running"]), BOB)
    assert [(j.job_id, j.status, j.queue_position) for j in listed.jobs] == [
        ("job-00000000000d", "queued", 1), (MINE, "running", None), (SHARED, "running", None)]
    assert [j.job_id for j in (await queries.list_jobs(ListJobs(statuses=["queued", "running"], limit=1),
                                                        BOB)).jobs] == ["job-00000000000d"]
    assert [j.job_id for j in (await queries.list_jobs(ListJobs(statuses=["stopped"]), BOB)).jobs] == [
        "job-00000000000f"]
