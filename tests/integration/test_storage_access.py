"""J2 through the client on real NATS and PostgreSQL: owners of shared storage's resources, and jobs
that may share no more than their creator's own access to what they use."""

from __future__ import annotations

from pathlib import Path

import pytest

from client.api import TrainyardClient
from libs.contracts.jobspec import AlgorithmRef, DatasetRef
from tests.support.schedulers import Login, Schedulers, refused, spec, token

pytestmark = pytest.mark.asyncio(loop_scope="session")


def add_dataset(tmp_path: Path) -> None:
    """The dataset `imgs` in the scheduler's shared storage (the `login` fixture's)."""
    (tmp_path / "storage" / "datasets" / "imgs").mkdir(parents=True)


async def test_a_job_shares_no_more_of_a_dataset_than_its_creator_may_do(login: Login, tmp_path: Path) -> None:
    bob = await login("bob", "vision")
    alice = await login("alice", "vision")
    add_dataset(tmp_path)
    entry = await bob.set_storage_access("dataset", "imgs", project="vision", others="read-only")
    assert (entry.owner, entry.others) == ("bob", "read-only")

    too_open = spec(project="vision", access="read-write", datasets=[DatasetRef(name="imgs")])
    error = (await refused(alice.submit(too_open))).error
    assert error.code == "forbidden"
    assert [e.field for e in error.errors] == ["access"]
    assert await alice.list_jobs() == []
    shared = await alice.submit(spec(project="vision", access="read-only", datasets=[DatasetRef(name="imgs")]))
    assert shared.created
    # The owner's own jobs are not capped by what others may do.
    assert (await bob.submit(too_open)).created


async def test_only_the_owner_or_an_administrator_changes_a_registration(login: Login, tmp_path: Path) -> None:
    bob = await login("bob", "vision")
    alice = await login("alice", "vision")
    admin = await login("root", admin=True)
    add_dataset(tmp_path)
    await bob.set_storage_access("dataset", "imgs", project="vision", others="none")
    error = (await refused(alice.set_storage_access("dataset", "imgs", project="vision", others="read-write"))).error
    assert (error.code, error.message) == ("forbidden", "dataset 'imgs' belongs to bob")
    # Not shared: alice cannot use it at all, even without sharing her job.
    used = spec(project="vision", datasets=[DatasetRef(name="imgs")])
    assert [e.field for e in (await refused(alice.submit(used))).error.errors] == ["datasets[0]"]

    await admin.set_storage_access("dataset", "imgs", project="vision", others="read-only", owner="alice")
    assert (await alice.submit(used)).created
    listed = await alice.storage_access()
    assert [(e.kind, e.name, e.owner, e.others) for e in listed] == [("dataset", "imgs", "alice", "read-only")]
    assert await (await login("carol", "nlp")).storage_access() == []


async def test_a_clone_is_checked_against_the_cloners_own_access(login: Login) -> None:
    bob = await login("bob", "vision")
    alice = await login("alice", "vision")
    await bob.set_storage_access("algorithm", "algo", project="vision", others="none")
    source = await bob.submit(spec(project="vision", access="read-only", algorithm=AlgorithmRef(name="algo")))
    # alice may view bob's job, but cloning it would run bob's private algorithm as hers.
    assert (await alice.get_job(source.job_id)).job.creator == "bob"
    error = (await refused(alice.clone(source.job_id))).error
    assert (error.code, [e.field for e in error.errors]) == ("forbidden", ["algorithm"])


async def test_registering_needs_the_resource_and_project_membership(login: Login, tmp_path: Path) -> None:
    alice = await login("alice", "vision")
    add_dataset(tmp_path)
    missing = (await refused(alice.set_storage_access("dataset", "nope", project="vision", others="none"))).error
    assert missing.code == "not-found"
    assert "datasets/nope does not exist" in missing.message
    outsider = (await refused(alice.set_storage_access("dataset", "imgs", project="nlp", others="none"))).error
    assert outsider.code == "forbidden"
    # Output locations are created on first use, so they can be claimed before.
    assert (await alice.set_storage_access("output", "results", project="vision", others="none")).owner == "alice"


async def test_registrations_are_rebuilt_from_the_log_at_start(schedulers: Schedulers, nats_url: str) -> None:
    await schedulers.start()
    bob = await TrainyardClient.open(nats_url, token=token("bob", "vision"))
    alice = await TrainyardClient.open(nats_url, token=token("alice", "vision"))
    try:
        await bob.set_storage_access("algorithm", "algo", project="vision", others="read-only")
        await schedulers.stop_all()
        await schedulers.start()
        assert [(e.name, e.owner) for e in await alice.storage_access()] == [("algo", "bob")]
        error = (await refused(alice.submit(spec(project="vision")))).error
        assert [e.field for e in error.errors] == ["algorithm"]  # mounted writable, but only readable to alice
        # An identical registration records nothing and changes nothing.
        await bob.set_storage_access("algorithm", "algo", project="vision", others="read-only")
    finally:
        await bob.close()
        await alice.close()
