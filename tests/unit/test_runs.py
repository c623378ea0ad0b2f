"""Logging metrics from a job (SPEC R1): `trainyard.run` in the job's processes, the agent's relay of their
lines to JetStream. Every point is published once, in each process's order, named by who logged it;
nothing is lost when the agent restarts, and a malformed line changes nothing."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from agent.output.runs import RunRelay, remove_run_folder, socket_path
from client.cli.render import series_rows
from libs.contracts.runs import MAX_POINTS_PER_BATCH, MetricBatch, MetricPoint
from services.monitor.runs.reader import ProcessKey, RunIndex, page_points
from trainyard.run import Run


@pytest.fixture(autouse=True)
def run_folder(tmp_path: Path) -> Iterator[None]:
    yield
    remove_run_folder(tmp_path)  # as the agent does once a rank's environment is gone


class Published:
    def __init__(self) -> None:
        self.batches: list[tuple[MetricBatch, str]] = []

    async def __call__(self, batch: MetricBatch, msg_id: str) -> None:
        self.batches.append((batch, msg_id))

    def points(self) -> list[tuple[str, int, str, float, int | None]]:
        return [(b.process, p.seq, p.name, p.value, p.step) for b, _ in self.batches for p in b.points]


async def started_relay(folder: Path, published: Published) -> RunRelay:
    """A rank's relay, listening (again, for a folder that had one: as the next agent does)."""
    relay = RunRelay(job_id="job-0123456789ab", attempt=2, task=0, rank=1, node="node-a", path=socket_path(folder),
                     publish=published)
    await relay.start()
    return relay


async def flushed(run: Run, relay: RunRelay, timeout: float = 60.0) -> None:
    """Until the agent took every line the process kept."""
    async with asyncio.timeout(timeout):
        while not await asyncio.to_thread(run.flush, 0.05) and run.waiting:
            await relay.flush()


async def test_a_processs_points_are_published_once_in_order_and_named_by_who_logged_them(tmp_path: Path) -> None:
    published = Published()
    relay = await started_relay(tmp_path, published)
    run = Run(path=str(relay.path), process="trainer")
    run.log({"loss": 0.5, "acc": 0.25}, step=1)
    run.log({"loss": 0.4}, step=2)
    run.log({"loss": float("nan")}, step=3)  # not a number: not stored
    run.config({"lr": 0.001, "optimizer": "adam"})
    run.summary({"best": 0.4})
    await flushed(run, relay)
    run.close()
    await relay.close()

    assert published.points() == [("trainer", 1, "loss", 0.5, 1), ("trainer", 1, "acc", 0.25, 1),
                                   ("trainer", 2, "loss", 0.4, 2)]
    batch, msg_id = published.batches[0]
    assert (batch.job_id, batch.attempt, batch.task, batch.rank, batch.node) == ("job-0123456789ab", 2, 0, 1, "node-a")
    assert msg_id.startswith("job-0123456789ab.2.0.1.trainer.1-")
    assert {k: v for b, _ in published.batches for k, v in b.config.items()} == {"lr": 0.001, "optimizer": "adam"}
    assert {k: v for b, _ in published.batches for k, v in b.summary.items()} == {"best": 0.4}


async def test_a_line_sent_again_is_taken_once_and_a_malformed_one_changes_nothing(tmp_path: Path) -> None:
    published = Published()
    relay = await started_relay(tmp_path, published)
    line = json.dumps({"type": "log", "process": "p", "seq": 1, "at": "2026-11-25T12:00:00Z", "values": {"x": 1}})
    forged = json.dumps({"type": "log", "process": "../../etc", "seq": 2, "at": "2026-11-25T12:00:00Z",
                         "values": {"x": 2}})

    def send() -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(relay.path))
            client.sendall(f"{line}\n{line}\nnot json\n{forged}\n".encode())
            client.settimeout(10)
            return client.recv(4096)  # the acknowledgement

    ack = await asyncio.gather(asyncio.to_thread(send), relay.flush())
    await relay.close()
    assert published.points() == [("p", 1, "x", 1.0, None)]
    assert json.loads(ack[0].splitlines()[0]) == {"type": "ack", "process": "p", "seq": 1}
    assert relay.refused == 2


