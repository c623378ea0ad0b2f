"""S6: how long jobs really run, learned from finished jobs, for the likely start of a queued job."""

from __future__ import annotations

from datetime import timedelta

import msgspec
from hypothesis import given
from hypothesis import strategies as st
from pytest import approx

from libs.contracts.cluster import ClusterConfig
from libs.contracts.events import (
    EventEnvelope,
    JobAdmitted,
    JobFailed,
    JobSubmitted,
    JobSucceeded,
    Placement,
)
from libs.contracts.jobspec import JobSpec
from services.scheduler.domain.state import SchedulerState
from services.scheduler.planning.prediction_cache import PredictionCache
from services.scheduler.planning.runtime_model import RuntimeModel, Traits, expected_runtimes, kind_of
from tests.support.placement import CPU4, FLAVORS, NOW, queued, run_on, spec
from tests.support.strategies import SETTINGS

ANN = Traits(creator="ann", project="vision", kind="resnet", flavor="cpu-4", nodes=1)
BOB = Traits(creator="bob", project="vision", kind="resnet", flavor="cpu-4", nodes=1)


def learned(*samples: tuple[Traits, int | None, float], min_samples: int = 3) -> RuntimeModel:
    model = RuntimeModel(min_samples=min_samples)
    for traits, limit, runtime in samples:
        model.observe(traits, limit, runtime)
    return model


def test_without_history_a_job_runs_to_its_limit_and_one_without_a_limit_runs_for_good() -> None:
    model = RuntimeModel()
    assert model.runtime(ANN, 3600) == 3600
    assert model.runtime(ANN, 3600, elapsed=600) == 3600
    assert model.runtime(ANN, None) is None


def test_too_little_history_is_not_trusted() -> None:
    model = learned((ANN, 3600, 900), (ANN, 3600, 900))
    assert model.runtime(ANN, 3600) == 3600


def test_it_learns_each_users_share_of_the_limit() -> None:
    model = learned(*[(ANN, 3600, 900)] * 3, *[(BOB, 3600, 3240)] * 3)
    assert model.runtime(ANN, 7200) == approx(1800)  # a quarter of any limit
    assert model.runtime(BOB, 1000) == approx(900)
    newcomer = Traits(creator="cy", project="vision", kind="resnet", flavor="cpu-4", nodes=1)
    assert model.runtime(newcomer, 1000) == approx(575)  # the project's jobs, both users together


def test_a_user_without_history_gets_the_share_of_jobs_of_the_same_shape() -> None:
    big = Traits(creator="ann", project="nlp", kind="bert", flavor="gpu-8", nodes=4)
    small = Traits(creator="bob", project="audio", kind="wav", flavor="cpu-4", nodes=1)
    model = learned(*[(big, 3600, 3600)] * 3, *[(small, 3600, 360)] * 3)
    newcomer = Traits(creator="cy", project="speech", kind="x", flavor="gpu-8", nodes=4)
    assert model.runtime(newcomer, 3600) == 3600
    assert model.runtime(Traits.of(spec(1), "cy"), 3600) == approx(360)  # cpu-4, one node


def test_a_running_job_is_compared_with_jobs_that_ran_longer_than_it_has() -> None:
    model = learned((ANN, 1000, 200), (ANN, 1000, 400), (ANN, 1000, 600), (ANN, 1000, 800), min_samples=2)
    assert model.runtime(ANN, 1000) == approx(500)
    assert model.runtime(ANN, 1000, elapsed=500) == approx(700)  # only the jobs that ran 600 and 800
    assert model.runtime(ANN, 1000, elapsed=700) == 1000  # longer than all but one: it may run to its limit


def test_jobs_without_a_limit_are_estimated_from_how_long_such_jobs_ran() -> None:
    model = learned((ANN, None, 3600), (ANN, None, 7200), (ANN, None, 10_800))
    assert model.runtime(ANN, None) == 7200
    assert model.runtime(ANN, None, elapsed=12_000) is None  # longer than any: no idea when it ends
    assert model.runtime(ANN, 3600) == 3600  # jobs with a limit are learned apart


def test_recent_jobs_count_and_old_ones_are_forgotten() -> None:
    model = RuntimeModel(window=3, min_samples=3)
    for runtime in (3600, 3600, 3600, 360, 360, 360):
        model.observe(ANN, 3600, runtime)
    assert model.runtime(ANN, 3600) == approx(360)


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from([None, 600, 3600]), st.floats(0, 20_000)), max_size=12),
       st.sampled_from([None, 60, 600, 3600]), st.floats(0, 4000))
