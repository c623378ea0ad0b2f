"""Permissions (J2), priorities and caps (S2, S3), durations (S11), clone (O1), dev environments (O4),
history (O6), search (O2), settings and prediction (S6), through the client on real NATS and PostgreSQL.

No node agents run here, so every job stays queued: what is checked is who may do what, and what
each command records.
"""

from __future__ import annotations

from typing import Any

import pytest

from client.api import TrainyardClient
from libs.contracts.operations.jobs import SEARCH_JOBS, JobView, SearchJobs
from tests.support.schedulers import Login, refused, spec
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_requests_without_a_valid_token_are_refused(login: Login, nats_url: str) -> None:
    await login("alice")
    anonymous = await TrainyardClient.open(nats_url, token="")
    forged = await TrainyardClient.open(nats_url, token="not.a.token")
    try:
        assert (await refused(anonymous.list_jobs())).error.code == "unauthenticated"
        assert (await refused(forged.submit(spec()))).error.code == "unauthenticated"
    finally:
        await anonymous.close()
        await forged.close()


async def test_the_caller_is_the_token_not_the_request(login: Login) -> None:
    alice = await login("alice")
    job = await alice.submit(spec())
    assert (await alice.get_job(job.job_id)).job.creator == "alice"
    assert (await alice.whoami()).user == "alice"


async def test_submitting_into_a_project_needs_membership(login: Login) -> None:
    alice = await login("alice", "vision")
    error = await refused(alice.submit(spec(project="nlp")))
    assert error.error.code == "forbidden"
    assert "nlp" in error.error.message
    assert await alice.list_jobs() == []


async def test_sharing_follows_the_operation_matrix(login: Login) -> None:
    alice = await login("alice", "vision")
    bob = await login("bob", "vision")
    carol = await login("carol", "nlp")
    admin = await login("root", admin=True)
    shared_ro = (await alice.submit(spec("ro", project="vision", access="read-only"))).job_id
    shared_rw = (await alice.submit(spec("rw", project="vision", access="read-write"))).job_id
    private = (await alice.submit(spec("private", project="vision"))).job_id

    assert {j.job_id for j in await bob.list_jobs()} == {shared_ro, shared_rw}
    assert await carol.list_jobs() == []
    assert (await refused(carol.get_job(shared_ro))).error.code == "not-found"
    assert (await refused(bob.get_job(private))).error.code == "not-found"

    # read-only: view, clone, dev environment; not stop, priority, duration, delete.
    await bob.get_job(shared_ro)
    await bob.devenv(shared_ro)
    clone = await bob.clone(shared_ro, {"name": "bobs-copy"})
    assert (await bob.get_job(clone.job_id)).job.creator == "bob"
    for forbidden in (bob.stop([shared_ro]), bob.change_priority(shared_ro, "urgent"),
                      bob.change_duration(shared_ro, "1h")):
        assert (await refused(forbidden)).error.code == "forbidden"
    # One refused job refuses the whole request: nothing was stopped.
    assert (await refused(bob.stop([shared_rw, shared_ro]))).error.code == "forbidden"
    assert (await alice.get_job(shared_rw)).job.status == "queued"

    # read-write: every operation.
    await bob.change_duration(shared_rw, "2h")
    await bob.stop([shared_rw])
    await bob.delete([shared_rw])

    # The administrator switch turns sharing off for everyone but creators and administrators.
    await admin.change_settings(sharing_enabled=False)
    assert {j.job_id for j in await bob.list_jobs()} == {clone.job_id}
    assert (await refused(bob.get_job(shared_ro))).error.code == "not-found"
    assert {j.job_id for j in await admin.list_jobs()} >= {shared_ro, private, clone.job_id}
    assert (await alice.get_job(shared_ro)).job.access == "none"


