"""J2: the operation matrix for creators, project members, outsiders and administrators."""

from __future__ import annotations

import pytest

from libs.access import READ_ONLY_ACTIONS, READ_WRITE_ACTIONS, allowed
from libs.contracts.identity import Identity
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef

ALL = sorted(READ_ONLY_ACTIONS | READ_WRITE_ACTIONS)


def spec(access: str) -> JobSpec:
    return JobSpec(name="bert", project="vision", access=access, flavors=["cpu-1"],  # type: ignore[arg-type]
                   algorithm=AlgorithmRef(name="a"), command="python3 t.py", output=OutputRef(name="o"))


MEMBER = Identity(user="bob", projects=["vision"])
OUTSIDER = Identity(user="carol", projects=["nlp"])
ADMIN = Identity(user="root", admin=True)


@pytest.mark.parametrize("operation", ALL)
def test_the_creator_and_administrators_may_do_everything(operation: str) -> None:
    for who in (Identity(user="alice"), ADMIN):
        assert allowed(who, spec("none"), "alice", operation, sharing_enabled=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("operation", ALL)
def test_read_only_sharing_allows_exactly_the_read_operations(operation: str) -> None:
    expected = operation in READ_ONLY_ACTIONS
    assert allowed(MEMBER, spec("read-only"), "alice", operation, sharing_enabled=True) is expected  # type: ignore[arg-type]
    assert allowed(MEMBER, spec("read-write"), "alice", operation, sharing_enabled=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("operation", ALL)
def test_no_sharing_outside_the_project_nor_when_switched_off(operation: str) -> None:
    assert not allowed(OUTSIDER, spec("read-write"), "alice", operation, sharing_enabled=True)  # type: ignore[arg-type]
    assert not allowed(MEMBER, spec("read-write"), "alice", operation, sharing_enabled=False)  # type: ignore[arg-type]
    assert not allowed(MEMBER, spec("none"), "alice", operation, sharing_enabled=True)  # type: ignore[arg-type]
