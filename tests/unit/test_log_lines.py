"""Every log line is one JSON object, whatever a field holds: structured values as JSON, other objects by
their repr, and text that is not valid Unicode (a file name of undecodable bytes) still written."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import structlog

from libs.telemetry.logs import configure_logging, get_logger


@pytest.fixture
def output(capfd: pytest.CaptureFixture[str]) -> Iterator[pytest.CaptureFixture[str]]:
    """What the process writes to its stderr, as a service's log file gets it (logging is configured in the
    test itself, once the capture has taken stderr over)."""
    yield capfd
    structlog.reset_defaults()


def logged(output: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    return [json.loads(line) for line in output.readouterr().err.splitlines() if line.startswith("{")]


def test_a_line_holds_its_fields_with_the_service_level_and_time(output: pytest.CaptureFixture[str]) -> None:
    configure_logging("tests")
    get_logger("x").info("job.event", job_id="job-0123456789ab", attempt=2, at=datetime(2026, 1, 1, tzinfo=UTC),
                         folder=Path("/srv/jobs"), nodes=("n1", "n2"))
    [line] = logged(output)
    assert line["event"] == "job.event" and line["service"] == "tests" and line["level"] == "info"
    assert line["job_id"] == "job-0123456789ab" and line["attempt"] == 2 and line["nodes"] == ["n1", "n2"]
    assert line["at"] == "2026-01-01T00:00:00Z"
    assert line["folder"] == "PosixPath('/srv/jobs')"  # an object is written as its repr
    assert isinstance(line["timestamp"], str)


def test_text_that_is_not_valid_unicode_is_still_written(output: pytest.CaptureFixture[str]) -> None:
    configure_logging("tests")
    name = b"data-\xff.bin".decode(errors="surrogateescape")
    get_logger("x").warning("agent.file_skipped", name=name, counts={1: "one"})
    [line] = logged(output)
    assert line["event"] == "agent.file_skipped" and line["name"] == name
    assert line["counts"] == {"1": "one"}
