"""A submission whose answer is lost (or that the scheduler cannot serve yet) is sent again with the
same job id, so it creates one job; one that nothing answers at all names its job id and the service
that does not answer. The scheduler is
a stand-in on real NATS that records jobs by id, as the real one does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg
from typer.testing import CliRunner

from client import api, cli
from client.api import CreationUnanswered, NoAnswer, TrainyardClient, TrainyardError
from devstack.servers import free_port, start_nats
from devstack.stack import REPO_ROOT
from libs.contracts.codec import decode_any, encode
from libs.contracts.jobspec import JobSpec, decode_spec
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.jobs import CLONE_JOB, LIST_JOBS, SUBMIT_JOB, CloneJob, JobAccepted, SubmitJob
from libs.messaging.connection import round_trip
from tests.support.schedulers import token

EXAMPLE_JOB = REPO_ROOT / "examples" / "pytorch-ddp.yaml"
# The client's request timeout here: the stand-in's silence ends an attempt within it, and an answer it does send
# comes well within it on a loaded machine too (an answer later than that would be counted a lost one).
ANSWER_SECONDS = 2.0


class LosesFirstAnswers:
    """A scheduler that records every job it is sent (once per id) and answers from the `answer_from`-th
    request on: the earlier ones are recorded, their answers lost. With `outage`, it answers the earlier
    ones `unavailable` instead, recording nothing."""

    def __init__(self, answer_from: int, *, outage: bool = False) -> None:
        self.answer_from = answer_from
        self.outage = outage
        self.received: list[str] = []
        self.jobs: dict[str, JobSpec | str] = {}

    async def handle(self, msg: Msg) -> None:
        request = decode_any(msg.data, SubmitJob | CloneJob)
        self.received.append(request.job_id)
        if self.outage and len(self.received) < self.answer_from:
            await msg.respond(encode(CommandError(code="unavailable", message="the scheduler cannot reach its "
                                                  "database right now", hint="try again in a few seconds")))
            return
        created = request.job_id not in self.jobs
        self.jobs.setdefault(request.job_id, request.spec if isinstance(request, SubmitJob) else request.source_job_id)
        if len(self.received) >= self.answer_from:
            await msg.respond(encode(JobAccepted(job_id=request.job_id, status="queued", created=created)))


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "CREATE_RETRY_SECONDS", 0.1)


@pytest_asyncio.fixture(loop_scope="session")
async def client(nats_url: str) -> AsyncIterator[TrainyardClient]:
    opened = await TrainyardClient.open(nats_url, token=token("tester"))
    opened.timeout = ANSWER_SECONDS
    yield opened
    await opened.close()


async def serve(nc: Client, subject: str, scheduler: LosesFirstAnswers) -> None:
    await nc.subscribe(subject, cb=scheduler.handle)
    await round_trip(nc)


async def test_a_submission_whose_answer_is_lost_creates_one_job(nc: Client, client: TrainyardClient) -> None:
    scheduler = LosesFirstAnswers(answer_from=2)
    await serve(nc, SUBMIT_JOB.subject, scheduler)
    retries: list[tuple[int, Exception]] = []
    spec = decode_spec(EXAMPLE_JOB.read_bytes(), yaml=True)

    accepted = await client.submit(spec, on_retry=lambda attempt, error: retries.append((attempt, error)))

    assert len(scheduler.received) == 2
    assert scheduler.received[0] == scheduler.received[1] == accepted.job_id
    assert list(scheduler.jobs) == [accepted.job_id]
    assert not accepted.created  # the first, lost attempt created it
    [(attempt, error)] = retries
    assert attempt == 2
    assert isinstance(error, NoAnswer) and error.subject == SUBMIT_JOB.subject


async def test_a_submission_the_scheduler_cannot_serve_yet_is_sent_again(nc: Client,
                                                                        client: TrainyardClient) -> None:
    scheduler = LosesFirstAnswers(answer_from=3, outage=True)
    await serve(nc, SUBMIT_JOB.subject, scheduler)
    retries: list[str] = []

    accepted = await client.submit(decode_spec(EXAMPLE_JOB.read_bytes(), yaml=True),
                                   on_retry=lambda attempt, error: retries.append(str(error)))

    assert scheduler.received == [accepted.job_id] * 3
    assert accepted.created
    assert retries == ["the scheduler cannot reach its database right now"] * 2


async def test_a_refused_submission_is_not_sent_again(nc: Client, client: TrainyardClient) -> None:
    received: list[bytes] = []

    async def refuse(msg: Msg) -> None:
        received.append(msg.data)
        await msg.respond(encode(CommandError(code="forbidden", message="you are not a member of project 'x'")))

    await nc.subscribe(SUBMIT_JOB.subject, cb=refuse)
    with pytest.raises(TrainyardError, match="not a member"):
        await client.submit(decode_spec(EXAMPLE_JOB.read_bytes(), yaml=True))
    assert len(received) == 1


async def test_a_clone_whose_answer_is_lost_creates_one_job(nc: Client, client: TrainyardClient) -> None:
    scheduler = LosesFirstAnswers(answer_from=3)
    await serve(nc, CLONE_JOB.subject, scheduler)

    accepted = await client.clone("job-00000000000a", {"nodes": 1})

    assert scheduler.received == [accepted.job_id] * 3
    assert list(scheduler.jobs) == [accepted.job_id]


async def test_a_submission_nothing_answers_names_its_job(client: TrainyardClient) -> None:
    spec = decode_spec(EXAMPLE_JOB.read_bytes(), yaml=True)
    retries: list[int] = []
    with pytest.raises(CreationUnanswered) as raised:
        await client.submit(spec, job_id="job-0000000000c1", on_retry=lambda attempt, _: retries.append(attempt))
    assert raised.value.job_id == "job-0000000000c1"
    assert raised.value.subject == SUBMIT_JOB.subject
    assert f"creating job job-0000000000c1 ({api.CREATE_ATTEMPTS} attempts" in str(raised.value)
    assert retries == list(range(2, api.CREATE_ATTEMPTS + 1))


async def test_a_query_nothing_answers_names_its_subject(client: TrainyardClient) -> None:
    with pytest.raises(NoAnswer) as raised:
        await client.list_jobs()
    assert raised.value.subject == LIST_JOBS.subject


# --- the command line --------------------------------------------------------------------------------------


class QuickClient(TrainyardClient):
    """The CLI's client, with the short request timeout of these tests."""

    def __init__(self, nc: Client, *, token: str | None = None, timeout: float = ANSWER_SECONDS,
                 reconnections: api.Reconnections | None = None) -> None:
        super().__init__(nc, token=token, timeout=ANSWER_SECONDS, reconnections=reconnections)


