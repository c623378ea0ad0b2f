"""A job's place in the queue: predict (S6), why, priority (S3) and duration (S11)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, get_args

import typer

from client.cli.output import fail, print_json, print_table, say
from client.cli.params import JobIdArgument, JsonOption, duration_seconds, read_spec, refusing
from client.cli.render import SHORTAGE_COLUMNS, flavor_wait_title, prediction_sentence, shortage_rows, why_lines
from client.cli.runner import connected
from libs.contracts.jobspec import Priority

if TYPE_CHECKING:
    from client.api import TrainyardClient

commands = typer.Typer()

PRIORITIES: tuple[Priority, ...] = get_args(Priority)


def priority_level(level: str) -> Priority:
    for known in PRIORITIES:
        if level == known:
            return known
    raise fail(f"unknown priority {level!r}", f"choose from {', '.join(PRIORITIES)}")


def duration_limit(limit: str) -> str | None:
    """A new duration limit, or None (typed `none`) to remove it."""
    if limit.strip().lower() == "none":
        return None
    duration_seconds(limit.strip(), "4h, or none to remove the limit")
    return limit.strip()


@commands.command()
@connected
async def predict(client: TrainyardClient,
                  file: Annotated[Path, typer.Option("--file", "-f", help="Job spec (YAML or JSON).", exists=True,
                                                     dir_okay=False, callback=refusing(read_spec))],
                  as_json: JsonOption = False) -> None:
    """Predict whether a job would start now or queue, and until when (S6); creates nothing."""
    spec = read_spec(file)
    prediction = await client.predict(spec)
    if as_json:
        print_json(prediction)
        return
    say(prediction_sentence(prediction, requested_nodes=spec.nodes))
    if prediction.reason and prediction.estimated_start is not None:
        say(f"  {prediction.reason}", style="dim")


@commands.command()
@connected
async def why(client: TrainyardClient, job_id: JobIdArgument, as_json: JsonOption = False) -> None:
    """Explain what a queued job waits for: jobs ahead, and per flavor the nodes and resources it lacks."""
    report = await client.why(job_id)
    if as_json:
        print_json(report)
        return
    for line in why_lines(report):
        say(line)
    for wait in report.flavors:
        say()
        say(flavor_wait_title(wait), soft_wrap=True)  # a title would wrap at the table's width
        if wait.shortages:
            print_table(SHORTAGE_COLUMNS, shortage_rows(wait))


@commands.command()
@connected
async def priority(client: TrainyardClient, job_id: JobIdArgument,
                   level: Annotated[str, typer.Argument(help="normal, urgent or very-urgent (administrators).",
                                                        callback=refusing(priority_level))]) -> None:
    """Change the priority of a queued job (S3); urgent jobs per user and project are capped (S2)."""
    done = await client.change_priority(job_id, priority_level(level))
    say(done.message or f"{job_id}: priority set to {level}")


@commands.command()
@connected
async def duration(client: TrainyardClient, job_id: JobIdArgument,
                   limit: Annotated[str, typer.Argument(metavar="DURATION", callback=refusing(duration_limit),
                                                        help="New limit (90s, 30m, 4h, 2d), or none to remove it.")],
                   ) -> None:
    """Change a job's duration limit, also while it runs, without restarting it (S11)."""
    new = duration_limit(limit)
    done = await client.change_duration(job_id, new)
    say(done.message or f"{job_id}: duration limit " + (f"set to {new}" if new else "removed"))
