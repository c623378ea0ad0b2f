"""J2, hidden is missing: every operation that names a job answers a job the caller may not view
exactly as it answers an id that never existed (same code, message and hint), whichever service
answers it: the scheduler (details, usage, logs, history, why, devenv, clone, stop, delete, priority,
duration, arrays, past views) and the monitor (the run and its series for `metrics` and
`tensorboard`, the debug terminal of `exec`). On real NATS and PostgreSQL; no node agents run, so
jobs stay queued.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from client.api import TrainyardClient, TrainyardError
from client.tensorboard import write_run
from libs.contracts.arrays import new_array_id
from libs.contracts.ids import new_job_id
from libs.contracts.operations.arrays import ArraySelection
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.watches import WATCH_JOB, WatchJob
from libs.skeleton.runtime import ServiceRuntime
from tests.support.monitor import start_monitor
from tests.support.schedulers import Schedulers, refused, spec, token
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")

Operation = Callable[[TrainyardClient, str], Awaitable[object]]


async def read_logs(client: TrainyardClient, job_id: str) -> None:
    async for _ in client.logs(job_id):
        pass


async def read_series(client: TrainyardClient, job_id: str) -> None:
    async for _ in client.series(job_id, "loss"):
        pass


def at_past_instant(view: Operation) -> Operation:
    """`trainyard at TIME VIEW`: the view of the state rebuilt up to a past instant (after the job was submitted)."""

    async def then(client: TrainyardClient, job_id: str) -> object:
        client.at = datetime.now(UTC)
        try:
            return await view(client, job_id)
        finally:
            client.at = None

    return then


# Every operation that names one job, as the CLI's commands send it.
JOB_OPERATIONS: dict[str, Operation] = {
    "show": lambda c, j: c.get_job(j),
    "show (usage)": lambda c, j: c.usage(j),
    "logs": read_logs,
    "events": lambda c, j: c.history(j),
    "why": lambda c, j: c.why(j),
    "wait": lambda c, j: c.wait(j, timeout=10),
    "devenv": lambda c, j: c.devenv(j),
    "clone": lambda c, j: c.clone(j, {"name": "copy"}),
    "stop": lambda c, j: c.stop([j]),
    "delete": lambda c, j: c.delete([j]),
    "priority": lambda c, j: c.change_priority(j, "urgent"),
    "duration": lambda c, j: c.change_duration(j, "1h"),
    "at TIME show": at_past_instant(lambda c, j: c.get_job(j)),
    "at TIME why": at_past_instant(lambda c, j: c.why(j)),
    "metrics": lambda c, j: c.run(j),
    "metrics NAME": read_series,
    "tensorboard": lambda c, j: write_run(c, j, Path("/nonexistent-never-written")),
    "exec": lambda c, j: c.run_in_job(j, "true", timeout=10),
    "watch (the console's follow streams)": lambda c, j: c.ask(WATCH_JOB, WatchJob(job_id=j, inbox=c.nc.new_inbox())),
}

# Every operation that names an array.
ARRAY_OPERATIONS: dict[str, Operation] = {
    "show ARRAY": lambda c, a: c.get_array(a),
    "at TIME show ARRAY": at_past_instant(lambda c, a: c.get_array(a)),
    "stop ARRAY": lambda c, a: c.stop([], arrays=[ArraySelection(array_id=a)]),
    "stop ARRAY --indices": lambda c, a: c.stop([], arrays=[ArraySelection(array_id=a, indices="7")]),
    "delete ARRAY": lambda c, a: c.delete([], arrays=[ArraySelection(array_id=a)]),
}


@dataclass
class Stack:
    alice: TrainyardClient  # project vision: the creator of the jobs
    bob: TrainyardClient  # project vision too: a member, for whom a job with access none is private
    carol: TrainyardClient  # project nlp: another project
    private: str  # alice's job, access none
    shared: str  # alice's job, read-only for her project
    array: str  # alice's array, access none


@pytest_asyncio.fixture(loop_scope="session")
async def stack(nats_url: str, schedulers: Schedulers) -> AsyncIterator[Stack]:
    await schedulers.start()
    monitor: ServiceRuntime
    monitor, _ = await start_monitor(schedulers.settings)
    clients = [await TrainyardClient.open(nats_url, token=token(user, project))
               for user, project in (("alice", "vision"), ("bob", "vision"), ("carol", "nlp"))]
    alice, bob, carol = clients
    try:
        private = (await alice.submit(spec("private", project="vision"))).job_id
        shared = (await alice.submit(spec("shared", project="vision", access="read-only"))).job_id
        array = (await alice.submit_array(spec("sweep", project="vision"), indices="0-2")).array_id

        async def monitor_knows_them() -> bool:  # so that a refusal is the rule's, not the monitor's lag
            try:
                await alice.run(private)
                await bob.run(shared)
            except TrainyardError:
                return False
            return True

        await eventually(monitor_knows_them)
        yield Stack(alice=alice, bob=bob, carol=carol, private=private, shared=shared, array=array)
    finally:
        for client in clients:
            await client.close()
        await monitor.close()


def anonymized(error: CommandError, given_id: str) -> CommandError:
    """The refusal with the id it names replaced, to compare the replies to two ids."""
    return msgspec.structs.replace(error, message=error.message.replace(given_id, "ID"),
                                   hint=(error.hint or "").replace(given_id, "ID"))


async def assert_hidden_is_missing(client: TrainyardClient, operation: Operation, hidden: str, made_up: str) -> None:
    missing = await refused(operation(client, made_up))
    concealed = await refused(operation(client, hidden))
    assert missing.error.code == "not-found"
    assert anonymized(concealed.error, hidden) == anonymized(missing.error, made_up)


@pytest.mark.parametrize("viewer", ["bob", "carol"])
async def test_a_job_the_caller_may_not_view_is_answered_as_one_that_does_not_exist(stack: Stack,
                                                                                    viewer: str) -> None:
    client = getattr(stack, viewer)
    for name, operation in JOB_OPERATIONS.items():
        try:
            await assert_hidden_is_missing(client, operation, stack.private, new_job_id())
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from exc
    for name, operation in ARRAY_OPERATIONS.items():
        try:
            await assert_hidden_is_missing(client, operation, stack.array, new_array_id())
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from exc
    # Nothing was changed by any of it.
    assert (await stack.alice.get_job(stack.private)).job.status == "queued"
    assert (await stack.alice.get_array(stack.array)).array.statuses == {"queued": 3}


async def test_read_only_access_still_shows_the_job_and_refuses_changes_as_forbidden(stack: Stack) -> None:
    bob, job_id = stack.bob, stack.shared
    await bob.get_job(job_id)
    assert (await bob.run(job_id)).job_id == job_id
    assert [point async for point in bob.series(job_id, "loss")] == []
    for change in (bob.stop([job_id]), bob.change_priority(job_id, "urgent"), bob.change_duration(job_id, "1h"),
                   bob.run_in_job(job_id, "true", timeout=10)):
        error = (await refused(change)).error
        assert error.code == "forbidden" and "read-only" in error.message
    # The same caller, for the job that is not shared: as if it did not exist.
    assert (await refused(bob.run(stack.private))).error.code == "not-found"