async def test_only_administrators_change_settings_or_set_very_urgent(login: Login) -> None:
    alice = await login("alice")
    admin = await login("root", admin=True)
    assert (await refused(alice.change_settings(urgent_cap=100))).error.code == "forbidden"
    assert (await refused(alice.submit(spec(priority="very-urgent")))).error.code == "forbidden"
    job = (await alice.submit(spec())).job_id
    assert (await refused(alice.change_priority(job, "very-urgent"))).error.code == "forbidden"
    await admin.change_priority(job, "very-urgent")
    assert (await alice.get_job(job)).job.priority == "very-urgent"
    assert (await admin.change_settings(urgent_cap=1)).urgent_cap == 1
    assert (await alice.settings()).urgent_cap == 1


async def test_urgent_jobs_are_capped_per_user_and_project(login: Login) -> None:
    alice = await login("alice", "default", "vision")
    admin = await login("root", admin=True)
    await admin.change_settings(urgent_cap=2)
    first = (await alice.submit(spec("u1", priority="urgent"))).job_id
    await alice.submit(spec("u2", priority="urgent"))
    error = await refused(alice.submit(spec("u3", priority="urgent")))
    assert error.error.code == "over-cap"
    assert "cap is 2" in error.error.message
    # Another project has its own count; a normal job is never capped.
    await alice.submit(spec("v1", project="vision", priority="urgent"))
    normal = (await alice.submit(spec("n1"))).job_id
    # Raising past the cap fails with the same error; lowering one frees a place.
    assert (await refused(alice.change_priority(normal, "urgent"))).error.code == "over-cap"
    await alice.change_priority(first, "normal")
    await alice.change_priority(normal, "urgent")
    assert (await alice.get_job(normal)).job.priority == "urgent"


async def test_priority_changes_reorder_the_queue_and_only_while_queued(login: Login) -> None:
    alice = await login("alice")
    a = (await alice.submit(spec("a"))).job_id
    b = (await alice.submit(spec("b"))).job_id
    assert (await alice.get_job(b)).job.queue_position == 2
    await alice.change_priority(b, "urgent")
    assert (await alice.get_job(b)).job.queue_position == 1
    await alice.change_priority(b, "normal")  # back to normal: FIFO by submission again
    assert (await alice.get_job(a)).job.queue_position == 1
    await alice.stop([a])
    error = await refused(alice.change_priority(a, "urgent"))
    assert error.error.code == "invalid-state"
    assert "stopped" in error.error.message


async def test_duration_changes_are_checked_and_recorded(login: Login) -> None:
    alice = await login("alice")
    job = (await alice.submit(spec(duration="1h"))).job_id
    assert (await refused(alice.change_duration(job, "soon"))).error.code == "invalid-request"
    await alice.change_duration(job, "3h")
    assert (await alice.get_job(job)).job.duration == "3h"
    await alice.change_duration(job, None)
    assert (await alice.get_job(job)).job.duration is None
    names = [type(e.event).name() for e in await alice.history(job)]
    assert names.count("JobDurationChanged") == 2


async def test_clone_applies_overrides_and_refuses_bad_ones(login: Login) -> None:
    alice = await login("alice")
    source = (await alice.submit(spec("orig", duration="1h"))).job_id
    copy = await alice.clone(source, {"name": "copy", "duration": "2h"})
    details = await alice.get_job(copy.job_id)
    assert (details.spec.name, details.spec.duration, details.job.cloned_from) == ("copy", "2h", source)
    assert details.spec.command == (await alice.get_job(source)).spec.command
    error = await refused(alice.clone(source, {"nodez": 2}))
    assert (error.error.code, error.error.errors[0].field) == ("invalid-spec", "nodez")
    error = await refused(alice.clone(source, {"nodes": 0}))
    assert error.error.code == "invalid-spec"

    # a dotted path sets one entry of a field and keeps the others
    with_env = (await alice.submit(spec("env", env={"A": "1"}))).job_id
    nested = await alice.clone(with_env, {"env.B": "2", "fault_restart.max_restarts": 5})
    cloned = (await alice.get_job(nested.job_id)).spec
    assert cloned.env == {"A": "1", "B": "2"}
    assert cloned.fault_restart is not None and cloned.fault_restart.max_restarts == 5
    error = await refused(alice.clone(with_env, {"fault_restart.max_restartz": 1}))
    assert (error.error.code, error.error.errors[0].field) == ("invalid-spec", "fault_restart.max_restartz")
    error = await refused(alice.clone(with_env, {"nodes.count": 1}))
    assert (error.error.code, error.error.errors[0].field) == ("invalid-spec", "nodes.count")
    assert len(await alice.list_jobs()) == 4