async def test_nothing_is_lost_or_doubled_when_the_agent_restarts_under_a_logging_process(tmp_path: Path) -> None:
    published = Published()
    relay = await started_relay(tmp_path, published)
    run = Run(path=str(relay.path), process="trainer")
    for step in range(50):
        run.log({"loss": 1.0 / (step + 1)}, step=step)
    await flushed(run, relay)
    await relay.close()  # the agent goes away; the job logs on
    for step in range(50, 120):
        run.log({"loss": 1.0 / (step + 1)}, step=step)
    assert not run.flush(timeout=0.3)
    again = await started_relay(tmp_path, published)  # the next agent, on the same socket
    await flushed(run, again)
    run.close()
    await again.close()
    assert [step for _, _, _, _, step in published.points()] == list(range(120))
    assert run.dropped == 0


def test_a_bad_name_or_step_is_refused_in_the_job_and_outside_trainyard_logging_does_nothing() -> None:
    outside = Run(path=None, process="solo")
    outside.path = None
    with pytest.raises(ValueError, match="not a metric name"):
        outside.log({"bad name": 1.0})
    with pytest.raises(ValueError, match="step"):
        outside.log({"loss": 1.0}, step=-1)
    outside.log({"loss": 1.0}, step=1)  # no socket: nothing to send to, and nothing fails
    assert outside.flush(timeout=0.1)


async def test_a_batch_holds_at_most_the_limit_of_points(tmp_path: Path) -> None:
    published = Published()
    relay = await started_relay(tmp_path, published)
    run = Run(path=str(relay.path), process="wide")
    for step in range(10):
        run.log({f"m{i}": float(i) for i in range(300)}, step=step)  # two lines each: 256 and 44 values
    await flushed(run, relay)
    run.close()
    await relay.close()
    assert len(published.points()) == 3000
    assert all(len(batch.points) <= MAX_POINTS_PER_BATCH for batch, _ in published.batches)


# --- the run as the monitor reads it (R2) ---------------------------------------------------------------------


def batch(rank: int, process: str, points: list[tuple[int, str, float, int]], attempt: int = 1,
          config: dict[str, float] | None = None) -> MetricBatch:
    at = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
    return MetricBatch(job_id="job-0123456789ab", attempt=attempt, task=0, rank=rank, node="node-a", process=process,
                       points=[MetricPoint(seq=seq, name=name, value=value, at=at, step=step)
                               for seq, name, value, step in points], config=dict(config or {}))


def test_a_run_takes_each_point_once_and_keeps_each_series_per_rank() -> None:
    index = RunIndex()
    index.fold(batch(0, "pid-1", [(1, "loss", 0.9, 0), (2, "loss", 0.5, 1)], config={"lr": 0.1}))
    index.fold(batch(0, "pid-1", [(2, "loss", 0.5, 1), (3, "loss", 0.7, 2)]))  # line 2 sent again
    index.fold(batch(1, "pid-7", [(1, "loss", 0.8, 0)]))
    index.fold(batch(0, "pid-9", [(1, "loss", 0.4, 3)], attempt=2))  # a restarted attempt goes on
    view = index.view("job-0123456789ab")
    rank0, rank1 = view.series
    assert (rank0.rank, rank0.count, rank0.last, rank0.least, rank0.greatest, rank0.last_step) == (0, 4, 0.4, 0.4,
                                                                                                   0.9, 3)
    assert (rank1.rank, rank1.count, rank1.last) == (1, 1, 0.8)
    assert view.config == {"lr": 0.1}
    taken: dict[ProcessKey, int] = {}
    values = [p.value for b in (batch(0, "pid-1", [(1, "loss", 0.9, 0), (2, "acc", 0.1, 0)]),
                                batch(0, "pid-1", [(1, "loss", 0.9, 0)]), batch(1, "pid-7", [(1, "loss", 0.8, 0)]))
              for p in page_points(b, taken, "loss", 0)]
    assert values == [0.9]


def test_the_series_table_shows_rank_0_and_the_figures_across_ranks() -> None:
    index = RunIndex()
    for rank, last in ((0, 0.2), (1, 0.4)):
        index.fold(batch(rank, f"pid-{rank}", [(1, "loss", 1.0, 0), (2, "loss", last, 1)]))
    rows = series_rows(index.view("job-0123456789ab").series, all_ranks=False)
    assert rows == [("loss", "0", "0", "2", "0.2", "0.2", "1", "1"),
                    ("loss", "0", "all 2", "4", "0.3 (mean)", "0.2", "1", "-")]
    assert len(series_rows(index.view("job-0123456789ab").series, all_ranks=True)) == 3


