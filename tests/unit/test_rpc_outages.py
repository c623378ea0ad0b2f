"""A request that meets the database or NATS away gets an honest `unavailable` reply to try again,
not `internal`; a bug is still `internal`. One responder on faststream's in-memory test broker."""

from __future__ import annotations

import asyncpg
import pytest
from faststream.nats import NatsBroker, TestNatsBroker

from libs.contracts.codec import decode_any, encode
from libs.contracts.messages import CommandError, Done, ListAlerts
from libs.messaging.rpc import register_responder

SUBJECT = "trainyard.query.alerts"


@pytest.mark.parametrize("failure, code", [
    (asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
     "unavailable"),
    (ConnectionRefusedError(111, "Connection refused"), "unavailable"),
    (KeyError("job-1"), "internal"),
])
async def test_a_handler_that_meets_an_outage_answers_unavailable(failure: Exception, code: str) -> None:
    broker = NatsBroker()

    async def handler(_: ListAlerts) -> Done:
        raise failure

    register_responder(broker, "monitor", SUBJECT, ListAlerts, handler)
    async with TestNatsBroker(broker) as test:
        reply = await test.request(encode(ListAlerts()), SUBJECT)

    error = decode_any(reply.body, CommandError)
    assert error.code == code
    if code == "unavailable":
        assert "the monitor cannot reach its database or NATS right now" in error.message
        assert error.hint == "try again in a few seconds"
