"""Text from others is shown, not obeyed: whatever the CLI prints that a user or a job wrote (names,
reasons, events, log lines, metric names, refusals) has its terminal control characters written out
visibly and is never read as console markup; `logs --raw` alone prints log lines as received."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from client.api import TrainyardError
from client.cli import output
from client.cli.render import shown
from libs.contracts.agent import LogChunk
from libs.contracts.events import EventEnvelope, JobStopped
from libs.contracts.jobspec import FieldError, JobSpec
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.jobs import JobDetails, JobList, JobView
from libs.contracts.operations.runs import RunView, SeriesPoint, SeriesView
from tests.support.cli import FakeClient, fake, invoke, no_stack

__all__ = ["fake", "no_stack"]  # the fixtures, used by name

NOW = datetime(2026, 11, 21, 13, 40, tzinfo=UTC)
JOB = "job-0123456789ab"
# Recolours, clears the screen, retitles the window, hides a hyperlink, moves the cursor with a C1 CSI,
# rings the bell and reverses the text that follows.
HOSTILE = "\x1b[31mred\x1b[0m\x1b[2J\x1b]0;owned\x07\x1b]8;;https://evil.example\x1b\\click\x1b]8;;\x1b\\\x9b2A\x07\u202e"
HOSTILE_SHOWN = ("\\x1b[31mred\\x1b[0m\\x1b[2J\\x1b]0;owned\\x07\\x1b]8;;https://evil.example\\x1b\\click"
                 "\\x1b]8;;\\x1b\\\\x9b2A\\x07\\u202e")
MARKUP = "[red]x[/red] [link=https://evil.example]click[/link] [bold]"
OBEYED = ("\x1b", "\x07", "\x9b", "\u202e")


@pytest.fixture(autouse=True)
def wide(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tables as wide as their longest row, so that every name stays on one line."""
    monkeypatch.setenv("COLUMNS", "2000")
    output.stdout.cache_clear()
    yield
    output.stdout.cache_clear()


def view(name: str = "train", job_id: str = JOB, **fields: Any) -> JobView:
    return JobView(job_id=job_id, name=name, project="vision", creator="alice", status="failed", priority="normal",
                   mode="single-node", nodes=1, flavors=["cpu-1"], submitted_at=NOW, **fields)


def assert_nothing_obeyed(output: str) -> None:
    assert not [char for char in OBEYED if char in output], repr(output)


@pytest.mark.parametrize(("given", "expected"), [
    ("plain name, [brackets] and ünïcödé", "plain name, [brackets] and ünïcödé"),
    ("\x1b[1mbold", "\\x1b[1mbold"),
    ("nul\x00 del\x7f csi\x9b nel\x85", "nul\\x00 del\\x7f csi\\x9b nel\\x85"),
    ("a\nb\tc\rd", "a\\nb\\tc\\rd"),
    ("\u202eevil\u2066", "\\u202eevil\\u2066"),
])
def test_control_characters_are_written_out(given: str, expected: str) -> None:
    assert shown(given) == expected


def test_log_layout_keeps_newlines_and_tabs_only() -> None:
    assert shown("a\tb\nc\rd\x1b[K", layout=True) == "a\tb\nc\\rd\\x1b[K"


def test_list_shows_escapes_and_markup_in_names_as_text(fake: FakeClient) -> None:
    fake.answers["listing"] = JobList(jobs=[view(HOSTILE), view(MARKUP, job_id="job-0123456789ac")])
    result = invoke("list")
    assert result.exit_code == 0, result.output
    assert_nothing_obeyed(result.output)
    assert HOSTILE_SHOWN in result.output
    assert MARKUP in result.output


def test_show_shows_escapes_and_markup_in_every_field_as_text(fake: FakeClient) -> None:
    job = view(f"{MARKUP}{HOSTILE}", reason=f"stopped by {HOSTILE}", output=MARKUP)
    fake.answers["get_job"] = JobDetails(job=job, spec=JobSpec(name=job.name))
    fake.answers["usage"] = []
    result = invoke("show", JOB)
    assert result.exit_code == 0, result.output
    assert_nothing_obeyed(result.output)
    assert f"{MARKUP}{HOSTILE_SHOWN}" in result.output
    assert f"stopped by {HOSTILE_SHOWN}" in result.output


def logs_of(lines: list[str]) -> Any:
    async def logs(job_id: str, rank: int | None, *, follow: bool) -> AsyncIterator[LogChunk]:
        yield LogChunk(job_id=job_id, attempt=1, rank=0, node="node-a", seq=0, lines=lines)

    return logs


