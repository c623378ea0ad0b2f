"""Prometheus scraping a running stack: what an operator's dashboard and alerts read (deploy/prometheus/)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from client.api import TrainyardClient
from devstack.ops import metrics_env, prometheus_binary, start_prometheus
from devstack.servers import free_port
from tests.support.specs import sleeper
from tests.support.stack import Stack

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e,
              pytest.mark.skipif(prometheus_binary() is None,
                                 reason="Prometheus is not installed (deploy/local/system-packages.sh installs it)")]
TEST_ALGORITHMS = Path(__file__).parent / "algorithms"


@pytest_asyncio.fixture(loop_scope="session")
async def watched(tmp_path: Path, database_url: str) -> AsyncIterator[tuple[Stack, str]]:
    """A stack whose every process serves its metrics, and a Prometheus scraping them, as `make up OPS=1` runs."""
    tmp_path.chmod(0o755)
    stack = Stack(tmp_path, None, database_url, connect=TrainyardClient.open, algorithms=TEST_ALGORITHMS,
                  env=metrics_env(tmp_path))
    prometheus = start_prometheus(stack.processes, free_port())
    yield stack, prometheus
    await stack.close()
    print(stack.dump_logs())


def query(prometheus: str, expression: str) -> list[dict[str, Any]]:
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expression})}"
    with urllib.request.urlopen(url, timeout=60) as answer:
        body = json.load(answer)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def value(prometheus: str, expression: str) -> float | None:
    """The single value of `expression` now (None: no series)."""
    found = query(prometheus, expression)
    return float(found[0]["value"][1]) if found else None


async def until(prometheus: str, expression: str, wanted: float, timeout: float = 180) -> None:
    """Wait until `expression` is `wanted` (scrapes every 5 s, gauges sampled every 5 s)."""
    deadline = time.monotonic() + timeout
    seen: float | None = None
    while time.monotonic() < deadline:
        seen = await asyncio.to_thread(value, prometheus, expression)
        if seen == wanted:
            return
        await asyncio.sleep(1)
    raise AssertionError(f"{expression} was {seen}, not {wanted}, after {timeout:g}s")


async def test_prometheus_reads_the_queue_admissions_nodes_and_requests_of_a_running_stack(
        watched: tuple[Stack, str]) -> None:
    stack, prometheus = watched
    api = await stack.up()
    await until(prometheus, 'count(up{service=~"scheduler|launcher|monitor|autoscaler|agent"} == 1)', 6)
    await until(prometheus, 'sum(trainyard_service_active{service="scheduler"})', 1)
    await until(prometheus, 'sum(trainyard_nodes{trainyard_node_state="up",trainyard_node_health="healthy"})', 2)

    # The first holds both nodes for a while; the second waits behind it.
    first = await api.submit(msgspec.structs.replace(sleeper("first", nodes=2, seconds=20), flavors=["cpu-2"]))
    await stack.wait_until(first.job_id, "running", timeout=60)
    second = await api.submit(msgspec.structs.replace(sleeper("second", nodes=2, seconds=1), flavors=["cpu-2"]))
    await until(prometheus, 'sum(trainyard_jobs_queued{trainyard_priority="normal",trainyard_flavor="cpu-2"})', 1)
    await until(prometheus, 'sum(trainyard_scheduler_admissions_total{trainyard_priority="normal"})', 1)
    await until(prometheus, 'sum(trainyard_jobs{trainyard_job_state="running"})', 1)

    for job in (first, second):
        assert (await stack.wait_until(job.job_id, "ended", timeout=120)).status == "succeeded"
    await until(prometheus, 'sum(trainyard_jobs{trainyard_job_state="succeeded"})', 2)
    await until(prometheus, "sum(trainyard_jobs_queued) or vector(0)", 0)
    await until(prometheus, "sum(trainyard_scheduler_admissions_total)", 2)
    # Each submission answered, and timed by its subject; the launcher's followers caught up, its relay too.
    await until(prometheus, 'sum(messaging_process_duration_seconds_count{messaging_destination_name='
                            '"trainyard.cmd.jobs.submit",error_type=""})', 2)
    await until(prometheus, 'sum(trainyard_follower_lag{service="launcher"})', 0)
    await until(prometheus, "sum(trainyard_outbox_lag)", 0)
    assert (await asyncio.to_thread(value, prometheus, 'sum(trainyard_follower_messages_total{service="launcher"})')
            or 0) > 0

    # No label names a job: a label of unbounded values would make a series of every job.
    series = await asyncio.to_thread(query, prometheus, '{__name__=~"trainyard_.*|messaging_.*"}')
    labels = {text for found in series for text in found["metric"].values()}
    assert not labels & {first.job_id, second.job_id}
