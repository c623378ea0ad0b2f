"""The scheduler's commands and queries through the Python client, on real NATS and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime

import msgspec
import pytest

from client.api import TrainyardClient, TrainyardError
from libs.auth import bearer_headers, issue_token
from libs.contracts import subjects
from libs.contracts.codec import encode
from libs.contracts.events import EventEnvelope, JobPredicted, JobSubmitted, PrecheckCompleted
from libs.contracts.identity import Identity
from libs.contracts.jobspec import DatasetRef, ModelRef
from libs.contracts.operations.jobs import LIST_JOBS, SUBMIT_JOB
from libs.contracts.scheduling import Prediction
from tests.support.schedulers import SECRET, Schedulers, spec, token
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_bad_spec_is_refused_with_every_field_named_and_nothing_stored(client: TrainyardClient) -> None:
    with pytest.raises(TrainyardError) as refused:
        await client.submit(spec(command="KEY=1 python3 train.py", flavors=["cpu-1", "no-such-flavor"]))
    error = refused.value.error
    assert error.code == "invalid-spec"
    assert {e.field for e in error.errors} == {"command", "flavors[1]"}
    assert any("bash -c" in (e.hint or "") for e in error.errors)
    assert await client.list_jobs() == []


async def test_inputs_missing_from_storage_are_refused_by_field(client: TrainyardClient) -> None:
    with pytest.raises(TrainyardError) as refused:
        await client.submit(spec(datasets=[DatasetRef(name="imagenet")],
                                 models=[ModelRef(name="resnet", source="pretrained")]))
    error = refused.value.error
    assert error.code == "invalid-spec"
    assert {e.field for e in error.errors} == {"datasets[0]", "models[0]"}
    assert "datasets/imagenet does not exist" in error.message
    assert await client.list_jobs() == []


async def test_unknown_request_fields_are_refused(client: TrainyardClient) -> None:
    payload = {"type": "ListJobs.v1", "statuses": [], "colour": "blue"}
    msg = await client.nc.request(LIST_JOBS.subject, json.dumps(payload).encode(), timeout=30,
                                  headers=bearer_headers(client.token))
    reply = json.loads(msg.data)
    assert reply["type"] == "Error.v1"
    assert reply["code"] == "invalid-request"
    assert "colour" in reply["message"]


async def test_a_spec_error_inside_a_submit_names_the_spec_field(client: TrainyardClient) -> None:
    payload = {"type": "SubmitJob.v1", "job_id": "job-000000000001",
               "spec": {**msgspec.to_builtins(spec()), "nodes": 0}}
    msg = await client.nc.request(SUBMIT_JOB.subject, json.dumps(payload).encode(), timeout=30,
                                  headers=bearer_headers(client.token))
    reply = json.loads(msg.data)
    assert (reply["code"], reply["errors"][0]["field"]) == ("invalid-spec", "nodes")


async def test_submitting_the_same_job_id_twice_creates_one_job(client: TrainyardClient) -> None:
    first = await client.submit(spec(), job_id="job-0123456789ab")
    again = await client.submit(spec(), job_id="job-0123456789ab")
    assert (first.created, again.created) == (True, False)
    assert [j.job_id for j in await client.list_jobs()] == ["job-0123456789ab"]
    # Its prediction is planned once it is queued, and recorded a moment later.
    history = await eventually(lambda: recorded_events(client, "job-0123456789ab", 2))
    assert [type(e.event).name() for e in history] == ["JobSubmitted", "JobPredicted"]

    with pytest.raises(TrainyardError) as refused:
        await client.submit(spec(name="other"), job_id="job-0123456789ab")
    assert refused.value.error.code == "conflict"


async def test_queue_order_follows_priority_then_submission(client: TrainyardClient, nats_url: str) -> None:
    admin = await TrainyardClient.open(nats_url, token=token("root", admin=True))
    normal = await client.submit(spec("normal"))
    urgent = await client.submit(spec("urgent", priority="urgent"))
    very = await admin.submit(spec("very", priority="very-urgent"))
    later_urgent = await client.submit(spec("urgent-2", priority="urgent"))
    positions = {j.job_id: j.queue_position for j in await admin.list_jobs(["queued"])}
    await admin.close()
    assert positions == {very.job_id: 1, urgent.job_id: 2, later_urgent.job_id: 3, normal.job_id: 4}


async def test_stop_and_delete(client: TrainyardClient) -> None:
    job = await client.submit(spec())
    with pytest.raises(TrainyardError) as refused:
        await client.delete([job.job_id])
    assert refused.value.error.code == "invalid-state"
    assert f"trainyard stop {job.job_id}" in (refused.value.error.hint or "")

    await client.stop([job.job_id])
    assert (await client.get_job(job.job_id)).job.status == "stopped"
    await client.stop([job.job_id])  # stopping again changes nothing and is not an error
    await client.delete([job.job_id])
    with pytest.raises(TrainyardError) as gone:
        await client.get_job(job.job_id)
    assert gone.value.error.code == "not-found"

    with pytest.raises(TrainyardError) as unknown:
        await client.stop(["job-ffffffffffff"])
    assert unknown.value.error.code == "not-found"


async def test_state_is_rebuilt_from_the_log_after_a_restart(client: TrainyardClient,
                                                            schedulers: Schedulers) -> None:
    kept = await client.submit(spec("kept", priority="urgent"))
    stopped = await client.submit(spec("stopped"))
    await client.stop([stopped.job_id])
    before = await client.list_jobs()

    await schedulers.stop_all()
    await schedulers.start()
    # (A waiting job's expected start is worked out when asked: as of a later moment after the restart.)
    assert [msgspec.structs.replace(job, expected=None) for job in await client.list_jobs()] == [
        msgspec.structs.replace(job, expected=None) for job in before]
    assert (await client.get_job(kept.job_id)).job.queue_position == 1


async def test_history_holds_the_monitors_events_and_the_submit_records_the_creators_email(
        nats_url: str, schedulers: Schedulers) -> None:
    await schedulers.start()
    identity = Identity(user="alice", projects=["default"], email="alice@example.com")
    api = await TrainyardClient.open(nats_url, token=issue_token(SECRET, identity))
    try:
        job = (await api.submit(spec(), predict=True)).job_id
        # What the monitor publishes about the job (M1): the history shows it beside the scheduler's events.
        envelope = EventEnvelope(event_id=str(uuid.uuid4()), service="monitor", aggregate_type="job",
                                 aggregate_id=job, version=1, position=1, recorded_at=datetime.now(UTC),
                                 event=PrecheckCompleted(job_id=job, attempt=1, passed=False, nodes=[]))
        await api.nc.jetstream().publish(subjects.event_subject("monitor", "job", "PrecheckCompleted"),
                                         encode(envelope), headers={"Nats-Msg-Id": envelope.event_id})
        history = await api.history(job)
        assert [type(e.event).name() for e in history] == ["JobSubmitted", "JobPredicted", "PrecheckCompleted"]
        submitted = history[0].event
        assert isinstance(submitted, JobSubmitted) and submitted.creator_email == "alice@example.com"
    finally:
        await api.close()


async def test_a_submission_asking_for_its_prediction_holds_up_neither_other_commands_nor_its_own_retry(
        client: TrainyardClient, schedulers: Schedulers) -> None:
    other = await client.submit(spec("other"))
    await eventually(lambda: recorded_events(client, other.job_id, 2))  # its own prediction is planned
    gate = schedulers.gate_planning()
    submitting = asyncio.create_task(client.submit(spec("new"), job_id="job-00000000abcd", predict=True))
    retried = asyncio.create_task(client.submit(spec("new"), job_id="job-00000000abcd", predict=True))
    await gate.planning()
    # While the new job is planned, the scheduler answers a command that takes its lock, and a query.
    await client.stop([other.job_id])
    assert (await client.get_job(other.job_id)).job.status == "stopped"
    assert not submitting.done() and not retried.done()
    gate.released.set()
    answers = [await submitting, await retried]
    assert sorted(a.created for a in answers) == [False, True] and {a.status for a in answers} == {"queued"}
    history = await client.events("job-00000000abcd")
    assert [type(e.event).name() for e in history] == ["JobSubmitted", "JobPredicted"]
    predicted = history[1].event
    assert isinstance(predicted, JobPredicted) and predicted.prediction.predicted_at <= history[0].recorded_at
    assert (await client.get_job("job-00000000abcd")).job.prediction == predicted.prediction
    assert all(a.prediction == predicted.prediction for a in answers)  # the answers carry it


async def test_a_submission_is_answered_without_planning_and_its_prediction_recorded_a_moment_later(
        client: TrainyardClient, schedulers: Schedulers) -> None:
    gate = schedulers.gate_planning()
    accepted = await client.submit(spec("new"))  # answered while no prediction can be planned
    assert accepted.created and accepted.prediction is None
    await gate.planning()  # the prediction loop plans it now
    shown = (await client.get_job(accepted.job_id)).job  # not held up by the plan: shown without it
    assert shown.prediction is None and shown.expected is None
    gate.released.set()
    job = await eventually(lambda: prediction_of(client, accepted.job_id))
    assert not job.starts_now and job.position == 1  # no nodes: it fits nowhere


async def test_concurrent_submissions_are_each_answered_once_committed_and_one_id_makes_one_job(
        client: TrainyardClient) -> None:
    specs = [spec(f"burst-{i}") for i in range(60)]
    answers = await asyncio.gather(*(client.submit(s) for s in specs),
                                   *(client.submit(spec("same"), job_id="job-0000000000ee") for _ in range(5)))
    assert sum(a.created for a in answers) == 61
    assert sum(a.job_id == "job-0000000000ee" for a in answers) == 5
    listed = {j.job_id: j.name for j in await client.list_jobs(limit=100)}
    assert sorted(listed.values()) == sorted([*(s.name for s in specs), "same"])
    for answer in answers[:3]:  # answered once committed: the scheduler's log has them
        assert [type(e.event).name() for e in (await client.events(answer.job_id))][:1] == ["JobSubmitted"]


async def recorded_events(client: TrainyardClient, job_id: str, count: int) -> list[EventEnvelope]:
    history = await client.events(job_id)
    return history if len(history) >= count else []


async def prediction_of(client: TrainyardClient, job_id: str) -> Prediction | None:
    return (await client.get_job(job_id)).job.prediction


async def test_a_prediction_being_planned_does_not_hold_up_other_commands(
        client: TrainyardClient, schedulers: Schedulers) -> None:
    queued = await client.submit(spec("queued"))
    gate = schedulers.gate_planning()
    asking = asyncio.create_task(client.predict(spec()))
    await gate.planning()
    await client.stop([queued.job_id])
    assert (await client.get_job(queued.job_id)).job.status == "stopped"
    assert not asking.done()
    gate.released.set()
    prediction = await asking
    assert not prediction.starts_now and prediction.position == 1  # no nodes: it fits nowhere


async def test_a_waiting_job_is_shown_at_once_with_its_latest_prediction_while_a_plan_is_held(
        client: TrainyardClient, schedulers: Schedulers) -> None:
    queued = await client.submit(spec("queued"))
    recorded = await eventually(lambda: prediction_of(client, queued.job_id))
    gate = schedulers.gate_planning()
    asking = asyncio.create_task(client.predict(spec()))
    try:
        await gate.planning()  # the planning thread is held: no new plan can be made meanwhile
        # Answered while the plan is held (a generous bound: it waited for a plan of its own before), with the
        # latest prediction made (recorded when the job was queued, or of a plan a look started since), which says
        # when it was made.
        shown = (await asyncio.wait_for(client.get_job(queued.job_id), 4.0)).job
        assert not asking.done()
        held = shown.expected
        assert held is not None and held.predicted_at >= recorded.predicted_at
        assert held.position == recorded.position == 1
    finally:
        gate.released.set()
    await asking
    # The plans looks start (shared with listings, paced) give a later look its start as expected now.
    fresher = await eventually(lambda: expected_after(client, queued.job_id, held.predicted_at))
    assert not fresher.starts_now and fresher.position == 1


async def expected_after(client: TrainyardClient, job_id: str, after: datetime) -> Prediction | None:
    expected = (await client.get_job(job_id)).job.expected
    return expected if expected is not None and expected.predicted_at > after else None