def test_logs_show_escapes_but_keep_tabs(fake: FakeClient) -> None:
    fake.answers["get_job"] = JobDetails(job=view(), spec=JobSpec(name="train"))
    fake.logs = logs_of([f"step 1\tloss {HOSTILE}", "progress 10%\rprogress 20%", MARKUP])  # type: ignore[attr-defined]
    result = invoke("logs", JOB)
    assert result.exit_code == 0, result.output
    assert_nothing_obeyed(result.output)
    lines = result.stdout.splitlines()
    assert lines[0] == f"[rank 0] step 1\tloss {HOSTILE_SHOWN}".expandtabs()  # the tab laid out, not written out
    assert lines[1] == "[rank 0] progress 10%\\rprogress 20%"
    assert lines[2] == f"[rank 0] {MARKUP}"


def test_logs_raw_print_the_lines_as_received(fake: FakeClient) -> None:
    fake.answers["get_job"] = JobDetails(job=view(), spec=JobSpec(name="train"))
    fake.logs = logs_of([f"step 1\tloss {HOSTILE}", "progress 10%\rprogress 20%"])  # type: ignore[attr-defined]
    result = invoke("logs", JOB, "--raw")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"[rank 0] step 1\tloss {HOSTILE}\n[rank 0] progress 10%\rprogress 20%\n"
    one_rank = invoke("logs", JOB, "--node", "0", "--raw")
    assert one_rank.stdout == f"step 1\tloss {HOSTILE}\nprogress 10%\rprogress 20%\n"


def test_events_show_what_users_wrote_in_them_as_text(fake: FakeClient) -> None:
    stopped = JobStopped(job_id=JOB, by=f"{HOSTILE}{MARKUP}")
    fake.answers["history"] = [EventEnvelope(event_id="e-1", aggregate_type="job", aggregate_id=JOB, version=1,
                                             service="scheduler", recorded_at=NOW, event=stopped, position=1)]
    result = invoke("events", JOB)
    assert result.exit_code == 0, result.output
    assert_nothing_obeyed(result.output)
    assert f"by={HOSTILE_SHOWN}{MARKUP}" in result.output


def test_metric_names_config_and_summary_are_shown_as_text(fake: FakeClient) -> None:
    series = SeriesView(name=f"loss{HOSTILE}", task=0, rank=0, count=1, last=0.5, least=0.5, greatest=0.5)
    fake.answers["run"] = RunView(job_id=JOB, series=[series], config={MARKUP: HOSTILE}, summary={"final": MARKUP})
    result = invoke("metrics", JOB)
    assert result.exit_code == 0, result.output
    assert_nothing_obeyed(result.output)
    assert f"loss{HOSTILE_SHOWN}" in result.output
    pairs = [" ".join(line.split()) for line in result.stdout.splitlines()
             if line.strip().startswith(("config", "summary"))]
    assert pairs == [f"config {MARKUP} {HOSTILE_SHOWN}", f"summary final {MARKUP}"]


def test_refusals_and_their_field_errors_are_shown_as_text(fake: FakeClient) -> None:
    error = CommandError(code="invalid-spec", message=f"bad {HOSTILE}", hint=f"fix {MARKUP}",
                         errors=[FieldError(field=f"name{HOSTILE}", message=MARKUP, hint=HOSTILE)])
    fake.answers["get_job"] = TrainyardError(error)
    result = invoke("show", JOB)
    assert result.exit_code == 1
    assert_nothing_obeyed(result.output)
    assert f"name{HOSTILE_SHOWN}: {MARKUP}" in result.output
    assert f"hint: {HOSTILE_SHOWN}" in result.output
    fake.answers["get_job"] = TrainyardError(CommandError(code="not-found", message=f"no such job: {HOSTILE}",
                                                          hint=MARKUP))
    result = invoke("show", JOB)
    assert_nothing_obeyed(result.output)
    assert f"error: no such job: {HOSTILE_SHOWN}" in result.output and f"hint: {MARKUP}" in result.output


def test_metric_values_as_csv_write_out_the_jobs_own_labels(fake: FakeClient) -> None:
    async def series(job_id: str, name: str, rank: int | None, *, follow: bool) -> AsyncIterator[SeriesPoint]:
        yield SeriesPoint(rank=0, step=1, value=0.5, at=NOW, task=0, attempt=1, process=f"eval{HOSTILE}", seq=1,
                          node="node-a")

    fake.series = series  # type: ignore[attr-defined]
    result = invoke("metrics", JOB, "loss", "--csv")
    assert result.exit_code == 0, result.output
    assert_nothing_obeyed(result.output)
    assert f"eval{HOSTILE_SHOWN}" in result.output
