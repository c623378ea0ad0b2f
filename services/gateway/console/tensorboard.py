"""Create TensorBoard (seed 001, 批量任务创建 TensorBoard): a job's run as TensorBoard event files, to download.

The dialog (GET /jobs/<job>/tensorboard) says what the download holds and how to open it, and that
`trainyard tensorboard JOB` serves the same run directly. The download (GET /jobs/<job>/tensorboard.zip) reads the
run as the signed-in person (get-run, then each series page by page), writes it with libs/tensorboard_files.py, a
run folder per task and rank exactly as the CLI writes them, and answers a zip of one folder to give TensorBoard as
its `--logdir`. Reading the run needs view access to the job (J2: read-only viewers may); the monitor decides again
on every page. A download is bounded: a run holding more points than MOST_POINTS is refused with what to do
instead, and at most MOST_BUILDS downloads are put together at once (the points are held in memory meanwhile).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Route

from libs.contracts.ids import is_job_id
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.jobs import GET_JOB, GetJob, JobDetails
from libs.contracts.operations.runs import GET_RUN, GET_SERIES, GetRun, GetSeries, PointsOnce, RunView, SeriesPage
from libs.tensorboard_files import (
    EVENT_FILE_PREFIX,
    RunCollector,
    names_to_read,
    points_to_read,
    write_collected,
)
from services.gateway.calls import Refused
from services.gateway.console.base import Console, job_grant, may
from services.gateway.console.i18n import N_
from services.gateway.problems import STATUS
from services.gateway.sessions import Session

# About 50 MB of event files, and a few hundred MB held while they are written: beyond it, the CLI (which writes
# on the person's own machine) is the way.
MOST_POINTS = 1_000_000
MOST_BUILDS = 2
# What a zipped event file is named after its prefix and time, in place of the gateway's host name.
WRITER_NAME = "trainyard"


@dataclass(frozen=True)
class Outline:
    """What a download of the run would hold: its series names, TensorBoard runs and points."""

    names: int
    runs: int
    points: int
    other_ranks: bool  # rank 0 logged nothing, other ranks did

    @classmethod
    def of(cls, view: RunView, *, all_ranks: bool) -> Outline:
        read = [series for series in view.series if all_ranks or series.rank == 0]
        return cls(names=len({series.name for series in read}),
                   runs=len({(series.task, series.rank) for series in read}),
                   points=points_to_read(view, all_ranks=all_ranks), other_ranks=not read and bool(view.series))


class TooLarge(Exception):
    def __init__(self, points: int) -> None:
        self.points = points
        super().__init__(f"{points} points")


def zipped_name(name: str) -> str:
    """An event file's name in the zip: its prefix and time kept (TensorBoard reads those), the host dropped."""
    if not name.startswith(EVENT_FILE_PREFIX):
        return name
    stamp = name.removeprefix(EVENT_FILE_PREFIX).split(".", 1)[0]
    return f"{EVENT_FILE_PREFIX}{stamp}.{WRITER_NAME}"


def write_zip(collector: RunCollector, folder: Path, top: str) -> Path:
    """Write the collected runs under `folder/top` and zip that folder (its name the zip's one top folder)."""
    runs = write_collected(folder / top, collector)
    archive = folder / f"{top}.zip"
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as zipped:
        for run in runs:
            for file in sorted(run.path.iterdir()):
                zipped.write(file, f"{top}/{run.name}/{zipped_name(file.name)}")
    return archive


def build_in_folder(collector: RunCollector, top: str) -> tuple[Path, Path]:
    """A new temporary folder holding the zip: (the folder, the zip). Nothing is left behind when it fails."""
    folder = Path(tempfile.mkdtemp(prefix="trainyard-tensorboard-"))
    try:
        return folder, write_zip(collector, folder, top)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


