"""`trainyard tensorboard` (R2, O5) without a stack: event files written from a run's points, read back as
TensorBoard reads them, and the real TensorBoard serving them over HTTP."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from typer.testing import CliRunner

from client import cli
from client.api import TrainyardError
from client.tensorboard import (
    EVENT_FILE_PREFIX,
    NoMetrics,
    ReadProgress,
    TensorBoard,
    TensorBoardFailed,
    answers,
    write_points,
    write_run,
)
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.runs import RunView, SeriesPoint, SeriesView

if TYPE_CHECKING:
    from client.api import TrainyardClient

START = datetime(2026, 11, 21, 13, 40, tzinfo=UTC)


def point(rank: int, step: int | None, value: float, *, attempt: int = 1, task: int = 0,
          second: int = 0) -> SeriesPoint:
    return SeriesPoint(rank=rank, step=step, value=value, at=START + timedelta(seconds=second), task=task,
                       attempt=attempt, process="pid-1", seq=second)


def scalars(run: Path, tag: str) -> list[tuple[int, float]]:
    """The (step, value) pairs of `tag` as TensorBoard's event accumulator reads the run's directory."""
    accumulator = EventAccumulator(str(run))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def event_file(run: Path) -> Path:
    [found] = run.glob(f"{EVENT_FILE_PREFIX}*")  # one writer, one file
    return found


def written_steps(run: Path) -> list[tuple[int, str]]:
    """(step, tag) of every scalar in the order the run's event file holds them."""
    return [(event.step, value.tag) for event in EventFileLoader(str(event_file(run))).Load()
            for value in event.summary.value]


# A resumed job: attempt 1 logs steps 1 to 5, its rank 0's points arriving out of step order (two of
# its processes log), and attempt 2 starts again from the checkpoint of step 3.
RESUMED = [
    point(0, 2, 0.5, second=2), point(0, 1, 1.0, second=1), point(1, 2, 0.75, second=2),
    point(1, 1, 1.5, second=1), point(0, 3, 0.25, second=3), point(0, 5, 0.125, second=5),
    point(0, 4, 0.375, second=4),
    point(0, 4, 4.0, attempt=2, second=60), point(0, 5, 5.0, attempt=2, second=61), point(0, 6, 6.0, attempt=2,
                                                                                        second=62),
]


def test_each_rank_is_a_run_in_step_order_holding_the_latest_attempts_value_of_each_step(tmp_path: Path) -> None:
    written = write_points(tmp_path, {"loss": RESUMED}, batch=False)

    assert [run.name for run in written] == ["rank-0", "rank-1"]
    assert scalars(tmp_path / "rank-0", "loss") == [(1, 1.0), (2, 0.5), (3, 0.25), (4, 4.0), (5, 5.0), (6, 6.0)]
    assert scalars(tmp_path / "rank-1", "loss") == [(1, 1.5), (2, 0.75)]
    [loss] = written[0].series
    assert (loss.steps, loss.first_step, loss.last_step, loss.replaced) == (6, 1, 6, 2)
    # A scalar's time is when it was logged: step 4's is the resumed attempt's.
    accumulator = EventAccumulator(str(tmp_path / "rank-0"))
    accumulator.Reload()
    assert [event.wall_time for event in accumulator.Scalars("loss")][3] == (START + timedelta(seconds=60)).timestamp()


def test_points_without_a_step_are_numbered_in_the_order_they_were_logged(tmp_path: Path) -> None:
    accuracy = [point(0, None, 0.5, second=1), point(0, None, 0.75, second=2), point(0, None, 0.875, second=3)]
    write_points(tmp_path, {"loss": RESUMED, "eval/acc": accuracy}, batch=False)

    assert scalars(tmp_path / "rank-0", "eval/acc") == [(0, 0.5), (1, 0.75), (2, 0.875)]
    # One writer wrote the whole run, every series merged in step order: nothing for TensorBoard to purge.
    assert written_steps(tmp_path / "rank-0") == [(0, "eval/acc"), (1, "eval/acc"), (1, "loss"), (2, "eval/acc"),
                                                   (2, "loss"), (3, "loss"), (4, "loss"), (5, "loss"), (6, "loss")]


def test_a_batch_job_has_a_run_per_task_and_rank(tmp_path: Path) -> None:
    points = [point(0, step, task + step / 4, task=task, second=task * 10 + step) for task in range(3)
              for step in (1, 2)]
    written = write_points(tmp_path, {"loss": points}, batch=True)

    assert [run.name for run in written] == ["task-0/rank-0", "task-1/rank-0", "task-2/rank-0"]
    assert scalars(tmp_path / "task-2" / "rank-0", "loss") == [(1, 2.25), (2, 2.5)]


def test_writing_a_run_again_replaces_it(tmp_path: Path) -> None:
    write_points(tmp_path, {"loss": [point(0, 1, 1.0), point(0, 2, 2.0)]}, batch=False)
    earlier = event_file(tmp_path / "rank-0")
    earlier.rename(earlier.with_name(f"{EVENT_FILE_PREFIX}1700000000.elsewhere"))  # as written an hour ago
    write_points(tmp_path, {"loss": [point(0, 1, 8.0)]}, batch=False)

    assert scalars(tmp_path / "rank-0", "loss") == [(1, 8.0)]
    assert event_file(tmp_path / "rank-0").name != f"{EVENT_FILE_PREFIX}1700000000.elsewhere"


