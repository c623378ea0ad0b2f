"""The ports a node chooses for a job's rendezvous (agent/ranks/tcp_ports.py): free on the node, the same for the same
attempt, never one port for two attempts on one host, and given up once the attempt is gone."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.ranks.tcp_ports import PortBook, PortRangeError, parse_range
from tests.support.strategies import SETTINGS

LIVE: set[tuple[str, int]] = set()


def free_port_run(length: int) -> int:
    """The first of `length` consecutive ports nothing on this machine holds, below the kernel's ephemeral
    range (no outgoing connection takes one meanwhile) and below the jobs' default range."""
    for low in range(20000, 29000, length):
        if all(_bindable(port) for port in range(low, low + length)):
            return low
    raise RuntimeError("no free port run")


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@pytest.fixture
def low() -> int:
    return free_port_run(8)


def book(claims: Path, low: int, size: int = 8) -> PortBook:
    return PortBook(low, low + size - 1, claims)


def test_a_node_answers_free_ports_and_the_same_ones_when_asked_again(tmp_path: Path, low: int) -> None:
    ports = book(tmp_path, low)
    first = ports.reserve(("job-1", 1), 2, now=0.0, live=LIVE)
    assert first == [low, low + 1]
    assert ports.reserve(("job-1", 1), 2, now=5.0, live=LIVE) == first
    assert ports.reserve(("job-2", 1), 1, now=5.0, live=LIVE) == [low + 2]
    assert ports.reserve(("job-1", 2), 1, now=5.0, live=LIVE) == [low + 3]  # a new attempt, new ports


@pytest.fixture
def listener(low: int) -> Iterator[socket.socket]:
    with socket.socket() as held:
        held.bind(("0.0.0.0", low))
        held.listen()
        yield held


def test_a_port_something_listens_on_is_passed_over(tmp_path: Path, low: int, listener: socket.socket) -> None:
    assert book(tmp_path, low).reserve(("job-1", 1), 1, now=0.0, live=LIVE) == [low + 1]


def test_agents_sharing_a_host_never_give_one_port_to_two_jobs(tmp_path: Path, low: int) -> None:
    a, b = book(tmp_path, low), book(tmp_path, low)
    assert a.reserve(("job-1", 1), 1, now=0.0, live=LIVE) == [low]
    assert b.reserve(("job-2", 1), 1, now=0.0, live=LIVE) == [low + 1]
    a.close()  # the agent went away: what it held is free for the others
    assert b.reserve(("job-3", 1), 8, now=0.0, live=LIVE) is None  # job-2 still holds one of the 8
    assert b.reserve(("job-3", 1), 7, now=0.0, live=LIVE) is not None


def test_ports_are_held_while_the_attempt_runs_and_given_up_after(tmp_path: Path, low: int) -> None:
    ports = book(tmp_path, low, size=2)
    assert ports.reserve(("job-1", 1), 2, now=0.0, live=LIVE) == [low, low + 1]
    later = ports.hold_seconds + 1
    assert ports.reserve(("job-2", 1), 1, now=later, live={("job-1", 1)}) is None  # job-1 runs here
    assert ports.reserve(("job-2", 1), 1, now=later, live=LIVE) is not None  # it ended


def test_ports_are_taken_in_turn_so_one_just_given_up_is_not_handed_out_at_once(tmp_path: Path, low: int) -> None:
    ports = book(tmp_path, low)
    assert ports.reserve(("job-1", 1), 1, now=0.0, live=LIVE) == [low]
    ports.release_unused(now=ports.hold_seconds, live=LIVE)
    assert ports.reserve(("job-2", 1), 1, now=ports.hold_seconds, live=LIVE) == [low + 1]


def test_a_restarted_agent_holds_again_the_port_of_a_job_it_adopts(tmp_path: Path, low: int) -> None:
    adopted, other = book(tmp_path, low), book(tmp_path, low)
    adopted.hold(("job-1", 1), [low], now=0.0)
    assert other.reserve(("job-2", 1), 1, now=0.0, live=LIVE) == [low + 1]


def test_a_full_range_is_answered_none(tmp_path: Path, low: int) -> None:
    ports = book(tmp_path, low, size=2)
    assert ports.reserve(("job-1", 1), 3, now=0.0, live=LIVE) is None
    assert ports.reserve(("job-1", 1), 2, now=0.0, live=LIVE) == [low, low + 1]  # nothing was kept of the try


@pytest.mark.parametrize("text", ["", "29500", "a-b", "100-200", "30000-29000", "29500-70000"])
def test_a_bad_port_range_is_refused_with_an_example(text: str) -> None:
    with pytest.raises(PortRangeError, match="TRAINYARD_JOB_PORTS"):
        parse_range(text)


def test_the_default_range_lies_below_the_kernels_ephemeral_ports() -> None:
    assert parse_range("29500-32767") == (29500, 32767)


@settings(SETTINGS, max_examples=60)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 4), st.integers(1, 3), st.booleans()),
                min_size=1, max_size=30))
def test_no_port_is_ever_held_for_two_attempts_on_one_host(tmp_path_factory: pytest.TempPathFactory,
                                                           steps: list[tuple[int, int, int, bool]]) -> None:
    """Three agents of one host reserve, run and end attempts in any order: at no time do two attempts hold
    one port, and an attempt asked again within the hold time gets the answer it got before."""
    low = free_port_run(12)
    claims = tmp_path_factory.mktemp("claims")
    agents = [book(claims, low, size=12) for _ in range(3)]
    answers: dict[tuple[str, int], tuple[list[int], float]] = {}
    now = 0.0
    try:
        for which, job, count, ended in steps:
            now += 30.0
            attempt = (f"job-{job}-on-{which}", 1)
            ports = agents[which].reserve(attempt, count, now=now, live=set() if ended else {attempt})
            before, at = answers.get(attempt, ([], -1e9))
            if ports is not None and len(before) == count and now - at < agents[which].hold_seconds:
                assert ports == before
            if ports is not None:
                answers[attempt] = (ports, now)
            held = [port for agent in agents for r in agent.reservations.values() for port in r.ports]
            assert len(held) == len(set(held))
    finally:
        for agent in agents:
            agent.close()
