"""Decoding contract types: a union written where it is used is a new object at every call, and each
decodes as its members, however many there were, without the decoders kept growing."""

from __future__ import annotations

import msgspec
import pytest

from libs.contracts import codec
from libs.contracts.codec import decode_any, encode
from libs.contracts.events import Event, JobFailed, JobSucceeded
from libs.contracts.operations.base import CommandError, Done


def test_unions_made_at_every_call_decode_as_their_members() -> None:
    done, refused = encode(Done(job_ids=["job-1"])), encode(CommandError(code="not-found", message="no job-1"))
    for _ in range(3 * codec.IDENTITIES_KEPT):
        assert decode_any(done, Done | CommandError) == Done(job_ids=["job-1"])
        assert isinstance(decode_any(refused, CommandError | Done), CommandError)
    assert len(codec._by_identity) <= codec.IDENTITIES_KEPT


def test_a_type_outside_the_union_is_refused_whichever_union_was_asked_before() -> None:
    succeeded = encode(JobSucceeded(job_id="job-1"))
    assert decode_any(succeeded, Event) == JobSucceeded(job_id="job-1")
    with pytest.raises(msgspec.ValidationError, match=r"Invalid value 'JobSucceeded\.v1'"):
        decode_any(succeeded, JobFailed | CommandError)