class TensorBoardPage:
    def __init__(self, console: Console) -> None:
        self.console = console
        self._building = asyncio.Semaphore(MOST_BUILDS)

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/jobs/{job_id}/tensorboard", self.dialog, methods=["GET"]),
            Route("/jobs/{job_id}/tensorboard.zip", self.download, methods=["GET"]),
        ]

    async def dialog(self, request: Request) -> Response:
        session = self.console.session(request)
        if session is None:
            return self.console.to_sign_in(request)
        all_ranks = request.query_params.get("all_ranks") == "1"
        try:
            details = await self._job(request, session)
            view: RunView = await self.console.ask(session, GET_RUN, GetRun(job_id=details.job.job_id))
        except Refused as refused:
            return self.console.refused_page(request, session, refused.error)
        return self._page(request, session, details, view, all_ranks=all_ranks)

    async def download(self, request: Request) -> Response:
        session = self.console.session(request)
        if session is None:
            return self.console.to_sign_in(request)
        job_id, all_ranks = request.path_params["job_id"], request.query_params.get("all_ranks") == "1"
        try:
            details = await self._job(request, session)
            view: RunView = await self.console.ask(session, GET_RUN, GetRun(job_id=job_id))
            outline = Outline.of(view, all_ranks=all_ranks)
            if not outline.points:  # nothing to write: the dialog says why, and what to do
                return self._page(request, session, details, view, all_ranks=all_ranks,
                                  status_code=STATUS["invalid-state"])
            if outline.points > MOST_POINTS:
                raise TooLarge(outline.points)
            async with self._building:
                collector = await self._read(session, job_id, view, all_ranks=all_ranks,
                                             batch=details.spec.type == "batch")
                folder, archive = await asyncio.to_thread(build_in_folder, collector, f"{job_id}-tensorboard")
        except Refused as refused:
            return self.console.refused_page(request, session, refused.error)
        except TooLarge as large:
            return self.console.refused_page(request, session, CommandError(
                code="over-cap",
                message=self.console.text(request, N_(
                    "The run holds %(points)s points, more than the %(most)s a download may hold.")) % {
                    "points": f"{large.points:,}", "most": f"{MOST_POINTS:,}"},
                hint=self.console.text(request, N_(
                    "Serve it with the CLI instead, which writes the files on your own machine: "
                    "trainyard tensorboard %(job)s")) % {"job": job_id}))
        return FileResponse(archive, media_type="application/zip", filename=archive.name,
                            background=BackgroundTask(shutil.rmtree, folder, ignore_errors=True))

    async def _job(self, request: Request, session: Session) -> JobDetails:
        """The job, if the person may read its run (J2 `tensorboard`); else refused as a job that does not exist."""
        job_id = request.path_params["job_id"]
        missing = Refused(CommandError(code="not-found", message=f"no such job: {job_id}",
                                       hint="`trainyard list` shows the jobs you can see"))
        if not is_job_id(job_id):
            raise missing
        details: JobDetails = await self.console.ask(session, GET_JOB, GetJob(job_id=job_id))
        job = details.job
        if not may(job_grant(session.identity, project=job.project, creator=job.creator, access=job.access),
                   "tensorboard"):
            raise missing
        return details

    async def _read(self, session: Session, job_id: str, view: RunView, *, all_ranks: bool,
                    batch: bool) -> RunCollector:
        """Every point of the series to write, page by page, each once; TooLarge past MOST_POINTS (a running job
        goes on logging while it is read)."""
        collector = RunCollector(batch=batch)
        read = 0
        for name in names_to_read(view, all_ranks=all_ranks):
            once, after = PointsOnce(), 0
            while True:
                page: SeriesPage = await self.console.ask(session, GET_SERIES, GetSeries(
                    job_id=job_id, name=name, rank=None if all_ranks else 0, after=after))
                fresh = once.fresh(page.points)
                read += len(fresh)
                if read > MOST_POINTS:
                    raise TooLarge(read)
                collector.add_all(name, fresh)
                if not page.more or page.next_after <= after:
                    break
                after = page.next_after
        return collector

    def _page(self, request: Request, session: Session, details: JobDetails, view: RunView, *, all_ranks: bool,
              status_code: int = 200) -> Response:
        rank_0, every = Outline.of(view, all_ranks=False), Outline.of(view, all_ranks=True)
        # Rank 0 logged nothing but others did: every rank is what there is to download.
        chosen = all_ranks or rank_0.other_ranks
        return self.console.render(
            request, "tensorboard.html", session=session, job=details.job, batch=details.spec.type == "batch",
            rank_0=rank_0, every=every, all_ranks=chosen, most_points=MOST_POINTS, status_code=status_code,
            zip_name=f"{details.job.job_id}-tensorboard.zip", folder_name=f"{details.job.job_id}-tensorboard",
            asked_rank_0_alone=not all_ranks and rank_0.other_ranks)
