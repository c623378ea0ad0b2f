"""`show` tells a waiting job's expected start with how long ago it was planned: the scheduler answers with the
latest plan's, never waiting for a new one."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from client.cli.render import job_detail_rows
from libs.contracts.jobspec import JobSpec
from libs.contracts.operations.jobs import JobDetails, JobView
from libs.contracts.scheduling import Prediction

NOW = datetime(2026, 11, 21, 13, 40, tzinfo=UTC)
START = datetime(2026, 11, 21, 15, 0, tzinfo=UTC)


def shown(planned: datetime) -> dict[str, object]:
    expected = Prediction(starts_now=False, position=1, estimated_start=START, latest_start=START, predicted_at=planned,
                          reason="Waits behind 1 job.")
    job = JobView(job_id="job-0123456789ab", name="resnet", project="vision", creator="alice", status="queued",
                  priority="normal", mode="single-node", nodes=1, flavors=["cpu-1"], submitted_at=NOW,
                  queue_position=1, expected=expected)
    return dict(job_detail_rows(JobDetails(job=job, spec=JobSpec(name="resnet")), now=NOW))


def test_a_waiting_jobs_expected_start_says_when_it_was_planned() -> None:
    rows = shown(NOW - timedelta(hours=2, minutes=5, seconds=30))
    assert rows["expected start"] == "15:00 UTC"
    assert rows["waiting"] == "Waits behind 1 job."
    assert rows["planned"] == "2 h 5 min ago"
    assert shown(NOW - timedelta(seconds=20))["planned"] == "just now"
    assert list(rows).index("planned") == list(rows).index("waiting") + 1