async def run_cli(monkeypatch: pytest.MonkeyPatch, nats_url: str, tmp_path: Path, *args: str) -> tuple[int, str]:
    """Run `trainyard ARGS` in a thread of its own (it runs its own event loop), against `nats_url`."""
    monkeypatch.setattr(cli, "TrainyardClient", QuickClient)
    env = {"NATS_URL": nats_url, "TRAINYARD_TOKEN": token("tester"), "TRAINYARD_HOME": str(tmp_path / "home")}
    result = await asyncio.to_thread(CliRunner().invoke, cli.app, list(args), env=env)
    return result.exit_code, result.output


async def test_cli_submit_sends_its_announced_id_again(nc: Client, nats_url: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = LosesFirstAnswers(answer_from=2)
    await serve(nc, SUBMIT_JOB.subject, scheduler)

    code, output = await run_cli(monkeypatch, nats_url, tmp_path, "submit", str(EXAMPLE_JOB))

    assert code == 0, output
    [job_id] = scheduler.jobs
    assert scheduler.received == [job_id, job_id]
    lines = output.splitlines()
    assert lines[0] == f"submitting job {job_id}"
    assert f"sending job {job_id} again (attempt 2 of {api.CREATE_ATTEMPTS})" in lines[1]
    assert f"submitted {job_id} (pytorch-ddp-demo): queued" in lines[2:]


async def test_cli_names_the_scheduler_when_it_does_not_answer(nats_url: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    code, output = await run_cli(monkeypatch, nats_url, tmp_path, "submit", str(EXAMPLE_JOB))

    assert code == 1
    job_id = output.splitlines()[0].removeprefix("submitting job ")
    assert f"error: nothing answered creating job {job_id}" in output
    assert "hint: the scheduler does not answer (trainyard.cmd.jobs.submit): `make status` shows whether it runs; " \
           "its log is" in output
    assert f"scheduler.log; job {job_id} may have been created all the same: `trainyard show {job_id}` tells" in output


async def test_a_submission_out_when_its_nats_server_restarts_is_sent_again_at_once(tmp_path: Path) -> None:
    """The server the client and the scheduler reach is killed while the request is out (its reply lost with it):
    the client sends the request again as soon as it is connected anew, not after its whole timeout."""
    port = free_port()
    server = start_nats(tmp_path / "nats", port)
    url = f"nats://127.0.0.1:{port}"
    scheduler = LosesFirstAnswers(answer_from=2)
    scheduler_nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    client = await TrainyardClient.open(url, token=token("tester"))
    # An attempt's timeout far beyond the test's patience: an answer within it came from the attempt sent again on
    # the new connection, not from a retry after the first attempt's timeout.
    client.timeout = 3600.0
    try:
        await serve(scheduler_nc, SUBMIT_JOB.subject, scheduler)
        spec = decode_spec(EXAMPLE_JOB.read_bytes(), yaml=True)
        submitting = asyncio.create_task(client.submit(spec))
        async with asyncio.timeout(60):
            while not scheduler.received:
                await asyncio.sleep(0.02)
        server.kill()
        server.wait()
        server = start_nats(tmp_path / "nats", port)
        accepted = await asyncio.wait_for(submitting, 120)
        assert scheduler.received == [accepted.job_id, accepted.job_id]
        assert list(scheduler.jobs) == [accepted.job_id]
    finally:
        await client.close()
        await scheduler_nc.close()
        server.kill()
        server.wait()
