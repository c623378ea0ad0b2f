"""J2: a job's access for others never exceeds its creator's own access to the resources it uses."""

from __future__ import annotations

import msgspec

from libs.contracts.identity import Identity
from libs.contracts.jobspec import (
    AlgorithmRef,
    BatchTask,
    DatasetRef,
    FieldError,
    JobSpec,
    ModelRef,
    OutputRef,
    VolumeRef,
)
from libs.contracts.scheduling import StoredAccess
from services.scheduler.domain.storage_access import own_access, resource_uses, storage_errors

ALICE = Identity(user="alice", projects=["vision"])
ROOT = Identity(user="root", projects=[], admin=True)


def spec(**changes: object) -> JobSpec:
    base = JobSpec(name="train", project="vision", mode="single-node", flavors=["cpu-1"],
                   algorithm=AlgorithmRef(name="algo"), command="python3 train.py", output=OutputRef(name="out"))
    return msgspec.structs.replace(base, **changes)


def registered(kind: str, name: str, owner: str = "bob", others: str = "read-only",
               project: str = "vision") -> dict[tuple[str, str], StoredAccess]:
    entry = msgspec.convert({"kind": kind, "name": name, "owner": owner, "project": project, "others": others},
                            StoredAccess)
    return {(kind, name): entry}


def fields(errors: list[FieldError]) -> list[str]:
    return [e.field for e in errors]


def test_every_mounted_resource_is_named_once_with_how_it_is_mounted() -> None:
    job = spec(type="batch", algorithm=None, command=None,
               tasks=[BatchTask(algorithm=AlgorithmRef(name="a1", read_only=True), command="x"),
                      BatchTask(algorithm=AlgorithmRef(name="a2", source="favorite", version="v1"), command="y")],
               datasets=[DatasetRef(name="imgs", source="favorite", version="3")],
               models=[ModelRef(name="resnet", source="pretrained")], volumes=[VolumeRef(name="scratch")])
    uses = {(u.field, u.kind, u.name, u.writes) for u in resource_uses(job)}
    assert uses == {("tasks[0].algorithm", "algorithm", "a1", False), ("tasks[1].algorithm", "algorithm", "a2", True),
                    ("datasets[0]", "dataset", "imgs", False), ("models[0]", "model", "resnet", False),
                    ("volumes[0]", "volume", "scratch", True), ("output", "output", "out", True)}


def test_unregistered_resources_are_open_to_everyone() -> None:
    assert storage_errors(spec(access="read-write"), ALICE, {}, sharing_enabled=True) == []


def test_a_job_shares_no_more_than_its_creator_may_do_with_a_resource() -> None:
    catalog = registered("dataset", "imgs", others="read-only")
    job = spec(datasets=[DatasetRef(name="imgs")])
    errors = storage_errors(msgspec.structs.replace(job, access="read-write"), ALICE, catalog, sharing_enabled=True)
    assert fields(errors) == ["access"]
    assert "more than your own access to dataset 'imgs' (read-only)" in errors[0].message
    assert errors[0].hint == "choose read-only or none"
    for access in ("read-only", "none"):
        assert storage_errors(msgspec.structs.replace(job, access=access), ALICE, catalog, sharing_enabled=True) == []


def test_a_read_only_resource_cannot_be_mounted_writable() -> None:
    catalog = registered("algorithm", "algo") | registered("output", "out")
    errors = storage_errors(spec(), ALICE, catalog, sharing_enabled=True)
    assert fields(errors) == ["algorithm", "output"]
    assert errors[0].hint == "mount it read-only (read_only: true)"
    assert errors[1].hint == "choose an output of your own"
    read_only = spec(algorithm=AlgorithmRef(name="algo", read_only=True))
    assert storage_errors(read_only, ALICE, registered("algorithm", "algo"), sharing_enabled=True) == []


def test_a_resource_not_shared_with_the_creator_cannot_be_used() -> None:
    for catalog in (registered("algorithm", "algo", others="none"),
                    registered("algorithm", "algo", project="nlp", others="read-write")):
        errors = storage_errors(spec(algorithm=AlgorithmRef(name="algo", read_only=True)), ALICE, catalog,
                                sharing_enabled=True)
        assert fields(errors) == ["algorithm"]
        assert errors[0].message == "you have no access to algorithm 'algo' (owned by bob)"


def test_switching_sharing_off_leaves_only_owners_and_administrators() -> None:
    catalog = registered("dataset", "imgs", others="read-write")
    job = spec(datasets=[DatasetRef(name="imgs")])
    assert fields(storage_errors(job, ALICE, catalog, sharing_enabled=False)) == ["datasets[0]"]
    assert storage_errors(job, Identity(user="bob", projects=["vision"]), catalog, sharing_enabled=False) == []
    assert storage_errors(msgspec.structs.replace(job, access="read-write"), ROOT, catalog,
                          sharing_enabled=False) == []


def test_own_access() -> None:
    entry = registered("model", "m", others="read-only")[("model", "m")]
    assert own_access(None, ALICE, sharing_enabled=True) == "read-write"
    assert own_access(entry, Identity(user="bob", projects=[]), sharing_enabled=True) == "read-write"
    assert own_access(entry, ALICE, sharing_enabled=True) == "read-only"
    assert own_access(entry, Identity(user="carol", projects=["nlp"]), sharing_enabled=True) == "none"
