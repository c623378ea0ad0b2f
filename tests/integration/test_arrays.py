"""Job arrays through the real scheduler (real NATS and PostgreSQL): one request makes many ordinary jobs,
a retry makes none more, a bad spec refuses the whole array, the array is one object in listings, and its
jobs are stopped and deleted all or by index."""

from __future__ import annotations

import pytest

from client.api import TrainyardClient, TrainyardError
from libs.contracts.arrays import SweepParameter
from libs.contracts.operations.arrays import ArraySelection
from tests.support.schedulers import spec

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_an_array_makes_an_ordinary_job_per_index_once_and_lists_as_one_object(
        client: TrainyardClient) -> None:
    template = spec("sweep-{index}", command="python3 train.py --seed {index}")
    accepted = await client.submit_array(template, indices="0-9:3,20%2", array_id="array-0123456789ab")
    assert accepted.created and len(accepted.job_ids) == 5
    again = await client.submit_array(template, indices="0-9:3,20%2", array_id="array-0123456789ab")
    assert (again.created, again.job_ids) == (False, accepted.job_ids)  # a retry makes nothing more

    jobs = {job.job_id: job for job in await client.list_jobs()}
    assert set(jobs) == set(accepted.job_ids)  # ordinary jobs, each listed by the plain listing
    member = await client.get_job(accepted.job_ids[1])
    assert (member.job.name, member.spec.command) == ("sweep-3", "python3 train.py --seed 3")
    assert member.spec.env["TRAINYARD_ARRAY_INDEX"] == "3" and member.job.array is not None

    grouped = await client.listing()
    assert grouped.jobs == []
    [array] = grouped.arrays
    assert (array.array_id, array.size, array.indices, array.max_running) == ("array-0123456789ab", 5, "0-9:3,20", 2)
    assert array.statuses == {"queued": 5}
    indices = [job.index async for job in client.array_jobs("array-0123456789ab")]
    assert indices == [0, 3, 6, 9, 20]


async def test_a_sweep_sets_each_points_values_in_the_jobs_environment(client: TrainyardClient) -> None:
    sweep = [SweepParameter(name="LR", values=["0.1", "0.01"]), SweepParameter(name="BS", values=["32", "64"])]
    accepted = await client.submit_array(spec("lr-{LR}-bs-{BS}"), sweep=sweep)
    details = await client.get_array(accepted.array_id)
    assert [(job.index, job.values) for job in details.jobs] == [
        (0, {"LR": "0.1", "BS": "32"}), (1, {"LR": "0.1", "BS": "64"}),
        (2, {"LR": "0.01", "BS": "32"}), (3, {"LR": "0.01", "BS": "64"})]
    last = await client.get_job(details.jobs[-1].job_id)
    assert last.job.name == "lr-0.01-bs-64" and (last.spec.env["LR"], last.spec.env["BS"]) == ("0.01", "64")


async def test_a_spec_one_job_of_the_array_would_break_refuses_the_whole_array(client: TrainyardClient) -> None:
    with pytest.raises(TrainyardError) as refused:  # the longest index makes the name too long
        await client.submit_array(spec("x" * 124 + "{index}"), indices="0-99999:50000")
    assert refused.value.error.code == "invalid-spec" and "name" in refused.value.error.message
    with pytest.raises(TrainyardError) as bad:
        await client.submit_array(spec("ok-{index}", flavors=["no-such-flavor"]), indices="0-3")
    assert bad.value.error.code == "invalid-spec"
    with pytest.raises(TrainyardError) as unreadable:
        await client.submit_array(spec("ok-{index}"), indices="3-1")
    assert unreadable.value.error.code == "invalid-request" and "must not end before it starts" in str(
        unreadable.value)
    assert await client.list_jobs() == []  # nothing stored


async def test_some_indices_or_the_whole_array_are_stopped_and_then_deleted(client: TrainyardClient) -> None:
    accepted = await client.submit_array(spec("a-{index}"), indices="0-5")
    stopped = await client.stop([], arrays=[ArraySelection(array_id=accepted.array_id, indices="1,3-4")])
    assert stopped.message == "stopping 3 job(s)"
    array = (await client.get_array(accepted.array_id)).array
    assert array.statuses == {"stopped": 3, "queued": 3}
    with pytest.raises(TrainyardError) as active:
        await client.delete([], arrays=[ArraySelection(array_id=accepted.array_id)])
    assert active.value.error.code == "invalid-state"
    await client.stop([], arrays=[ArraySelection(array_id=accepted.array_id)])
    deleted = await client.delete([], arrays=[ArraySelection(array_id=accepted.array_id)])
    assert deleted.message == "deleted 6 job(s)"
    assert (await client.listing()).arrays == []
