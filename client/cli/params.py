"""Parameters the commands share, and checks of what is typed.

A check runs as the parameter's typer callback, while the command line is parsed: bad input is
refused with a hint before anything connects, even when no stack is reachable. The function a check
wraps (`refusing(job_statuses)`) also gives the command the value in its checked type.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from client.cli.output import fail, print_field_errors
from libs.contracts.jobspec import SpecError, decode_spec, parse_duration
from libs.contracts.messages import JOB_STATUSES

if TYPE_CHECKING:
    from libs.contracts.jobspec import JobSpec
    from libs.contracts.messages import JobStatus

JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
FollowOption = Annotated[bool, typer.Option("--follow", "-f", help="Follow status and logs until the job ends.")]
JobIdArgument = Annotated[str, typer.Argument(help="Job id.")]

Value = TypeVar("Value")


def refusing(convert: Callable[[Value], object]) -> Callable[[Value], Value]:
    """A parameter callback that passes the value on as typed once `convert` accepts it (a refusal is
    `convert` raising the exit of `fail`)."""

    def check(value: Value) -> Value:
        convert(value)
        return value

    return check


def read_spec(file: Path) -> JobSpec:
    """The job spec in FILE (YAML or JSON), every bad field named."""
    try:
        return decode_spec(file.read_bytes(), yaml=file.suffix in (".yaml", ".yml"))
    except SpecError as exc:
        print_field_errors(exc.errors)
        raise fail(f"{file} is not a valid job spec; nothing was submitted") from None


def job_statuses(given: list[str] | None) -> list[JobStatus]:
    """The statuses named by --status, in their usual order."""
    unknown = [status for status in given or [] if status not in JOB_STATUSES]
    if unknown:
        raise fail(f"unknown status {unknown[0]!r}", f"choose from {', '.join(JOB_STATUSES)}")
    return [status for status in JOB_STATUSES if status in (given or [])]


def duration_seconds(text: str, example: str) -> int:
    """A duration such as 90s, 30m, 4h or 2d in seconds; `example` shows the option written right."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise fail(str(exc), f"give a number and a unit (s, m, h, d), e.g. {example}") from None
