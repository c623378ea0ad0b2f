"""Which requests the client sends again when its connection to NATS is made anew while they are out: every query,
and of the commands people send, only those a second delivery can do nothing more by; each command is decided one
way or the other, so a new one cannot be sent again by default."""

from __future__ import annotations

from client.api import SENT_AGAIN_COMMANDS, SENT_ONCE, sent_again
from libs.contracts.operations.catalogue import sent_by
from libs.contracts.operations.cluster import MARK_COMPONENT
from libs.contracts.operations.images import REGISTER_IMAGE, UPLOAD_IMAGE
from libs.contracts.operations.jobs import DELETE_JOBS, GET_JOB, LIST_JOBS, STOP_JOBS, SUBMIT_JOB
from libs.contracts.operations.runs import OPEN_TERMINAL


def test_every_command_people_send_is_sent_again_or_sent_once() -> None:
    commands = {operation.name for operation in sent_by("user") if operation.changes_state}
    assert commands == SENT_AGAIN_COMMANDS | SENT_ONCE
    assert not SENT_AGAIN_COMMANDS & SENT_ONCE


def test_queries_and_idempotent_commands_are_sent_again_the_rest_once() -> None:
    assert all(sent_again(operation) for operation in sent_by("user") if not operation.changes_state)
    assert all(sent_again(operation) for operation in (LIST_JOBS, GET_JOB, SUBMIT_JOB, UPLOAD_IMAGE, STOP_JOBS,
                                                       MARK_COMPONENT))
    assert not any(sent_again(operation) for operation in (DELETE_JOBS, REGISTER_IMAGE, OPEN_TERMINAL))
