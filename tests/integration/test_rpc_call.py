"""`call` on real NATS: a request that finds no responder is asked again for a moment (a service
restarting, or its subscription not yet at every server of a cluster) before "nothing answers"."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from libs.contracts.codec import encode
from libs.contracts.messages import Done, MarkComponent, Reply
from libs.messaging.connection import round_trip
from libs.messaging.rpc import NO_RESPONDER_PAUSES, ServiceUnavailable, call

pytestmark = pytest.mark.asyncio(loop_scope="session")
SUBJECT = "trainyard.test.rpc-late-responder"


def request() -> MarkComponent:
    return MarkComponent(node="node-a", component="board:0")


async def test_a_responder_that_subscribes_a_moment_late_still_answers(nc: Client) -> None:
    answered: list[bytes] = []

    async def answer(msg: Msg) -> None:
        answered.append(msg.data)
        await msg.respond(encode(Done(job_ids=["late"])))

    async def subscribe_late() -> None:
        await asyncio.sleep(NO_RESPONDER_PAUSES[0] + NO_RESPONDER_PAUSES[1] / 2)
        await nc.subscribe(SUBJECT, cb=answer)
        await round_trip(nc)

    late = asyncio.create_task(subscribe_late())
    reply = await call(nc, SUBJECT, request(), timeout=2.0, reply_type=Reply)
    await late
    assert isinstance(reply, Done)
    assert len(answered) == 1  # asked again only while nobody could have received it


async def test_nothing_subscribed_is_reported_after_the_pauses(nc: Client) -> None:
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(ServiceUnavailable, match=r"nothing answers on trainyard\.test\.nobody"):
        await call(nc, "trainyard.test.nobody", request(), timeout=2.0)
    assert loop.time() - began < sum(NO_RESPONDER_PAUSES) + 1.0  # not the whole request timeout per try
