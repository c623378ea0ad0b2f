"""A follower asks for its ordered consumer's info once subscribed: nats-py replaces an ordered consumer that missed
two heartbeats (a busy machine) by a new one made in the background, and the old one is gone meanwhile."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from nats.js.api import ConsumerConfig, ConsumerInfo
from nats.js.errors import NotFoundError

from libs.messaging import follower


class Replacing:
    """A subscription whose consumer is being replaced: not found `gone` times, then the new one's info."""

    def __init__(self, gone: int) -> None:
        self.gone = gone
        self.asked = 0

    async def consumer_info(self) -> ConsumerInfo:
        self.asked += 1
        if self.asked <= self.gone:
            raise NotFoundError(code=404, err_code=10014, description="consumer not found")
        return ConsumerInfo(name="new", stream_name="S", config=ConsumerConfig(), created=datetime.now(UTC),
                            num_pending=0)


async def test_a_consumer_being_replaced_is_asked_about_again() -> None:
    subscription = Replacing(gone=3)
    info = await follower._consumer_info(subscription)
    assert (info.name, subscription.asked) == ("new", 4)


async def test_a_consumer_gone_for_good_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(follower, "CONSUMER_INFO_TRIES", 3)
    subscription = Replacing(gone=10)
    with pytest.raises(NotFoundError):
        await follower._consumer_info(subscription)
    assert subscription.asked == 3