async def test_the_agent_s_samples_of_a_rank_are_its_system_series_and_go_on_after_an_agent_restart(
        tmp_path: Path) -> None:
    published = Published()
    relay = await started_relay(tmp_path, published)
    t0 = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
    relay.system({"cpu_percent": 180.0, "memory_mib": 2048.0}, t0)
    relay.system({"cpu_percent": 190.0, "memory_mib": 2050.0}, t0)  # the same sample again: taken once
    await relay.close()
    again = await started_relay(tmp_path, published)  # the next agent samples on
    again.system({"cpu_percent": 120.0, "memory_mib": 2100.0}, t0 + timedelta(seconds=2))
    await again.close()

    index = RunIndex()
    for batch, _ in published.batches:
        assert batch.process == "system"
        index.fold(batch)
    view = index.view("job-0123456789ab")
    cpu = next(s for s in view.series if s.name == "system/cpu_percent")
    assert (cpu.rank, cpu.count, cpu.last, cpu.greatest) == (1, 2, 120.0, 180.0)


async def test_a_process_that_finishes_records_its_own_end_and_logs_no_more(tmp_path: Path) -> None:
    published = Published()
    relay = await started_relay(tmp_path, published)
    worker = Run(path=str(relay.path), process="worker")
    worker.log({"loss": 0.5}, step=1)
    finishing = asyncio.create_task(asyncio.to_thread(worker.finish, 60.0))
    async with asyncio.timeout(60):
        while not finishing.done():
            await relay.flush()
            await asyncio.sleep(0.02)
    assert finishing.result()  # everything it logged was taken
    worker.log({"loss": 0.1}, step=2)  # after its finish: not sent
    await relay.close()

    index = RunIndex()
    for batch, _ in published.batches:
        index.fold(batch)
    view = index.view("job-0123456789ab")
    [process] = view.processes
    assert (process.process, process.rank, process.points) == ("worker", 1, 1)
    assert process.finished_at is not None
    assert [s.count for s in view.series] == [1]


async def test_lines_dropped_while_the_agent_was_away_are_counted_into_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules["trainyard.run"], "MAX_PENDING", 5)  # `trainyard.run` names the object too
    run = Run(path=str(socket_path(tmp_path)), process="trainer")  # no agent listens yet
    for step in range(20):
        run.log({"loss": float(step)}, step=step)
    assert run.dropped == 15 and run.waiting == 5
    published = Published()
    relay = await started_relay(tmp_path, published)  # the agent comes
    await flushed(run, relay)
    assert not run.close()  # not every line logged was taken
    await relay.close()
    points = published.points()
    assert [step for _, _, name, _, step in points if name == "loss"] == list(range(15, 20))  # the newest kept
    assert [value for _, _, name, value, _ in points if name == "trainyard/dropped_lines"] == [15.0]


async def test_a_process_logging_faster_than_its_agent_relays_drops_only_what_it_never_sent_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules["trainyard.run"], "MAX_PENDING", 300)

    class Slow(Published):
        async def __call__(self, batch: MetricBatch, msg_id: str) -> None:
            await asyncio.sleep(0.05)  # JetStream far slower than the job logs
            await super().__call__(batch, msg_id)

    published = Slow()
    relay = await started_relay(tmp_path, published)
    run = Run(path=str(relay.path), process="trainer")
    for step in range(20_000):
        run.log({"loss": float(step)}, step=step)
    await flushed(run, relay, timeout=60)
    assert not run.close() and run.dropped > 0
    await relay.close()
    points = published.points()
    steps = [step for _, _, name, _, step in points if name == "loss" and step is not None]
    assert steps == sorted(set(steps)) and steps[-1] == 19_999  # in order, once each, the newest kept
    assert len(steps) == 20_000 - run.dropped  # what was not stored is exactly what was counted dropped
    reported = [value for _, _, name, value, _ in points if name == "trainyard/dropped_lines"]
    assert reported and reported == sorted(reported) and reported[-1] <= run.dropped


async def test_a_process_that_first_logs_while_a_batch_is_published_is_published_too(tmp_path: Path) -> None:
    relay: RunRelay

    class Joining(Published):
        async def __call__(self, batch: MetricBatch, msg_id: str) -> None:
            if not self.batches:  # a second process's first line arrives while the first batch goes out
                relay.system({"cpu_percent": 50.0}, datetime(2026, 11, 27, tzinfo=UTC))
            await asyncio.sleep(0)
            await super().__call__(batch, msg_id)

    published = Joining()
    relay = await started_relay(tmp_path, published)
    run = Run(path=str(relay.path), process="trainer")
    run.log({"loss": 0.5}, step=1)
    await flushed(run, relay)
    await relay.close()
    assert {(process, name) for process, _, name, _, _ in published.points()} == {
        ("trainer", "loss"), ("system", "system/cpu_percent")}
