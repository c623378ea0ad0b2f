"""`trainyard at TIME VIEW` and `trainyard simulate`: the instants are parsed at the edge, the ordinary views are
asked about the past instant, and a what-if's report is printed as tables."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import typer

from client.cli.params import past_instant
from libs.contracts.operations.jobs import JobList, JobView
from libs.contracts.operations.planning import (
    FlavorUse,
    MovedJob,
    PriorityWaits,
    SimulationPoint,
    SimulationProgress,
    SimulationReport,
)
from libs.contracts.scheduling import WhyReport
from tests.support.cli import FakeClient, fake, invoke, no_stack

__all__ = ["fake", "no_stack"]  # the fixtures, used by name

NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)


def test_a_time_ago_and_iso_times_name_one_instant() -> None:
    assert past_instant("-2h", now=NOW) == NOW - timedelta(hours=2)
    assert past_instant("-90s", now=NOW) == NOW - timedelta(seconds=90)
    assert past_instant("2026-11-27T03:00Z", now=NOW) == datetime(2026, 11, 27, 3, tzinfo=UTC)
    assert past_instant("2026-11-27T04:00+01:00", now=NOW) == datetime(2026, 11, 27, 3, tzinfo=UTC)
    local = datetime(2026, 11, 27, 3, 0).astimezone()  # no zone: the local time
    assert past_instant("2026-11-27T03:00", now=NOW) == local.astimezone(UTC)


@pytest.mark.parametrize(("text", "said"), [("-2 hours", "is not a time ago"), ("yesterday", "is not a time"),
                                            ("2999-01-01T00:00Z", "is in the future"), ("-0h", "is not a time ago")])
def test_what_is_not_a_past_instant_is_refused(text: str, said: str) -> None:
    with pytest.raises(typer.Exit):
        past_instant(text, now=NOW)
    result = invoke("at", text, "list")
    assert result.exit_code != 0 and said in result.output


def _waiting(job_id: str, position: int, submitted: datetime) -> JobView:
    return JobView(job_id=job_id, name="train", project="default", creator="alice", status="queued", priority="urgent",
                   mode="pytorch", nodes=2, flavors=["cpu-4"], submitted_at=submitted, queue_position=position)


def test_at_asks_the_view_about_the_instant_and_the_next_command_about_now(fake: FakeClient) -> None:
    seen: list[datetime | None] = []

    async def waiting(limit: int) -> JobList:
        seen.append(getattr(fake, "at", None))
        at = seen[-1]
        assert at is not None and limit == 1
        return JobList(jobs=[_waiting("job-000000000007", 1, at - timedelta(minutes=95))], waiting=3)

    async def why(job_id: str) -> WhyReport:
        seen.append(getattr(fake, "at", None))
        return WhyReport(job_id=job_id, status="queued", summary=[f"{job_id} is first in line."])

    fake.answers.update(waiting=waiting, why=why)
    result = invoke("at", "2026-11-27T03:00Z", "queue", "--limit", "1")
    assert result.exit_code == 0, result.output
    assert seen == [datetime(2026, 11, 27, 3, tzinfo=UTC)]
    assert "3 waiting (the first 1 shown)" in result.output
    row = next(line.split() for line in result.output.splitlines() if "job-000000000007" in line)
    assert row[:5] == ["1", "job-000000000007", "train", "urgent", "2"] and row[-5:] == ["1", "h", "35", "min", "-"]

    result = invoke("at", "-30m", "why", "job-000000000007")
    assert result.exit_code == 0, result.output
    assert "job-000000000007 is first in line." in result.output
    asked = seen[-1]
    assert asked is not None and abs(datetime.now(UTC) - timedelta(minutes=30) - asked) < timedelta(minutes=1)

    del fake.at  # a later command of the same process is about now again
    assert invoke("why", "job-000000000007").exit_code == 0
    assert seen[-1] is None


def _report() -> SimulationReport:
    start = datetime(2026, 11, 26, 6, tzinfo=UTC)
    return SimulationReport(
        start=start, end=start + timedelta(days=1), jobs=1412, nodes_real=8, nodes_simulated=10, cycles=5873,
        waits=[PriorityWaits(priority="urgent", jobs=96, real_p50=2.1, real_p95=840.0, simulated_p50=0.0,
                             simulated_p95=180.0)],
        makespan_real_seconds=86280.0, makespan_simulated_seconds=85260.0,
        utilization=[FlavorUse(flavor="cpu-2", real=0.8123, simulated=0.6544)], compared=1400, same_start=12,
        start_difference_p50=600.0, start_difference_p95=7200.0,
        moved=[MovedJob(job_id="job-000000000009", name="bert", priority="normal", submitted_at=start,
                        real_start=start + timedelta(hours=3), simulated_start=start + timedelta(hours=1))],
        series=[SimulationPoint(at=start, queued_real=3, queued_simulated=1, busy_real=0.5, busy_simulated=0.4),
                SimulationPoint(at=start + timedelta(days=1), queued_real=0, queued_simulated=0, busy_real=0.2,
                                busy_simulated=0.1)],
        notes=["The nodes are those known at the start or the end of the window, present throughout."])


def test_simulate_asks_for_the_window_and_changes_and_prints_the_report(fake: FakeClient, tmp_path: Path) -> None:
    async def simulate(*_: Any, on_progress: Callable[[SimulationProgress], None], **__: Any) -> SimulationReport:
        on_progress(SimulationProgress(stage="rebuilding", events=20_000))
        on_progress(SimulationProgress(stage="playing", played=0.5))
        return _report()

    fake.answers["simulate"] = simulate
    chart = tmp_path / "whatif.png"
    result = invoke("simulate", "--since", "1d", "--add-nodes", "cpu-2=2", "--add-nodes", "cpu-2=1",
                    "--remove-nodes", "gpu-1=1", "--depth", "500", "--png", str(chart))
    assert result.exit_code == 0, result.output
    (name, (start, end), changes), = fake.calls
    assert name == "simulate" and end is None
    assert abs(datetime.now(UTC) - timedelta(days=1) - start) < timedelta(minutes=1)
    assert {key: value for key, value in changes.items() if key != "on_progress"} == {
        "add_nodes": {"cpu-2": 3}, "remove_nodes": {"gpu-1": 1}, "depth": 500}
    lines = [line.split() for line in result.output.splitlines()]
    assert ["urgent", "96", "2.1", "s", "0.0", "s", "14", "min", "3", "min"] in lines
    assert ["cpu-2", "81.2%", "65.4%"] in lines
    assert "starts: 12 of 1,400 within a second of the real ones" in result.output
    assert any(line[:3] == ["job-000000000009", "bert", "normal"] and line[-2:] == ["h", "earlier"]
               for line in lines)
    assert chart.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(("args", "said"), [
    (["--since", "1d", "--from", "-2h"], "--since and --from both name the window's start"),
    (["--from", "-1h", "--to", "-2h"], "the window ends before it starts"),
    (["--add-nodes", "cpu-2"], "is not FLAVOR=N"),
    (["--remove-nodes", "cpu-2=0"], "is not FLAVOR=N"),
    (["--since", "a week"], "is not a duration"),
])
def test_simulate_refuses_a_bad_window_or_change_before_asking(fake: FakeClient, args: list[str], said: str) -> None:
    result = invoke("simulate", *args)
    assert result.exit_code != 0 and said in result.output
    assert fake.calls == []