async def test_devenv_mirrors_the_jobs_workspace(login: Login) -> None:
    alice = await login("alice")
    job = (await alice.submit(spec("dev", env={"SEED": "1"}))).job_id
    devenv = await alice.devenv(job)
    assert (devenv.source_job_id, devenv.flavor, devenv.env) == (job, "cpu-1", {"SEED": "1"})
    assert {m.target for m in devenv.mounts} == {"algorithm", "outputs"}


async def test_every_submission_records_its_prediction(login: Login) -> None:
    alice = await login("alice")
    prediction = await alice.predict(spec())
    assert not prediction.starts_now  # no nodes have registered
    job = (await alice.submit(spec())).job_id  # planned once queued, with any other new jobs, a moment later
    view = await eventually(lambda: predicted_view(alice, job))
    assert view.prediction is not None and not view.prediction.starts_now
    assert [type(e.event).name() for e in await alice.history(job)][:2] == ["JobSubmitted", "JobPredicted"]
    asked = await alice.submit(spec(), predict=True)  # or planned before it is queued, and answered
    assert asked.prediction is not None and (await alice.get_job(asked.job_id)).job.prediction == asked.prediction
    report = await alice.why(job)
    assert report.position == 1 and report.summary


async def predicted_view(client: TrainyardClient, job_id: str) -> JobView | None:
    view = (await client.get_job(job_id)).job
    return view if view.prediction is not None else None


async def test_search_serves_filters_and_visibility_from_the_read_model(login: Login) -> None:
    alice = await login("alice", "vision")
    bob = await login("bob", "vision")
    mine = (await alice.submit(spec("resnet-train", project="vision", access="read-only"))).job_id
    await alice.submit(spec("bert", project="vision"))
    assert [j.job_id for j in await alice.search(name="RESNET")] == [mine]
    assert [j.job_id for j in await bob.search(creator="alice")] == [mine]
    assert [j.job_id for j in await alice.search(algorithm="algo", name="resnet")] == [mine]
    await alice.stop([mine])
    assert [j.status for j in await alice.search(name="resnet")] == ["stopped"]
    assert await alice.search(statuses=["running"]) == []


async def test_search_pages_through_the_client_and_refuses_pages_out_of_bounds(login: Login) -> None:
    alice = await login("alice")
    oldest, middle, newest = [(await alice.submit(spec(f"page-{n}"))).job_id for n in range(3)]
    assert [j.job_id for j in await alice.search(name="page", limit=2)] == [newest, middle]
    assert [j.job_id for j in await alice.search(name="page", limit=2, offset=2)] == [oldest]
    assert [j.nodes for j in await alice.search(name="page")] == [1, 1, 1]
    second = await alice.ask(SEARCH_JOBS, SearchJobs(name="page", limit=1, offset=1))  # what the web console reads
    assert ([j.job_id for j in second.jobs], second.total) == ([middle], 3)
    out_of_bounds: list[tuple[str, dict[str, Any]]] = [("offset", {"offset": 1_000_001}), ("offset", {"offset": -1}),
                                                       ("limit", {"limit": 1001}), ("limit", {"limit": 0})]
    for field, page in out_of_bounds:
        error = (await refused(alice.search(**page))).error
        assert (error.code, [e.field for e in error.errors]) == ("invalid-request", [field])
