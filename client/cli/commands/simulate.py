"""`trainyard simulate`: what if. The recorded history of a window replayed through the scheduler in virtual time,
on a changed cluster, beside what really happened (administrators)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from client.cli.output import fail, note, print_json, print_table, say, stderr
from client.cli.params import JsonOption, duration_seconds, past_instant, refusing
from client.cli.render import local_time, minutes_text
from client.cli.runner import connected

if TYPE_CHECKING:
    from client.api import TrainyardClient
    from libs.contracts.operations.planning import SimulationProgress, SimulationReport

commands = typer.Typer()

WAIT_COLUMNS = ("PRIORITY", "JOBS", "WAIT P50 REAL", "SIMULATED", "WAIT P95 REAL", "SIMULATED")
USE_COLUMNS = ("FLAVOR", "USE REAL", "SIMULATED")
MOVED_COLUMNS = ("JOB", "NAME", "PRIORITY", "SUBMITTED", "REAL START", "SIMULATED START", "MOVED")


def unless_absent(convert: Callable[[str], object]) -> Callable[[str | None], str | None]:
    """A callback that checks an option that may be left out, and passes it on as typed."""

    def check(value: str | None) -> str | None:
        if value is not None:
            convert(value)
        return value

    return check


def node_changes(values: list[str] | None) -> dict[str, int]:
    """`FLAVOR=N` (repeatable) into counts per flavor."""
    changes: dict[str, int] = {}
    for value in values or []:
        flavor, _, count = value.partition("=")
        if not flavor or not count.isdigit() or int(count) < 1:
            raise fail(f"{value!r} is not FLAVOR=N", "e.g. --add-nodes cpu-2=4 (N at least 1); `trainyard flavors` "
                       "lists the flavors")
        changes[flavor] = changes.get(flavor, 0) + int(count)
    return changes


def seconds_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f} s" if seconds < 60 else minutes_text(int(seconds // 60))


def share(value: float) -> str:
    return f"{100 * value:.1f}%"


@commands.command()
@connected
async def simulate(client: TrainyardClient,
                   since: Annotated[str | None, typer.Option(
                       help="The window: from this long ago until now (90m, 12h, 7d); 7d when no --from is given.",
                       callback=unless_absent(lambda text: duration_seconds(text, "7d")))] = None,
                   start: Annotated[str | None, typer.Option(
                       "--from", help="The window's start: an ISO time or a time ago (-2h).",
                       callback=unless_absent(past_instant))] = None,
                   end: Annotated[str | None, typer.Option(
                       "--to", help="The window's end (default: now): an ISO time or a time ago.",
                       callback=unless_absent(past_instant))] = None,
                   add_nodes: Annotated[list[str] | None, typer.Option(
                       "--add-nodes", metavar="FLAVOR=N", help="Add N copies of the largest node FLAVOR runs on "
                       "(repeatable).", callback=refusing(node_changes))] = None,
                   remove_nodes: Annotated[list[str] | None, typer.Option(
                       "--remove-nodes", metavar="FLAVOR=N", help="Remove N nodes FLAVOR runs on, idle at the "
                       "window's start (repeatable).", callback=refusing(node_changes))] = None,
                   depth: Annotated[int | None, typer.Option(
                       min=1, max=100_000, help="The jobs a scheduling cycle looks at (2,000 today).")] = None,
                   png: Annotated[Path | None, typer.Option(
                       "--png", help="Draw the queue and the use over time, real and simulated, to this PNG file.",
                       dir_okay=False)] = None,
                   as_json: JsonOption = False) -> None:
    """Replay the recorded submissions of a window through the scheduler in virtual time, as they really came and
    ran, on a changed cluster; report waits per priority, makespan, use per flavor and the jobs that moved most,
    beside what really happened (administrators)."""
    if since is not None and start is not None:
        raise fail("--since and --from both name the window's start", "give one of them")
    now = datetime.now(UTC)
    began = (past_instant(start) if start is not None
             else now - timedelta(seconds=duration_seconds(since or "7d", "7d")))
    ended = past_instant(end) if end is not None else None
    if ended is not None and began >= ended:
        raise fail("the window ends before it starts", "give --from earlier than --to")
    with replay_progress() as on_progress:
        report = await client.simulate(began, ended, add_nodes=node_changes(add_nodes),
                                       remove_nodes=node_changes(remove_nodes), depth=depth, on_progress=on_progress)
    if png is not None:
        from client.plots import simulation_png

        simulation_png(report.series, f"{local_time(report.start)} to {local_time(report.end)}: real and simulated",
                       png)
    if as_json:
        print_json(report)
        return
    print_report(report)
    if png is not None:
        note(f"chart written to {png}")


@contextlib.contextmanager
def replay_progress() -> Iterator[Callable[[SimulationProgress], None]]:
    """A progress bar on stderr while the scheduler replays: the events it folds to rebuild the window, then the
    share of the window it has played."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                  console=stderr(), transient=True) as bar:
        task = bar.add_task("rebuilding the window from the log", total=None)

        def update(progress: SimulationProgress) -> None:
            if progress.stage == "rebuilding":
                bar.update(task, description=f"rebuilding the window from the log: {progress.events:,} events")
            else:
                bar.update(task, description="playing the window in virtual time", total=1.0,
                           completed=progress.played)

        yield update


def print_report(report: SimulationReport) -> None:
    nodes = (f"{report.nodes_real} nodes" if report.nodes_simulated == report.nodes_real
             else f"{report.nodes_real} nodes ({report.nodes_simulated} simulated)")
    say(f"replayed {report.jobs:,} jobs from {local_time(report.start)} to {local_time(report.end)} on {nodes}, in "
        f"{report.cycles:,} cycles")
    if report.waits:
        print_table(WAIT_COLUMNS, [[w.priority, str(w.jobs), seconds_text(w.real_p50), seconds_text(w.simulated_p50),
                                    seconds_text(w.real_p95), seconds_text(w.simulated_p95)] for w in report.waits],
                    title="waits, submit to start")
    say(f"makespan: real {seconds_text(report.makespan_real_seconds)}, simulated "
        f"{seconds_text(report.makespan_simulated_seconds)}")
    if report.utilization:
        print_table(USE_COLUMNS, [[u.flavor, share(u.real), share(u.simulated)] for u in report.utilization],
                    title="use of the cluster's CPUs (boards, for flavors with boards)")
    if report.compared:
        say(f"starts: {report.same_start:,} of {report.compared:,} within a second of the real ones; difference "
            f"p50 {seconds_text(report.start_difference_p50)}, p95 {seconds_text(report.start_difference_p95)}")
    if report.moved:
        print_table(MOVED_COLUMNS, [[m.job_id, m.name, m.priority, local_time(m.submitted_at), local_time(m.real_start),
                                     local_time(m.simulated_start), moved(m.real_start, m.simulated_start)]
                                    for m in report.moved], title="moved most")
    for line in report.notes:
        note(line)


def moved(real: datetime | None, simulated: datetime | None) -> str:
    if real is None or simulated is None:
        return "started in one only"
    earlier = simulated < real
    return f"{seconds_text(abs((simulated - real).total_seconds()))} {'earlier' if earlier else 'later'}"
