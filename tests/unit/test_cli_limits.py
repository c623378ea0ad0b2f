"""The per-user limits in the CLI: `trainyard admin settings` shows and changes them, and a submit refused by
one prints what the scheduler said and what to do next."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from client.api import TrainyardError
from libs.contracts.operations.base import CommandError
from libs.contracts.scheduling import AdminSettings
from services.scheduler.domain.limits import queued_error, rate_taken
from tests.support.cli import FakeClient, fake, invoke, no_stack

__all__ = ["fake", "no_stack"]  # the fixtures, used by name

EXAMPLE_JOB = Path(__file__).resolve().parents[2] / "examples" / "pytorch-ddp.yaml"
NOW = datetime(2026, 11, 21, 13, 40, tzinfo=UTC)


def test_admin_settings_shows_the_limits_and_no_limit_for_zero(fake: FakeClient) -> None:
    fake.answers["settings"] = AdminSettings()
    shown = invoke("admin", "settings")
    assert shown.exit_code == 0, shown.output
    assert "10000 per user, all projects together" in shown.stdout
    assert "100 jobs per second per user, up to 10000 at once" in shown.stdout
    fake.answers["settings"] = AdminSettings(max_queued_jobs_per_user=0, submit_rate=0)
    assert invoke("admin", "settings").stdout.count("no limit") == 2


def test_admin_settings_changes_the_limits(fake: FakeClient) -> None:
    changed = AdminSettings(max_queued_jobs_per_user=50, submit_rate=0, submit_burst=20)
    fake.answers["change_settings"] = changed
    result = invoke("admin", "settings", "--max-queued-jobs", "50", "--submit-rate", "0", "--submit-burst", "20")
    assert result.exit_code == 0, result.output
    [(name, _, options)] = fake.calls
    assert name == "change_settings"
    assert {k: v for k, v in options.items() if v is not None} == {
        "max_queued_jobs_per_user": 50, "submit_rate": 0, "submit_burst": 20}
    assert "50 per user" in result.stdout
    refused = invoke("admin", "settings", "--submit-burst", "0")
    assert refused.exit_code != 0 and fake.calls[1:] == []  # checked before anything is sent


def refusing(error: CommandError) -> Any:
    async def submit(*_: Any, **__: Any) -> None:
        raise TrainyardError(error)

    return submit


def test_a_submit_refused_by_a_limit_says_which_and_what_to_do(fake: FakeClient) -> None:
    settings = AdminSettings(submit_rate=2, submit_burst=1)
    bucket = rate_taken("alice", None, 1, NOW, settings)
    too_fast = rate_taken("alice", bucket if not isinstance(bucket, CommandError) else None, 1, NOW, settings)
    assert isinstance(too_fast, CommandError)
    fake.answers["submit"] = refusing(too_fast)
    result = invoke("submit", str(EXAMPLE_JOB))
    assert result.exit_code == 1
    assert "alice submits too fast" in result.stderr
    assert "wait 0.5 s and submit again; nothing was created" in result.stderr

    over = queued_error("alice", 3, 1, AdminSettings(max_queued_jobs_per_user=3))
    assert over is not None
    fake.answers["submit"] = refusing(over)
    result = invoke("submit", str(EXAMPLE_JOB))
    assert result.exit_code == 1
    assert "over the limit of 3 queued jobs per user" in result.stderr
    assert "trainyard stop JOB" in result.stderr
