"""L1: the user each job's processes run as (libs/jobusers.py), as the launcher plans it for every node."""

from __future__ import annotations

from typing import Literal

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.contracts.cluster import MAX_JOB_UID, JobUsers
from libs.contracts.events import JobAdmitted, JobRequeued, JobSubmitted, LaunchPlanned, Placement
from libs.jobusers import job_uid
from tests.support.launcher import Site, launches
from tests.support.platform import CLUSTER, JOB, plain_spec

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=30)


@given(names, names, st.integers(1000, MAX_JOB_UID), st.integers(1, MAX_JOB_UID))
def test_a_job_s_user_lies_in_the_configured_range(job_id: str, creator: str, base: int, count: int) -> None:
    count = min(count, MAX_JOB_UID - base + 1)
    for per in ("job", "user"):
        settings = JobUsers(per=per, uid_base=base, uid_count=count)
        assert base <= job_uid(settings, job_id, creator) < base + count


def test_one_user_per_job_or_one_per_creator_as_configured() -> None:
    per_job, per_user = JobUsers(per="job"), JobUsers(per="user")
    assert job_uid(per_job, "job-1", "alice") == job_uid(per_job, "job-1", "bob")  # the job's, whoever made it
    assert job_uid(per_job, "job-1", "alice") != job_uid(per_job, "job-2", "alice")
    assert job_uid(per_user, "job-1", "alice") == job_uid(per_user, "job-2", "alice")  # alice's, in every job
    assert job_uid(per_user, "job-1", "alice") != job_uid(per_user, "job-1", "bob")


def test_a_range_past_the_highest_user_id_is_refused() -> None:
    with pytest.raises(ValueError, match="uid_base"):
        JobUsers(uid_base=MAX_JOB_UID, uid_count=2)


async def test_every_node_of_a_plan_runs_as_the_job_s_user(monkeypatch: pytest.MonkeyPatch) -> None:
    site = Site(monkeypatch)
    await site.scheduler(JobSubmitted(job_id=JOB, spec=plain_spec(2, mode="horovod"), creator="alice"))
    placement = [Placement(rank=r, node=n, address=f"addr-{n}", slots=1) for r, n in enumerate(["n1", "n2"])]
    await site.scheduler(JobAdmitted(job_id=JOB, attempt=1, flavor="cpu-4", placement=placement))
    await site.dispatch()
    [plan] = site.recorded(LaunchPlanned)
    assert [node.run_as for node in launches(plan)] == [job_uid(CLUSTER.job_users, JOB, "alice")] * 2


async def test_a_job_keeps_its_user_in_every_attempt_whatever_the_config_says_since(
        monkeypatch: pytest.MonkeyPatch) -> None:
    site = Site(monkeypatch)

    def configured(per: Literal["job", "user"]) -> None:
        site.launcher.cluster = site.launcher.dispatcher.cluster = msgspec.structs.replace(
            CLUSTER, job_users=JobUsers(per=per))

    configured("job")
    await site.run(plain_spec(2), ["n1", "n2"])
    [first] = site.recorded(LaunchPlanned)
    assert [node.run_as for node in launches(first)] == [job_uid(JobUsers(per="job"), JOB, "alice")] * 2
    configured("user")  # changed meanwhile, the launcher started again with it
    await site.exited(1, "n2", 3)
    await site.exited(0, "n1", 3)
    await site.scheduler(JobRequeued(job_id=JOB, attempt=1, reason="resumed elsewhere"))
    await site.run(plain_spec(2), ["n3", "n4"], attempt=2)
    second = site.recorded(LaunchPlanned)[-1]
    assert second.attempt == 2
    assert [node.run_as for node in launches(second)] == [job_uid(JobUsers(per="job"), JOB, "alice")] * 2
