"""M6: slow iterations open one incident per crossing of the threshold, per rank of an attempt."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import cast

from nats.aio.msg import Msg

from libs.contracts import subjects
from libs.contracts.agent import LogChunk
from libs.contracts.codec import encode
from libs.contracts.jobspec import PerformanceDetection
from services.monitor.performance.detector import PerformanceDetector, RankWindow, ratios
from services.monitor.performance.logfeed import scan


def line(hardware: float, e2e: float) -> str:
    return f"this iteration hardware time is {hardware} and e2e time is {e2e} ms."


def lines(*values: float) -> list[str]:
    """Performance lines with these ratios (e2e 1000 ms)."""
    return [line(v * 1000, 1000) for v in values]


def window(threshold: float = 0.8, size: int = 3, direction: str = "above", recorded: int = 0) -> RankWindow:
    rule = PerformanceDetection(threshold=threshold, window=size, direction=direction)  # type: ignore[arg-type]
    return RankWindow.of(rule, recorded)


def test_the_ratio_is_hardware_over_e2e_and_other_lines_are_ignored() -> None:
    found = ratios(["epoch 1", "this iteration hardware time is 2201.521 and e2e time is 3317.794921875 ms.",
                    "loss 0.5", "hardware time is 5 but no e2e", line(10, 0)])
    assert [round(r, 6) for r in found] == [round(2201.521 / 3317.794921875, 6)]


def test_a_line_broken_in_two_is_not_an_iteration() -> None:
    assert ratios(["this iteration hardware time is", "5 and e2e time is 10 ms"]) == []


def test_nothing_opens_before_the_window_is_full() -> None:
    assert window().feed(lines(0.9, 0.9)) == []


def test_above_opens_one_incident_for_a_whole_crossing() -> None:
    w = window(size=3)
    opened = w.feed(lines(0.9, 0.9, 0.9, 0.95, 0.9, 0.99))
    assert [round(m, 3) for m in opened] == [0.9]
    assert w.incidents == 1


def test_below_opens_when_the_mean_drops_under_the_threshold() -> None:
    w = window(threshold=0.5, direction="below")
    assert w.feed(lines(0.6, 0.6, 0.6)) == []
    assert len(w.feed(lines(0.3, 0.3))) == 1


def test_the_mean_decides_not_a_single_slow_iteration() -> None:
    assert window().feed(lines(0.5, 0.5, 1.3, 0.5, 0.5)) == []


def test_an_incident_closes_when_the_mean_is_back_and_a_new_crossing_is_a_new_incident() -> None:
    w = window(size=2)
    assert len(w.feed(lines(0.9, 0.9))) == 1
    assert w.feed(lines(0.9, 0.5, 0.5)) == []  # back under: closed
    assert len(w.feed(lines(0.9, 0.9))) == 1
    assert w.incidents == 2


def test_an_incident_recorded_before_a_restart_is_not_opened_again() -> None:
    w = window(size=2, recorded=1)
    assert w.feed(lines(0.9, 0.9, 0.9)) == []
    opened = w.feed(lines(0.1, 0.1, 0.9, 0.9))
    assert len(opened) == 1 and w.incidents == 2


@dataclass
class Chunk:
    job_id: str
    attempt: int
    rank: int
    node: str
    lines: list[str] = field(default_factory=list)


def test_the_detector_watches_the_current_attempt_of_watched_jobs_per_rank() -> None:
    detector = PerformanceDetector()
    rule = PerformanceDetection(threshold=0.8, window=2)
    detector.watch("job-a", 2, rule)
    assert detector.feed(Chunk("job-b", 2, 0, "n1", lines(0.9, 0.9))) == []  # not watched
    assert detector.feed(Chunk("job-a", 1, 0, "n1", lines(0.9, 0.9))) == []  # an earlier attempt
    assert detector.feed(Chunk("job-a", 2, 0, "n1", lines(0.9))) == []
    assert detector.feed(Chunk("job-a", 2, 1, "n2", lines(0.9))) == []  # another rank, its own window
    [incident] = detector.feed(Chunk("job-a", 2, 0, "n1", lines(0.9)))
    assert (incident.job_id, incident.attempt, incident.rank, incident.node) == ("job-a", 2, 0, "n1")
    assert incident.number == 1
    assert round(incident.ratio, 3) == 0.9


def test_recorded_incidents_number_the_next_one() -> None:
    detector = PerformanceDetector({("job-a", 1, 0): 1})
    detector.watch("job-a", 1, PerformanceDetection(threshold=0.8, window=1))
    assert detector.feed(Chunk("job-a", 1, 0, "n1", lines(0.9))) == []
    [incident] = detector.feed(Chunk("job-a", 1, 0, "n1", lines(0.1, 0.9)))
    assert incident.number == 2


def test_only_the_node_that_runs_a_rank_speaks_for_it() -> None:
    detector = PerformanceDetector()
    detector.watch("job-a", 1, PerformanceDetection(threshold=0.8, window=1), {0: "n1", 1: "n2"})
    assert detector.misplaced(Chunk("job-a", 1, 0, "n1", lines(0.9))) is None
    assert detector.misplaced(Chunk("job-a", 1, 0, "n2", lines(0.9))) == (
        "node n2 sent output of job-a rank 0, which runs on n1")
    assert detector.misplaced(Chunk("job-a", 1, 7, "n2", lines(0.9))) is not None  # no such rank
    assert detector.misplaced(Chunk("job-a", 2, 0, "n2", lines(0.9))) is None  # not watched: never fed


def test_the_log_feed_takes_a_chunk_only_from_the_node_that_runs_its_rank() -> None:
    detector = PerformanceDetector()
    detector.watch("job-a", 1, PerformanceDetection(threshold=0.8, window=1), {0: "n1", 1: "n2"})

    def msg(subject_node: str, node: str) -> Msg:
        chunk = LogChunk(job_id="job-a", attempt=1, rank=0, node=node, seq=0, lines=lines(0.9))
        return cast(Msg, SimpleNamespace(subject=subjects.node_logs("job-a", 0, subject_node), data=encode(chunk)))

    # n2 speaking for rank 0 (n1's), under its own name or under n1's: nothing opens.
    assert scan(detector, [msg("n2", "n2"), msg("n2", "n1")]) == []
    [incident] = scan(detector, [msg("n1", "n1")])
    assert (incident.rank, incident.node) == (0, "n1")
