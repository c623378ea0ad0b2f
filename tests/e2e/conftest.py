"""Fixtures of the end-to-end tests: the whole stack (devstack/harness.py) per test, on the test
algorithms, and a mailbox for its alert mail."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from client.api import TrainyardClient
from devstack.harness import CLUSTER, FAST_TIMINGS
from tests.support.mailbox import Mailbox
from tests.support.stack import Stack

TEST_ALGORITHMS = Path(__file__).parent / "algorithms"


@pytest.fixture
def mailbox() -> Iterator[Mailbox]:
    box = Mailbox()
    box.controller.start()
    try:
        yield box
    finally:
        box.controller.stop()


@pytest_asyncio.fixture(loop_scope="session")
async def stack(tmp_path: Path, database_url: str, mailbox: Mailbox,
                request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    tmp_path.chmod(0o755)
    # A test marked `@pytest.mark.cluster(path)` runs on that cluster config instead of the local one.
    marker = request.node.get_closest_marker("cluster")
    # A test marked `slow_loss` has its nodes counted lost after 10 s of silence rather than 3: one whose agent
    # must be back in time, however busy the machine.
    timings = ({**FAST_TIMINGS, "TRAINYARD_NODE_LOST_SECONDS": "10"} if request.node.get_closest_marker("slow_loss")
               else None)
    # Each test's stack runs its own NATS server with a login per role, as `make up` does.
    platform = Stack(tmp_path, None, database_url, connect=TrainyardClient.open,
                     cluster=marker.args[0] if marker else CLUSTER, smtp_url=mailbox.url, algorithms=TEST_ALGORITHMS,
                     timings=timings)
    yield platform
    await platform.close()  # and the jobs its stopped agents left running
    # Shown by pytest only when the test failed.
    print(platform.dump_logs())
