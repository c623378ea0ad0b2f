"""The launcher's starts (L1): every start due for a node at once goes in one request to its agent, signed once and
answered start by start; a start is sent again until its rank is reported started. (That each start carries its job's
trace, which the agent continues, is tested end to end: tests/e2e/test_traces.py.)

The launcher runs on an in-memory event log with fake agents (tests/support/launcher.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from libs.contracts.agent import (
    MAX_STARTS_PER_REQUEST,
    ProcessAccepted,
    ProcessStarted,
    StartProcesses,
    StartRefused,
    StartsAnswered,
)
from services.launcher import dispatcher as launcher_dispatcher
from tests.support.launcher import Site
from tests.support.platform import plain_spec


@pytest.fixture
def site(monkeypatch: pytest.MonkeyPatch) -> Site:
    return Site(monkeypatch)


async def admit(site: Site, job_id: str, node: str) -> None:
    await site.admit(plain_spec(1), [node], job_id=job_id)


def requests_of_starts(site: Site) -> list[tuple[str, list[tuple[str, int]]]]:
    """Each request of starts sent: its node, and the (job, rank) of each start in it."""
    return [(subject.split(".")[2], [(item.start.job_id, item.start.launch.rank) for item in request.starts])
            for subject, request, _ in site.agents.calls if isinstance(request, StartProcesses)]


async def test_the_starts_due_for_a_node_go_in_one_request(site: Site) -> None:
    for job_id, node in (("job-00000000000a", "n1"), ("job-00000000000b", "n1"), ("job-00000000000c", "n2")):
        await admit(site, job_id, node)
    await site.dispatch()

    sent = sorted(requests_of_starts(site))
    assert sent == [("n1", [("job-00000000000a", 0), ("job-00000000000b", 0)]), ("n2", [("job-00000000000c", 0)])]


async def test_more_starts_than_a_request_holds_go_in_several(site: Site) -> None:
    jobs = [f"job-{n:012x}" for n in range(MAX_STARTS_PER_REQUEST + 3)]
    for job_id in jobs:
        await admit(site, job_id, "n1")
    await site.dispatch()

    sizes = [len(starts) for _, starts in requests_of_starts(site)]
    assert sorted(sizes) == [3, MAX_STARTS_PER_REQUEST]
    assert sorted(job for _, starts in requests_of_starts(site) for job, _ in starts) == jobs


async def test_a_start_refused_is_sent_again_until_reported_and_one_reported_is_not(
        site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    async def refusing_b(nc: object, subject: str, request: Any, **kwargs: Any) -> Any:
        if not isinstance(request, StartProcesses):
            return await site.agents(nc, subject, request, **kwargs)
        site.agents.calls.append((subject, request, kwargs["timeout"]))
        return StartsAnswered(answers=[
            StartRefused(code="unavailable", message="busy") if item.start.job_id.endswith("b")
            else ProcessAccepted(already_known=False) for item in request.starts])

    monkeypatch.setattr(launcher_dispatcher, "call", refusing_b)
    await admit(site, "job-00000000000a", "n1")
    await admit(site, "job-00000000000b", "n1")
    await site.dispatch()
    assert requests_of_starts(site) == [("n1", [("job-00000000000a", 0), ("job-00000000000b", 0)])]

    site.agents.calls.clear()
    site.clock[0] += launcher_dispatcher.RESEND_SECONDS / 2  # neither is due again yet
    await site.launcher.dispatcher.dispatch_once()
    assert requests_of_starts(site) == []
    await site.report(ProcessStarted(job_id="job-00000000000a", attempt=1, rank=0, node="n1", pid=100))
    await site.dispatch()
    assert requests_of_starts(site) == [("n1", [("job-00000000000b", 0)])]
