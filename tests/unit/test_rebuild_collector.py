"""A rebuild pauses Python's cycle collector and leaves it as it found it, even when the rebuild fails: a
service whose collector stayed off would grow without bound."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from libs.skeleton.eventsourced import collector_paused


@pytest.fixture
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_the_collector_is_off_during_a_rebuild_and_on_after(collector_on: None) -> None:
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_failed_rebuild_turns_the_collector_back_on(collector_on: None) -> None:
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("the database went away")
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off(collector_on: None) -> None:
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()
    gc.enable()


def test_the_collector_comes_back_once_the_last_of_overlapping_pauses_ends(collector_on: None) -> None:
    """A plan in the planning thread and a past state's replay may pause it at once, ending in any order."""
    first, second = collector_paused(), collector_paused()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not gc.isenabled()  # the second still needs it off
    second.__exit__(None, None, None)
    assert gc.isenabled()

