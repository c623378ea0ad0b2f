"""What `trainyard simulate` must find when it replays, with no change, a history a test made: worked out from the
jobs' recorded times, so that the replay is held to its own logic however long the live services took to act."""

from __future__ import annotations

from datetime import timedelta

from libs.contracts.operations.jobs import JobView


def start_differences(first: JobView, second: JobView) -> list[float]:
    """How far apart (seconds) the real and the replayed starts of two jobs are, the second submitted while the first
    held every node the second needs. Replayed (services/scheduler/history/whatif.py), the first starts the instant it
    was submitted, and the second the instant the first ends, having run as long as it really ran in whole seconds. The
    live scheduler started each at its next cycle after such an instant, and recorded it a moment later: the
    differences are its reaction times, which a loaded machine makes longer, not an error of the replay."""
    assert first.started_at is not None and first.ended_at is not None and second.started_at is not None
    runtime = timedelta(seconds=round((first.ended_at - first.started_at).total_seconds()))
    replayed_second = max(second.submitted_at, first.submitted_at + runtime)
    return [abs((first.started_at - first.submitted_at).total_seconds()),
            abs((second.started_at - replayed_second).total_seconds())]
