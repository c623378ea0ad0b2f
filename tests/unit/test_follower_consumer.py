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


class Counting:
    """A stream whose followed messages are at `sequences`: a consumer made to count tells how many are pending from
    its start (`unreachable`: NATS cannot be asked)."""

    def __init__(self, sequences: list[int], unreachable: bool = False) -> None:
        self.sequences = sequences
        self.unreachable = unreachable
        self.made: list[int] = []
        self.deleted = 0

    async def add_consumer(self, stream: str, config: ConsumerConfig) -> ConsumerInfo:
        if self.unreachable:
            raise TimeoutError
        assert config.opt_start_seq is not None
        self.made.append(config.opt_start_seq)
        pending = sum(1 for sequence in self.sequences if sequence >= config.opt_start_seq)
        return ConsumerInfo(name=f"c{len(self.made)}", stream_name=stream, config=config,
                            created=datetime.now(UTC), num_pending=pending)

    async def delete_consumer(self, stream: str, consumer: str) -> bool:
        self.deleted += 1
        return True


def restored_follower(js: Counting) -> follower.StreamFollower:
    async def handle(*_: object) -> bool:
        return False

    return follower.StreamFollower(js, None, stream="S", subject="trainyard.events.scheduler.>",  # type: ignore[arg-type]
                                   consumer="c", message_type=object, handle=handle,
                                   folded={"trainyard.events.scheduler.>": 1000})


async def test_a_restored_follower_begins_back_far_enough_for_the_envelopes_a_replay_remembers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One followed message in ten stream positions: the four latest up to 1000 lie from 970 on."""
    monkeypatch.setattr(follower, "REMEMBERED_ENVELOPES", 4)
    js = Counting(list(range(10, 1200, 10)))
    assert await restored_follower(js)._remembering_from(1000) == 969  # back 4, 8, 16, then 32 positions
    assert js.deleted == len(js.made)  # no consumer left behind


async def test_a_restored_follower_of_few_messages_or_unable_to_count_them_reads_the_stream_from_its_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(follower, "REMEMBERED_ENVELOPES", 4)
    assert await restored_follower(Counting([5, 500]))._remembering_from(1000) == 1
    assert await restored_follower(Counting([], unreachable=True))._remembering_from(1000) == 1