def test_an_estimate_is_never_below_what_the_job_ran_nor_above_its_limit(
        samples: list[tuple[int | None, float]], limit: int | None, elapsed: float) -> None:
    model = learned(*[(ANN, sample_limit, runtime) for sample_limit, runtime in samples], min_samples=1)
    if limit is not None:
        elapsed = min(elapsed, limit)
    estimate = model.runtime(ANN, limit, elapsed)
    if limit is not None:
        assert estimate is not None and elapsed <= estimate <= limit
    elif estimate is not None:
        assert estimate >= elapsed


def test_the_kind_of_a_job_is_the_leading_letters_of_its_name() -> None:
    assert [kind_of(n) for n in ("resnet50-lr3", "BERT_large", "7b-run", "tf-12")] == ["resnet", "bert", "7b-run",
                                                                                      "tf"]


# --- the likely ends and runtimes handed to the plan ---------------------------------------------------------


def test_likely_ends_lie_between_now_and_the_limit_and_unknown_jobs_keep_their_limits() -> None:
    model = learned(*[(Traits.of(spec(1), "ann", "cpu-4"), 3600, 900)] * 3)
    running = [run_on("short", ["a"], ends_in=3000), run_on("late", ["b"], ends_in=600), run_on("nobody", ["c"],
                                                                                           ends_in=600)]
    records = {"short": Rec(spec(1), started=-600), "late": Rec(spec(1), started=-3000)}
    queue = [queued("q1", duration=3600), queued("q2")]
    records["q1"] = Rec(spec(1), started=None)
    expected = expected_runtimes(model, queue, running, records, NOW)
    assert expected.ends == {"short": NOW + timedelta(seconds=300)}  # "late" is past what others ran: its limit
    assert expected.seconds == {"q1": 900}  # "q2" has no limit and none of its kind was seen
    assert expected_runtimes(RuntimeModel(), queue, running, records, NOW).empty


class Rec:
    """A job record: submitted by ann, with a one-hour limit, started `started` seconds from NOW."""

    def __init__(self, job_spec: JobSpec, started: int | None) -> None:
        self.spec, self.creator, self.flavor, self.ended_at = job_spec, "ann", "cpu-4", None
        self.started_at = NOW + timedelta(seconds=started) if started is not None else None
        self.duration_seconds: int | None = 3600


# --- a fold over the log ---------------------------------------------------------------------------------------


def job_log(count: int) -> list[EventEnvelope]:
    """Jobs of two users that start at once and end after a share of their one-hour limit."""
    envelopes: list[EventEnvelope] = []

    def add(event: JobSubmitted | JobAdmitted | JobSucceeded | JobFailed, minute: float) -> None:
        envelopes.append(EventEnvelope(
            event_id=f"e{len(envelopes)}", service="scheduler", aggregate_type="job", aggregate_id=event.job_id,
            version=1, position=len(envelopes) + 1, recorded_at=NOW + timedelta(minutes=minute), event=event))

    for index in range(count):
        job_id, user = f"job-{index:012}", "ann" if index % 2 else "bob"
        job_spec = msgspec.structs.replace(spec(1, duration="1h"), name=f"resnet-{index}")
        add(JobSubmitted(job_id=job_id, spec=job_spec, creator=user), index)
        add(JobAdmitted(job_id=job_id, attempt=1, flavor="cpu-4",
                        placement=[Placement(rank=0, node="a", address="addr-a", slots=1)]), index)
        runtime = 15 if user == "ann" else 50 + index % 7
        add(JobSucceeded(job_id=job_id) if index % 3 else JobFailed(job_id=job_id, reason="oom"), index + runtime)
    return sorted(envelopes, key=lambda e: (e.recorded_at, e.position))


def rebuild(envelopes: list[EventEnvelope]) -> PredictionCache:
    state = SchedulerState(ClusterConfig(flavors=list(FLAVORS.values())))
    cache = PredictionCache()
    for envelope in envelopes:
        state.apply(envelope)
        cache.applied(envelope, state.jobs)
    return cache


def test_replaying_the_log_rebuilds_the_same_model() -> None:
    envelopes = job_log(40)
    first, again = rebuild(envelopes), rebuild(envelopes)
    assert first.runtimes.observed == 40
    assert first.runtimes.history() == again.runtimes.history()
    ann = Traits.of(msgspec.structs.replace(spec(1), name="resnet-x"), "ann", CPU4.name)
    assert first.runtimes.runtime(ann, 3600) == again.runtimes.runtime(ann, 3600) == 900
    assert first.revision == again.revision == len(envelopes)
