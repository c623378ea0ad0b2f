"""A request that meets the database or NATS away gets an honest `unavailable` reply to try again,
not `internal`; a bug is still `internal`. One responder on faststream's in-memory test broker."""

from __future__ import annotations

import asyncpg
import pytest
from faststream.nats import NatsBroker, TestNatsBroker

from libs.auth import bearer_headers, issue_token, new_secret
from libs.contracts.codec import decode_any, encode
from libs.contracts.identity import Identity
from libs.contracts.operations.alerts import LIST_ALERTS, ListAlerts
from libs.contracts.operations.base import CommandError, Done
from libs.messaging.rpc import serve_operations


@pytest.mark.parametrize("failure, code", [
    (asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
     "unavailable"),
    (ConnectionRefusedError(111, "Connection refused"), "unavailable"),
    (KeyError("job-1"), "internal"),
])
async def test_a_handler_that_meets_an_outage_answers_unavailable(failure: Exception, code: str) -> None:
    broker = NatsBroker()

    secret = new_secret()
    token = issue_token(secret, Identity(user="alice", projects=["default"]))

    async def handler(_: ListAlerts, __: Identity) -> Done:
        raise failure

    serve_operations(broker, "monitor", [(LIST_ALERTS, handler)], secret=secret)
    async with TestNatsBroker(broker) as test:
        reply = await test.request(encode(ListAlerts()), LIST_ALERTS.subject, headers=bearer_headers(token))

    error = decode_any(reply.body, CommandError)
    assert error.code == code
    if code == "unavailable":
        assert "the monitor cannot reach its database or NATS right now" in error.message
        assert error.hint == "try again in a few seconds"
