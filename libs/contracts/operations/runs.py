"""A job's run as the monitor keeps it: processes, metric series, and debug terminals into it (SPEC R2, J15).

Each operation is declared below its request and reply (`base.Operation`).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from libs.contracts.operations.base import ReplyMessage, RequestMessage, people_operation


class GetRun(RequestMessage, frozen=True, tag="GetRun.v1"):
    """R2: a job's run: its series (each name per task and rank) with their last, least and greatest
    values, its configuration and summary."""

    job_id: str


class SeriesView(Struct, frozen=True, kw_only=True):
    """One series of a run: a name logged by one rank of one task."""

    name: str
    task: int
    rank: int
    count: int
    last: float
    least: float
    greatest: float
    last_step: int | None = None
    last_at: datetime | None = None


class RankEnd(Struct, frozen=True, kw_only=True):
    """R1: one rank's process group of an attempt ended (`exit_code` None: given up on with its node)."""

    attempt: int
    task: int
    rank: int
    node: str
    exit_code: int | None
    ended_at: datetime


class ProcessView(Struct, frozen=True, kw_only=True):
    """R1: one process that logged into a run (`process`: its label), and when it finished its logging
    (`run.finish()`), if it did."""

    attempt: int
    task: int
    rank: int
    node: str
    process: str
    points: int
    finished_at: datetime | None = None


RunState = Literal["waiting", "running", "finished"]


class RunView(ReplyMessage, frozen=True, tag="RunView.v1"):
    """R1, R2: a job's run: its life (it began with the job's first process, each later attempt continued
    it, its primary finished it), the ranks that ended, and what its processes logged."""

    job_id: str
    series: list[SeriesView]
    config: dict[str, Any] = msgspec.field(default_factory=dict)
    summary: dict[str, Any] = msgspec.field(default_factory=dict)
    state: RunState = "waiting"
    began_at: datetime | None = None
    attempts: list[int] = msgspec.field(default_factory=list)
    finished_at: datetime | None = None
    finished_by: str | None = None
    ended: list[RankEnd] = msgspec.field(default_factory=list)
    processes: list[ProcessView] = msgspec.field(default_factory=list)


# Points in one page of a series: a page of points with the longest process labels and node names stays under
# NATS's default max payload (1 MiB), as tests/unit/test_run_charts.py checks.
MAX_SERIES_PAGE = 4_000


class GetSeries(RequestMessage, frozen=True, tag="GetSeries.v1"):
    """R2: the points of series `name` of a job's run, of one `rank` (None: every rank), in the order they
    were logged, after position `after` in the run's stream (0: from the first), at most `limit` (or one
    agent's batch, when that holds more); asking again with the reply's `next_after` goes on."""

    job_id: str
    name: Annotated[str, Meta(max_length=128)]
    rank: Annotated[int, Meta(ge=0)] | None = None
    after: Annotated[int, Meta(ge=0)] = 0
    limit: Annotated[int, Meta(ge=1, le=MAX_SERIES_PAGE)] = MAX_SERIES_PAGE


class SeriesPoint(Struct, frozen=True, kw_only=True, array_like=True):
    """One value of a series, with who logged it (the task, rank, attempt, process and node): `process` and its
    line number `seq` name the point, so a reader paging through a series takes a point the agent published
    twice (after a restart) once."""

    rank: int
    step: int | None
    value: float
    at: datetime
    task: int = 0
    attempt: int = 1
    process: str = ""
    seq: int = 0
    node: str = ""


class PointsOnce:
    """Passes each point of a series once while its pages are read: a point its agent published twice (after a
    restart) may come again on a later page, and is known by its process and line number."""

    def __init__(self) -> None:
        self._taken: dict[tuple[int, int, int, str], int] = {}  # each process's last line number passed

    def first_time(self, point: SeriesPoint) -> bool:
        key = (point.attempt, point.task, point.rank, point.process)
        if point.seq and point.seq <= self._taken.get(key, 0):
            return False
        self._taken[key] = point.seq
        return True

    def fresh(self, points: Iterable[SeriesPoint]) -> list[SeriesPoint]:
        return [point for point in points if self.first_time(point)]


class SeriesPage(ReplyMessage, frozen=True, tag="SeriesPage.v1"):
    points: list[SeriesPoint]
    next_after: int
    more: bool = False


class OpenTerminal(RequestMessage, frozen=True, tag="OpenTerminal.v1"):
    """J15: open a debug session in a kept environment of a job (needs read-write access). Without
    `node`, the master's node; without `command`, an interactive shell.

    `session_id` (32 hex digits from a secure random source) is chosen by the client, so that it can
    listen to its own session's subjects before it asks, and to no one else's; without it the
    monitor makes one."""

    job_id: str
    node: str | None = None
    command: str | None = None
    columns: int = 80
    rows: int = 24
    session_id: Annotated[str, Meta(pattern=r"^[0-9a-f]{32}\Z")] | None = None


class TerminalOpened(ReplyMessage, frozen=True, tag="TerminalOpened.v1"):
    """J15: the session is open on `node`; talk to it on `subjects.session(node, owner, session_id, ...)`,
    `owner` being the caller's own NATS user (libs.natsroles.user_nats_name)."""

    session_id: str
    node: str
    rank: int
    attempt: int


# --- operations ------------------------------------------------------------------------------------

GET_RUN = people_operation(
    "get-run", "trainyard.query.runs.get", GetRun, RunView, "monitor", changes_state=False,
    summary="A job's run: its processes, series and how each rank ended.")
GET_SERIES = people_operation(
    "get-series", "trainyard.query.runs.series", GetSeries, SeriesPage, "monitor", changes_state=False,
    summary="A page of one metric series of a run.")
OPEN_TERMINAL = people_operation(
    "open-terminal", "trainyard.cmd.jobs.terminal", OpenTerminal, TerminalOpened, "monitor", changes_state=True,
    summary="Open a debug terminal inside a running job.")
