"""`call` on real NATS: a request that finds no responder is asked again for a moment (a service
restarting, or its subscription not yet at every server of a cluster) before "nothing answers"."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from libs.contracts.codec import encode
from libs.contracts.operations.base import Done
from libs.contracts.operations.catalogue import PEOPLE_REPLIES as Reply
from libs.contracts.operations.cluster import MarkComponent
from libs.messaging.connection import round_trip
from libs.messaging.rpc import NO_RESPONDER_PAUSES, ServiceUnavailable, call

pytestmark = pytest.mark.asyncio(loop_scope="session")
SUBJECT = "trainyard.test.rpc-late-responder"
PATIENCE = 60  # far longer than the pauses, far shorter than a request timeout per try


def request() -> MarkComponent:
    return MarkComponent(node="node-a", component="board:0")


async def test_a_responder_that_subscribes_a_moment_late_still_answers(nc: Client,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    answered: list[bytes] = []
    tries: list[str] = []

    async def answer(msg: Msg) -> None:
        answered.append(msg.data)
        await msg.respond(encode(Done(job_ids=["late"])))

    # The responder subscribes once two tries found nobody: during the second pause, however slow the machine.
    sent = nc.request

    async def request_until_late(subject: str, *args: Any, **kwargs: Any) -> Msg:
        try:
            reply = await sent(subject, *args, **kwargs)
        except NoRespondersError:
            tries.append("nobody")
            if len(tries) == 2:
                await nc.subscribe(SUBJECT, cb=answer)
                await round_trip(nc)
            raise
        tries.append("answered")
        return reply

    monkeypatch.setattr(nc, "request", request_until_late)
    reply = await call(nc, SUBJECT, request(), timeout=PATIENCE, reply_type=Reply)
    assert isinstance(reply, Done)
    assert tries == ["nobody", "nobody", "answered"]
    assert len(answered) == 1  # asked again only while nobody could have received it


async def test_nothing_subscribed_is_reported_after_the_pauses(nc: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    tries: list[str] = []
    sent = nc.request

    async def counted(subject: str, *args: Any, **kwargs: Any) -> Msg:
        tries.append(subject)
        return await sent(subject, *args, **kwargs)

    monkeypatch.setattr(nc, "request", counted)
    # Each try's timeout is an hour: the refusal coming at all shows it came after the pauses, not a timeout per try.
    with pytest.raises(ServiceUnavailable, match=r"nothing answers on trainyard\.test\.nobody"):
        async with asyncio.timeout(PATIENCE):
            await call(nc, "trainyard.test.nobody", request(), timeout=3600.0)
    assert len(tries) == len(NO_RESPONDER_PAUSES) + 1  # asked again after each pause, then given up
