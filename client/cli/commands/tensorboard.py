"""`trainyard tensorboard` (R2, O5): a job's run in a real TensorBoard.

The run's series are written as TensorBoard event files (client/tensorboard.py), one run per task and
rank, rank 0 alone unless `--all-ranks`; then TensorBoard serves them until Ctrl-C. tensorboardX,
TensorBoard and the client are imported when the command runs, never when the CLI starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from client.cli.output import fail, note, print_table, say, stderr
from client.cli.params import JobIdArgument
from client.cli.render import shown
from client.cli.runner import with_client

if TYPE_CHECKING:
    from types import FrameType

    from rich.progress import Progress, TaskID

    from client.api import TrainyardClient
    from client.tensorboard import ReadProgress, TensorBoard, WrittenRun

commands = typer.Typer()

LOGGING_HINT = "a job logs with `from trainyard import run; run.log({\"loss\": loss}, step=step)` (docs/runs.md)"
WRITTEN_COLUMNS = ("RUN", "SERIES", "STEPS", "FIRST STEP", "LAST STEP")


@commands.command()
def tensorboard(job_id: JobIdArgument,
                port: Annotated[int, typer.Option("--port", min=0, max=65535,
                                                  help="Port to serve TensorBoard on (0: any free one).")] = 6006,
                host: Annotated[str, typer.Option("--host", help="Address to serve TensorBoard on.")] = "127.0.0.1",
                folder: Annotated[Path | None, typer.Option("--dir", file_okay=False,
                                                            help="Write the event files here and keep them (default: "
                                                            "a temporary folder, removed at exit).")] = None,
                all_ranks: Annotated[bool, typer.Option("--all-ranks", help="Every rank's series, not rank 0's "
                                                        "alone.")] = False) -> None:
    """Serve a job's run in TensorBoard, a run per task and rank, until Ctrl-C."""
    import shutil
    import tempfile

    target = folder if folder is not None else Path(tempfile.mkdtemp(prefix=f"trainyard-tensorboard-{job_id}-"))
    try:
        written = write(job_id, target, all_ranks=all_ranks)
        print_table(WRITTEN_COLUMNS, written_rows(written))
        replaced = sum(series.replaced for run in written for series in run.series)
        if replaced:
            note(f"{replaced} point{'s were' if replaced != 1 else ' was'} logged again at a step already logged (a "
                 "resumed or restarted attempt): the latest value of each step is the one written")
        say(f"wrote {len(written)} run{'s' if len(written) != 1 else ''} to {target}")
        serve(target, host, port, title=f"{job_id} · Trainyard")
        if folder is not None:
            say(f"the event files stay in {folder}")
    finally:
        if folder is None:
            shutil.rmtree(target, ignore_errors=True)


def write(job_id: str, folder: Path, *, all_ranks: bool) -> list[WrittenRun]:
    """Write the job's run under `folder`, showing progress while its series are read."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from client.tensorboard import NoMetrics, write_run

    written: list[WrittenRun] = []

    async def action(client: TrainyardClient) -> None:
        # Series names are the job's text: not read as markup, their control characters written out.
        columns = (TextColumn("reading {task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                   TextColumn("series, {task.fields[points]} points"))
        # Progress is for a terminal: piped, stderr gets none of it.
        with Progress(*columns, console=stderr(), transient=True, disable=not stderr().is_terminal) as progress:
            bar = progress.add_task("the run", total=None, points=0)
            written.extend(await write_run(client, job_id, folder, all_ranks=all_ranks,
                                           progress=lambda read: show_progress(progress, bar, read)))

    try:
        with_client(action)
    except NoMetrics as exc:
        if exc.other_ranks:
            raise fail(str(exc), "--all-ranks writes every rank's series") from None
        raise fail(str(exc), LOGGING_HINT) from None
    return written


def show_progress(progress: Progress, bar: TaskID, read: ReadProgress) -> None:
    progress.update(bar, description=shown(read.name or "the run"), completed=read.series_done, total=read.series_total,
                    points=read.points)


def written_rows(written: list[WrittenRun]) -> list[tuple[str, ...]]:
    return [(run.name, series.tag, str(series.steps), str(series.first_step), str(series.last_step))
            for run in written for series in run.series]


def serve(folder: Path, host: str, port: int, *, title: str) -> None:
    """Run TensorBoard over `folder` until Ctrl-C (or SIGTERM), then stop it; exits 0 then."""
    import signal

    from client.tensorboard import TensorBoard, TensorBoardFailed

    server = TensorBoard(folder, host, port, title=title)
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        say("TensorBoard: ", (server.start(), "bold"), " (Ctrl-C stops it)")
        code = server.wait()
        raise fail(f"TensorBoard ended by itself with code {code}: {server.errors()}")
    except TensorBoardFailed as exc:
        raise fail(str(exc), "choose another port with --port, or 0 for any free one"
                   if "port" in str(exc) else None) from None
    except KeyboardInterrupt:
        stop(server)
        say("stopped TensorBoard")
    finally:
        stop(server)
        signal.signal(signal.SIGTERM, previous)


def stop(server: TensorBoard) -> None:
    # A second Ctrl-C while TensorBoard is being stopped does not leave it running.
    try:
        server.stop()
    except KeyboardInterrupt:
        server.stop(timeout=0)


def interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM stops TensorBoard as Ctrl-C does."""
    raise KeyboardInterrupt
