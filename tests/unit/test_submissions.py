"""Submissions in batches (group commit) and the predictions planned after them (S6).

A batch of submissions is decided in order as one at a time would be: a job id seen before is answered as
the first time, the urgent cap counts the urgent jobs of the same batch; and a submission that arrives
while one append is written joins the next. A job's prediction, planned with other new jobs once it is
queued, says what planning it alone would have said, and a job admitted before it was planned has its
start recorded as its prediction, before its admission.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from libs.contracts.events import JobPredicted, JobStopped
from libs.contracts.identity import Identity
from libs.contracts.jobspec import PRIORITY_RANK, AlgorithmRef, JobSpec, OutputRef, Priority
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.jobs import JobAccepted
from libs.contracts.scheduling import AdminSettings
from libs.eventstore import NewEvent
from libs.placement import CYCLE_DEPTH, QueuedJob
from services.scheduler.domain.state import SchedulerState
from services.scheduler.planning.decision_inputs import node_capacity
from services.scheduler.planning.prediction import forecast, forecast_queued
from services.scheduler.rules import cycle, predicted
from services.scheduler.rules.submissions import Answer, Submission, SubmissionBatches, decide
from tests.support.placement import NOW, spec
from tests.support.scheduler_state import Fold
from tests.support.strategies import SETTINGS, Scenario, scenarios
from tests.support.waiting import eventually

ALICE = Identity(user="alice", projects=["default"])
BOB = Identity(user="bob", projects=["default"])


def submission(job_id: str, name: str = "j", who: Identity = ALICE, priority: Priority = "normal") -> Submission:
    job_spec = JobSpec(name=name, flavors=["cpu-4"], algorithm=AlgorithmRef(name="code"), command="python3 t.py",
                       output=OutputRef(name="o"), priority=priority)
    return Submission(job_id=job_id, spec=job_spec, identity=who)


def kinds(changes: Sequence[NewEvent]) -> list[tuple[str, str]]:
    return [(change.aggregate_id, type(change.event).__name__) for change in changes]


# --- one batch, decided in order ---------------------------------------------------------------------------


def accept(state: SchedulerState, submissions: Sequence[Submission]) -> tuple[list[Answer], list[NewEvent]]:
    """A batch's answers and events, every user's submission bucket full."""
    decided = decide(state, submissions, {})
    return decided.answers, decided.changes


def test_a_batch_creates_each_new_job_once_and_answers_a_repeated_id_as_the_first_time() -> None:
    fold = Fold()
    fold.job("job-000000000001", "old", ["cpu-4"])
    answers, changes = accept(fold.state, [
        submission("job-00000000000a"),
        submission("job-00000000000a"),  # sent again: the same job
        submission("job-00000000000a", name="other"),  # another spec under the same id
        Submission(job_id="job-000000000001", spec=fold.state.jobs["job-000000000001"].spec, identity=ALICE),
    ])
    assert kinds(changes) == [("job-00000000000a", "JobSubmitted")]
    assert [(a.created, a.status) for a in answers if isinstance(a, JobAccepted)] == [
        (True, "queued"), (False, "queued"), (False, "queued")]
    [conflict] = [a for a in answers if isinstance(a, CommandError)]
    assert conflict.code == "conflict"


def test_the_urgent_cap_counts_the_urgent_jobs_of_the_same_batch() -> None:
    fold = Fold()
    fold.state.settings = AdminSettings(urgent_cap=2)
    fold.job("job-000000000001", "urgent", ["cpu-4"], priority="urgent")
    answers, changes = accept(fold.state, [submission(f"job-00000000000{i}", priority="urgent") for i in "abc"]
                              + [submission("job-00000000000d", who=BOB, priority="urgent")])
    assert [isinstance(a, JobAccepted) for a in answers] == [True, False, False, True]
    assert [a.code for a in answers if isinstance(a, CommandError)] == ["over-cap", "over-cap"]
    assert [job for job, _ in kinds(changes)] == ["job-00000000000a", "job-00000000000d"]


def test_a_prediction_planned_before_the_job_joined_is_recorded_with_it() -> None:
    fold = Fold()
    planned = forecast(spec(), [], [], {}, now=NOW).prediction
    answers, changes = accept(fold.state, [replace(submission("job-00000000000a"), prediction=planned)])
    assert kinds(changes) == [("job-00000000000a", "JobSubmitted"), ("job-00000000000a", "JobPredicted")]
    assert isinstance(answers[0], JobAccepted) and answers[0].prediction == planned


async def test_submissions_that_arrive_while_an_append_is_written_are_recorded_together_in_the_next() -> None:
    fold = Fold()
    appends: list[list[str]] = []
    writing = asyncio.Event()

    async def record(changes: Sequence[NewEvent]) -> None:
        appends.append([change.aggregate_id for change in changes])
        if len(appends) == 1:
            await writing.wait()  # the first append takes a while

    batches = SubmissionBatches(fold.state, asyncio.Lock(), record)
    first = asyncio.ensure_future(batches.submit(submission("job-00000000000a")))
    await eventually(lambda: _true(appends))
    later = [asyncio.ensure_future(batches.submit(submission(f"job-00000000001{i}"))) for i in range(5)]
    await asyncio.sleep(0.01)
    assert not first.done()  # answered only once its append is written
    writing.set()
    answers = [await first, *[await answer for answer in later]]
    assert appends == [["job-00000000000a"], [f"job-00000000001{i}" for i in range(5)]]
    assert all(isinstance(a, JobAccepted) and a.created for a in answers)


async def test_an_append_that_fails_fails_each_submission_of_its_batch_and_the_next_batch_is_written() -> None:
    fold = Fold()
    calls = 0

    async def record(changes: Sequence[NewEvent]) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionRefusedError("the database is away")

    batches = SubmissionBatches(fold.state, asyncio.Lock(), record)
    failed = asyncio.gather(*(batches.submit(submission(f"job-00000000000{i}")) for i in "ab"),
                            return_exceptions=True)
    assert all(isinstance(answer, ConnectionRefusedError) for answer in await failed)
    assert isinstance(await batches.submit(submission("job-00000000000c")), JobAccepted)


async def _true(value: object) -> bool:
    return bool(value)


# --- predictions planned after the jobs joined -------------------------------------------------------------


@SETTINGS
@given(scenarios(), st.data())
def test_a_new_job_planned_with_the_queue_it_joined_gets_what_planning_it_alone_would_have_said(
        scenario: Scenario, data: st.DataObject) -> None:
    queue = sorted(scenario.queue, key=lambda job: PRIORITY_RANK[job.spec.priority])
    flavor = data.draw(st.sampled_from(sorted(scenario.flavors)))
    new = QueuedJob("new", spec(data.draw(st.integers(1, 3)), [flavor]), data.draw(st.sampled_from([None, 60, 3600])))
    alone = forecast(new.spec, queue, scenario.nodes, scenario.flavors, running=scenario.running, now=NOW,
                     duration_seconds=new.duration_seconds)
    together = forecast_queued(["new"], [*queue, new], scenario.nodes, scenario.flavors, running=scenario.running,
                               now=NOW)
    assert together["new"].prediction == alone.prediction


def test_a_job_no_longer_queued_gets_no_forecast_from_the_plan() -> None:
    assert forecast_queued(["gone"], [QueuedJob("other", spec())], [], {}, now=NOW) == {}


def test_jobs_admitted_before_their_prediction_was_planned_have_their_start_recorded_as_it_first() -> None:
    fold = Fold()
    fold.node("n1")
    fold.job("job-00000000000a", "a", ["cpu-4"])
    fold.job("job-00000000000b", "b", ["cpu-4"])
    fold.apply(JobPredicted(job_id="job-00000000000b",
                            prediction=forecast(spec(), [], [], {}, now=NOW).prediction), aggregate="job-00000000000b")
    decision = cycle.decide(fold.state, NOW)
    assert decision is not None and {a.job_id for a in decision.admissions} == {"job-00000000000a",
                                                                               "job-00000000000b"}
    changes = cycle.admissions(fold.state, decision, NOW)
    assert [(job, kind) for job, kind in kinds(changes)] == [
        ("job-00000000000a", "JobPredicted"), ("job-00000000000a", "JobAdmitted"), ("job-00000000000b", "JobAdmitted")]
    started = changes[0].event
    assert isinstance(started, JobPredicted) and started.prediction.starts_now
    assert started.prediction.nodes == ["n1"] and started.prediction.predicted_at == NOW


def test_the_prediction_loop_records_plans_for_queued_jobs_and_starts_for_admitted_ones() -> None:
    fold = Fold()
    fold.node("n1")
    for job in ("job-00000000000a", "job-00000000000b"):
        fold.job(job, job, ["cpu-4"])
    fold.admit("job-00000000000a", "cpu-4", ["n1"])  # admitted before its prediction was planned
    assert predicted.to_plan(fold.state, cycle_saw=fold.state.jobs["job-00000000000b"].queue_order) == [
        "job-00000000000b"]
    planned = forecast(spec(), [], [], {}, now=NOW)
    changes = predicted.predictions(fold.state, {"job-00000000000b": planned})
    assert kinds(changes) == [("job-00000000000a", "JobPredicted"), ("job-00000000000b", "JobPredicted")]
    assert changes[1].event == JobPredicted(job_id="job-00000000000b", prediction=planned.prediction)
    for change in changes:
        fold.apply(change.event, aggregate=change.aggregate_id)
    assert not fold.state.unpredicted


def test_only_jobs_a_cycle_left_waiting_have_their_prediction_planned() -> None:
    """A job's next cycle usually admits it, and its start is then its prediction: the plan of the queue is played
    only for the jobs a cycle has looked at and left queued."""
    fold = Fold()
    for job in ("job-00000000000a", "job-00000000000b"):
        fold.job(job, job, ["cpu-4"])
    assert predicted.to_plan(fold.state, cycle_saw=0) == []
    assert not predicted.left_waiting(fold.state, cycle_saw=0)
    seen = predicted.newest_waiting(fold.state)
    fold.job("job-00000000000c", "c", ["cpu-4"])  # submitted after the cycle looked
    assert predicted.to_plan(fold.state, cycle_saw=seen) == ["job-00000000000a", "job-00000000000b"]
    assert predicted.left_waiting(fold.state, cycle_saw=seen)
    assert predicted.newest_waiting(fold.state) == fold.state.jobs["job-00000000000c"].queue_order


def test_a_job_that_ends_without_starting_needs_no_prediction_any_more() -> None:
    fold = Fold()
    fold.job("job-00000000000a", "a", ["cpu-4"])
    assert list(fold.state.unpredicted) == ["job-00000000000a"]
    fold.apply(JobStopped(job_id="job-00000000000a", by="alice"), aggregate="job-00000000000a")
    assert not fold.state.unpredicted and predicted.predictions(fold.state, {}) == []


def test_jobs_no_node_could_take_do_not_keep_the_jobs_behind_them_out_of_the_cycle() -> None:
    fold = Fold()
    fold.node("n1")
    for n in range(CYCLE_DEPTH + 100):  # more than a cycle looks at, for a pool no node serves
        fold.job(f"job-{n:012x}", "held", ["cpu-4"], pool="held")
    fold.job("job-ffffffffffff", "served", ["cpu-4"])
    decision = cycle.decide(fold.state, NOW)
    assert decision is not None and [a.job_id for a in decision.admissions] == ["job-ffffffffffff"]


def test_a_cycle_keeps_the_last_cycles_cluster_only_while_its_nodes_and_flavors_stay_the_same() -> None:
    fold = Fold()
    fold.node("n1")
    nodes = node_capacity(fold.state)
    kept = cycle.cluster_of(nodes, fold.state.flavors)
    assert cycle.cluster_of(node_capacity(fold.state), fold.state.flavors) is kept
    fold.node("n2")
    grown = cycle.cluster_of(node_capacity(fold.state), fold.state.flavors)
    assert grown is not kept and set(grown.infos) == {"n1", "n2"}
    fewer = {name: flavor for name, flavor in fold.state.flavors.items() if name != "cpu-4"}
    assert cycle.cluster_of(node_capacity(fold.state), fewer) is not grown
