"""A delivered message's stream sequence and pending count, read off its reply subject as nats-py reads them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError

from libs.messaging.reader import delivered

numbers = st.integers(min_value=0, max_value=2**63 - 1)


def _msg(reply: str) -> Msg:
    return Msg(_client=None, subject="trainyard.events.x", reply=reply)  # type: ignore[arg-type]


@given(stream_seq=numbers, consumer_seq=numbers, pending=numbers, domain=st.sampled_from(["_", "hub"]))
def test_both_forms_of_the_reply_read_as_nats_py_reads_them(stream_seq: int, consumer_seq: int, pending: int,
                                                             domain: str) -> None:
    old = f"$JS.ACK.TRAINYARD_EVENTS.c1.1.{stream_seq}.{consumer_seq}.1700000000000000000.{pending}"
    new = f"$JS.ACK.{domain}.ACCHASH.TRAINYARD_EVENTS.c1.1.{stream_seq}.{consumer_seq}.1700000000000000000.{pending}"
    for reply in (old, new, new + ".token"):
        metadata = _msg(reply).metadata
        assert delivered(_msg(reply)) == (metadata.sequence.stream, metadata.num_pending) == (stream_seq, pending)


def test_a_message_not_from_jetstream_is_refused_as_nats_py_refuses_it() -> None:
    with pytest.raises(NotJSMessageError):
        delivered(_msg("_INBOX.abc"))
    with pytest.raises(NotJSMessageError):
        delivered(_msg(""))
