"""Parameters the commands share, and checks of what is typed.

A check runs as the parameter's typer callback, while the command line is parsed: bad input is
refused with a hint before anything connects, even when no stack is reachable. The function a check
wraps (`refusing(job_statuses)`) also gives the command the value in its checked type.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from client.cli.output import fail, print_field_errors
from libs.contracts.arrays import ArrayError, is_array_id, parse_indices, parse_sweep, sweep_points
from libs.contracts.ids import is_job_id
from libs.contracts.jobspec import SpecError, decode_spec, parse_duration
from libs.contracts.operations.arrays import ArraySelection
from libs.contracts.operations.base import JOB_STATUSES

if TYPE_CHECKING:
    from libs.contracts.arrays import ArrayIndices, SweepParameter
    from libs.contracts.jobspec import JobSpec
    from libs.contracts.operations.base import JobStatus

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


def optional(convert: Callable[[str], object]) -> Callable[[str | None], object]:
    """`convert` for an option that may be left out."""

    def check(value: str | None) -> object:
        return None if value is None else convert(value)

    return check


def past_instant(text: str, *, now: datetime | None = None) -> datetime:
    """`trainyard at TIME`: an ISO time (local unless it names its zone) or a time ago (`-2h`, `-90m`, `-1d`)."""
    now = now or datetime.now(UTC)
    if text.startswith("-"):
        try:
            return now - timedelta(seconds=parse_duration(text[1:]))
        except ValueError:
            raise fail(f"{text!r} is not a time ago", "write it like -90s, -30m, -2h or -1d") from None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise fail(f"{text!r} is not a time", "give an ISO time (2026-11-27T03:00, local time unless it ends in "
                   "Z or +01:00) or a time ago (-2h)") from None
    when = when.astimezone() if when.tzinfo is None else when  # a naive time is the local time
    if when > now:
        raise fail(f"{text} is in the future", "name a past instant; leave `at TIME` out for the cluster now")
    return when.astimezone(UTC)


def read_spec(file: Path, overrides: Mapping[str, Any] | None = None) -> JobSpec:
    """The job spec in FILE (YAML or JSON) with `overrides` (submit's --set) applied, every bad field named."""
    from libs.contracts.overrides import overridden_document

    data, yaml = file.read_bytes(), file.suffix in (".yaml", ".yml")
    try:
        if overrides:
            data, yaml = overridden_document(data, overrides, yaml=yaml), True
        return decode_spec(data, yaml=yaml)
    except SpecError as exc:
        print_field_errors(exc.errors)
        with_set = " with its --set options" if overrides else ""
        raise fail(f"{file}{with_set} is not a valid job spec; nothing was submitted") from None


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


# --- arrays and sweeps -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ArrayRequest:
    """What `submit --array` or `--sweep` asks for, checked: the indices (without `%N`) or the sweep, the cap,
    and how many jobs that makes."""

    indices: str
    sweep: list[SweepParameter]
    max_running: int | None
    size: int


def array_request(array: str | None, sweep: list[str] | None, max_running: int | None, *,
                  follow: bool) -> ArrayRequest | None:
    """The array `submit` is asked for, or None for one job; options that do not go together are refused."""
    if array is None and not sweep:
        if max_running is not None:
            raise fail("--max-running caps how many jobs of an array run at once, and this submits one job",
                       "add --array or --sweep, or leave --max-running out; nothing was submitted")
        return None
    if array is not None and sweep:
        raise fail("--array and --sweep each make the jobs of an array: give one of them",
                   "for several values at each index, sweep them: the cross product of the --sweep parameters "
                   "makes the jobs; nothing was submitted")
    if follow:
        raise fail("--follow follows one job, and this submits an array",
                   "`trainyard show ARRAY` shows where its jobs stand, `trainyard logs JOB -f` follows one of "
                   "them; nothing was submitted")
    if array is not None:
        parsed = array_indices(array)
        if parsed.max_running is not None and max_running is not None:
            raise fail(f"the cap is given twice: as %{parsed.max_running} in --array and as --max-running "
                       f"{max_running}", "keep one of them; nothing was submitted")
        return ArrayRequest(indices=array.partition("%")[0].strip(), sweep=[],
                            max_running=parsed.max_running or max_running, size=len(parsed.indices))
    parameters = sweep_parameters(sweep)
    return ArrayRequest(indices="", sweep=parameters, max_running=max_running,
                        size=math.prod(len(p.values) for p in parameters))


def array_indices(text: str) -> ArrayIndices:
    """--array: an array expression (`0-999`, `1-10:2`, `0,6,16-32`, optionally `%N`)."""
    try:
        return parse_indices(text)
    except ArrayError as exc:
        raise fail(option_error("--array", exc), "write indices and ranges, e.g. --array 0-999, --array 1-10:2 or "
                   "--array 0,6,16-32%4 (at most 4 running at once); nothing was submitted") from None


def sweep_parameters(items: list[str] | None) -> list[SweepParameter]:
    """--sweep NAME=v1,v2 (repeatable): the parameters, once their cross product is known to be usable."""
    try:
        parameters = [parse_sweep(item) for item in items or []]
        sweep_points(parameters)  # refuses a name given twice and a product too large
    except ArrayError as exc:
        raise fail(option_error("--sweep", exc), "e.g. --sweep lr=0.1,0.01 --sweep batch=32,64 (4 jobs); nothing "
                   "was submitted") from None
    return parameters


def selected_indices(text: str) -> str:
    """--indices of stop and delete: which jobs of an array, as an array expression without `%N`."""
    if "%" in text:
        raise fail(f"--indices {text!r}: '%N' caps a new array's running jobs; it selects nothing",
                   "write the indices alone, e.g. --indices 3,5-7; nothing was sent")
    try:
        parse_indices(text)
    except ArrayError as exc:
        raise fail(option_error("--indices", exc), "e.g. --indices 3,5-7 or --indices 0-99:2; nothing was sent"
                   ) from None
    return text.strip()


def option_error(option: str, error: ArrayError) -> str:
    """The option and what is wrong with it: `--array '0-x': ...` when the message starts with what was typed."""
    message = str(error)
    return f"{option} {message}" if message.startswith(("'", '"')) else f"{option}: {message}"


def job_or_array_id(text: str) -> str:
    if not (is_job_id(text) or is_array_id(text)):
        raise fail(f"{text!r} is neither a job id (job-<12 hex digits>) nor an array id (array-<12 hex digits>)",
                   "`trainyard list` shows the ids of your jobs and arrays")
    return text


def job_and_array_ids(ids: list[str]) -> list[str]:
    for text in ids:
        job_or_array_id(text)
    return ids


def jobs_and_arrays(ids: list[str], indices: str | None) -> tuple[list[str], list[ArraySelection]]:
    """What stop and delete act on: the job ids given, and the arrays given (their `indices`, or all jobs)."""
    job_and_array_ids(ids)
    job_ids = [text for text in dict.fromkeys(ids) if is_job_id(text)]
    array_ids = [text for text in dict.fromkeys(ids) if is_array_id(text)]
    if indices is None:
        return job_ids, [ArraySelection(array_id=array_id) for array_id in array_ids]
    if not array_ids:
        raise fail("--indices selects jobs of one array, and none was given",
                   "give the array's id (array-…) with it: `trainyard list` shows it; nothing was sent")
    if len(array_ids) > 1:
        raise fail(f"--indices selects jobs of one array, and {len(array_ids)} were given ({', '.join(array_ids)})",
                   "give one array id with --indices, and the other arrays in a command of their own; nothing was "
                   "sent")
    return job_ids, [ArraySelection(array_id=array_ids[0], indices=selected_indices(indices))]