class FakeClient:
    """Stands in for TrainyardClient with a run's points: answers `run`, `get_job` and `series` (whose rank
    filter is the monitor's)."""

    def __init__(self, points: dict[str, list[SeriesPoint]], *, job_type: str = "regular") -> None:
        self.points = points
        self.job_type = job_type
        self.asked_ranks: list[int | None] = []

    async def run(self, job_id: str) -> RunView:
        keys = sorted({(name, p.task, p.rank) for name, points in self.points.items() for p in points})
        return RunView(job_id=job_id, series=[SeriesView(name=name, task=task, rank=rank, count=1, last=0.0,
                                                         least=0.0, greatest=0.0) for name, task, rank in keys])

    async def get_job(self, job_id: str) -> Any:
        return SimpleNamespace(spec=SimpleNamespace(type=self.job_type))

    async def series(self, job_id: str, name: str, rank: int | None = 0) -> AsyncIterator[SeriesPoint]:
        self.asked_ranks.append(rank)
        for found in self.points.get(name, []):
            if rank is None or found.rank == rank:
                yield found

    async def close(self) -> None:
        pass


def as_client(fake: FakeClient) -> TrainyardClient:
    return cast("TrainyardClient", fake)


async def test_rank_0_alone_is_written_unless_every_rank_is_asked_for(tmp_path: Path) -> None:
    fake = FakeClient({"loss": RESUMED})
    read: list[ReadProgress] = []

    written = await write_run(as_client(fake), "job-00000000000a", tmp_path / "rank0", progress=read.append)
    assert [run.name for run in written] == ["rank-0"]
    assert not (tmp_path / "rank0" / "rank-1").exists()
    assert (read[-1].series_done, read[-1].series_total, read[-1].points) == (1, 1, 8)

    every = await write_run(as_client(fake), "job-00000000000a", tmp_path / "all", all_ranks=True)
    assert [run.name for run in every] == ["rank-0", "rank-1"]
    assert scalars(tmp_path / "all" / "rank-1", "loss") == [(1, 1.5), (2, 0.75)]


async def test_a_run_with_nothing_to_write_says_so(tmp_path: Path) -> None:
    with pytest.raises(NoMetrics) as empty:
        await write_run(as_client(FakeClient({})), "job-00000000000a", tmp_path)
    assert not empty.value.other_ranks
    with pytest.raises(NoMetrics) as others:
        await write_run(as_client(FakeClient({"loss": [point(1, 1, 1.0)]})), "job-00000000000a", tmp_path)
    assert others.value.other_ranks
    assert list(tmp_path.iterdir()) == []


def use_client(monkeypatch: pytest.MonkeyPatch, fake: FakeClient) -> None:
    class Factory:
        @staticmethod
        async def open() -> FakeClient:
            return fake

    monkeypatch.setattr(cli, "TrainyardClient", Factory)


def test_the_command_tells_how_a_job_logs_when_it_logged_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    use_client(monkeypatch, FakeClient({}))
    result = CliRunner().invoke(cli.app, ["tensorboard", "job-00000000000a"])

    assert result.exit_code == 1
    assert "job-00000000000a has logged no metrics" in result.output
    assert "from trainyard import run; run.log(" in result.output


class Forbidden(FakeClient):
    async def run(self, job_id: str) -> RunView:
        raise TrainyardError(CommandError(code="forbidden", message=f"you may not read {job_id}"))


def test_the_command_says_when_the_run_may_not_be_read(monkeypatch: pytest.MonkeyPatch) -> None:
    use_client(monkeypatch, Forbidden({}))
    result = CliRunner().invoke(cli.app, ["tensorboard", "job-00000000000a"])

    assert result.exit_code == 1
    assert "error: you may not read job-00000000000a" in result.output
    assert "share it with your project" in result.output  # what to do about it


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as reply:
        return json.loads(reply.read())


def wait_for_runs(url: str, count: int, timeout: float = 120.0) -> list[str]:
    """TensorBoard's runs once it lists `count` (it loads the folder after it starts answering)."""
    deadline = time.monotonic() + timeout
    while True:
        runs: list[str] = get_json(f"{url}data/runs")
        if len(runs) >= count or time.monotonic() > deadline:
            return runs
        time.sleep(0.3)


def test_tensorboard_serves_the_written_runs_and_stops(tmp_path: Path) -> None:
    write_points(tmp_path, {"loss": RESUMED}, batch=False)

    with TensorBoard(tmp_path, port=0, title="a test run") as server:  # port 0: a free one
        assert server.url.startswith("http://127.0.0.1:")
        assert sorted(wait_for_runs(server.url, 2)) == ["rank-0", "rank-1"]
        tags = get_json(f"{server.url}data/plugin/scalars/tags")
        assert {run: sorted(found) for run, found in tags.items()} == {"rank-0": ["loss"], "rank-1": ["loss"]}
        values = get_json(f"{server.url}data/plugin/scalars/scalars?run=rank-0&tag=loss")
        assert [(step, value) for _, step, value in values] == [(1, 1.0), (2, 0.5), (3, 0.25), (4, 4.0), (5, 5.0),
                                                                (6, 6.0)]
    assert not answers(server.url)
    assert server.pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(server.pid, 0)  # ended and reaped


def test_a_tensorboard_that_cannot_start_says_why(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = TensorBoard(tmp_path, port=taken.getsockname()[1])
        with pytest.raises(TensorBoardFailed, match=r"could not bind to port \d+, it was already in use"):
            server.start()
    assert server.pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(server.pid, 0)  # nothing left running
