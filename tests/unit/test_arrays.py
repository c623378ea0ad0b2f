"""Job arrays: their expressions and sweeps as Slurm users write them, the jobs an array makes, and the
`%N` cap on how many run at once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.contracts.arrays import (
    INDEX_VARIABLE,
    MAX_ARRAY_JOBS,
    ArrayError,
    SweepParameter,
    describe_indices,
    parse_indices,
    parse_sweep,
    sweep_points,
)
from libs.contracts.events import ArraySubmitted, JobSubmitted, JobSucceeded
from libs.contracts.identity import Identity
from libs.contracts.jobspec import AlgorithmRef, BatchTask, JobSpec, OutputRef
from libs.contracts.operations.arrays import ArraySelection, SubmitArray
from libs.contracts.operations.base import CommandError
from services.scheduler.domain import arrays
from services.scheduler.rules import cycle
from tests.support.placement import NOW
from tests.support.scheduler_state import Fold
from tests.support.strategies import SETTINGS

ALICE = Identity(user="alice", projects=["default"])
SPEC = JobSpec(name="train-{index}", flavors=["cpu-4"], algorithm=AlgorithmRef(name="code"),
               command="python3 train.py --seed {index} --lr {LR}", output=OutputRef(name="o"), env={"A": "1"})


# --- expressions and sweeps --------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "indices", "cap"), [
    ("0-4", [0, 1, 2, 3, 4], None),
    ("1-10:2", [1, 3, 5, 7, 9], None),
    ("0,6,16-18", [0, 6, 16, 17, 18], None),
    ("3-5,4,0%2", [0, 3, 4, 5], 2),
    ("7", [7], None),
])
def test_array_expressions_read_as_slurm_writes_them(text: str, indices: list[int], cap: int | None) -> None:
    parsed = parse_indices(text)
    assert (parsed.indices, parsed.max_running) == (indices, cap)


@pytest.mark.parametrize(("text", "words"), [
    ("", "is not an index"),
    ("5-1", "must not end before it starts"),
    ("1-9:0", "step must be at least 1"),
    ("0-9%0", "whole number of at least 1"),
    ("a-b", "is not an index"),
    (f"0-{MAX_ARRAY_JOBS}", "more than"),
])
def test_a_bad_array_expression_is_refused_saying_what_to_write(text: str, words: str) -> None:
    with pytest.raises(ArrayError, match=words):
        parse_indices(text)


@SETTINGS
@given(st.sets(st.integers(0, 5000), min_size=1, max_size=300))
def test_indices_written_back_as_an_expression_read_as_the_same_indices(indices: set[int]) -> None:
    ordered = sorted(indices)
    assert parse_indices(describe_indices(ordered)).indices == ordered


def test_runs_of_one_step_are_written_short() -> None:
    assert describe_indices(list(range(1000))) == "0-999"
    assert describe_indices([1, 3, 5, 7, 20, 21]) == "1-7:2,20,21"


def test_a_sweep_is_the_cross_product_of_its_parameters_the_first_changing_slowest() -> None:
    points = sweep_points([parse_sweep("LR=0.1,0.01"), parse_sweep("BS=32,64")])
    assert points == [{"LR": "0.1", "BS": "32"}, {"LR": "0.1", "BS": "64"},
                      {"LR": "0.01", "BS": "32"}, {"LR": "0.01", "BS": "64"}]


@pytest.mark.parametrize(("text", "words"), [("lr", "NAME=value1,value2"), ("1x=3", "NAME=value1"),
                                             ("lr=0.1,,0.2", "is empty")])
def test_a_bad_sweep_parameter_is_refused(text: str, words: str) -> None:
    with pytest.raises(ArrayError, match=words):
        parse_sweep(text)


def test_a_sweep_given_a_parameter_twice_or_too_large_is_refused() -> None:
    with pytest.raises(ArrayError, match="given twice: lr"):
        sweep_points([parse_sweep("lr=1,2"), parse_sweep("lr=3")])
    big = [SweepParameter(name=f"p{i}", values=[str(v) for v in range(11)]) for i in range(4)]
    with pytest.raises(ArrayError, match="more than"):
        sweep_points(big)


# --- the jobs an array makes -------------------------------------------------------------------------------


def test_each_job_has_its_index_and_sweep_values_filled_in_and_in_its_environment() -> None:
    spec = arrays.member_spec(SPEC, "array-0123456789ab", 7, {"LR": "0.1"})
    assert spec.name == "train-7"
    assert spec.command == "python3 train.py --seed 7 --lr 0.1"
    assert spec.env == {"A": "1", "LR": "0.1", INDEX_VARIABLE: "7", "TRAINYARD_ARRAY_ID": "array-0123456789ab"}
    batch = JobSpec(name="b", type="batch", flavors=["cpu-4"], output=OutputRef(name="o"),
                    tasks=[BatchTask(algorithm=AlgorithmRef(name="code"), command="run {index}")])
    assert arrays.member_spec(batch, "array-0123456789ab", 3, {}).tasks[0].command == "run 3"


def test_an_arrays_job_ids_follow_from_its_id_and_index() -> None:
    first = arrays.member_id("array-0123456789ab", 3)
    assert first == arrays.member_id("array-0123456789ab", 3) != arrays.member_id("array-0123456789ab", 4)
    assert first.startswith("job-") and len(first) == 16


def test_an_array_is_recorded_as_one_object_and_an_ordinary_job_per_index() -> None:
    request = SubmitArray(array_id="array-0123456789ab", spec=SPEC, indices="0-2%2")
    indices, values, cap = arrays.points(request)
    changes = arrays.array_events(request, ALICE, indices, values, cap)
    head, *jobs = [change.event for change in changes]
    assert isinstance(head, ArraySubmitted) and (head.indices, head.size, head.max_running) == ("0-2", 3, 2)
    assert all(isinstance(job, JobSubmitted) for job in jobs)
    assert [(job.array.index, job.spec.name) for job in jobs if isinstance(job, JobSubmitted) and job.array] == [
        (0, "train-0"), (1, "train-1"), (2, "train-2")]


def test_indices_and_a_sweep_together_or_neither_are_refused_and_the_cap_once() -> None:
    for request in (SubmitArray(array_id="array-0123456789ab", spec=SPEC),
                    SubmitArray(array_id="array-0123456789ab", spec=SPEC, indices="0-3",
                                sweep=[SweepParameter(name="LR", values=["1"])]),
                    SubmitArray(array_id="array-0123456789ab", spec=SPEC, indices="0-3%2", max_running=2)):
        with pytest.raises(ArrayError):
            arrays.points(request)


def test_the_widest_job_is_the_one_whose_placeholders_are_longest() -> None:
    sweep = [SweepParameter(name="LR", values=["0.1", "0.000001"])]
    widest = arrays.widest_spec(SPEC, "array-0123456789ab", [1, 100, 7], sweep)
    assert widest.name == "train-100" and widest.command == "python3 train.py --seed 100 --lr 0.000001"


# --- selecting and capping -------------------------------------------------------------------------------


def folded(request: SubmitArray) -> Fold:
    fold = Fold()
    fold.node("n1")
    indices, values, cap = arrays.points(request)
    for change in arrays.array_events(request, ALICE, indices, values, cap):
        fold.apply(change.event, aggregate=change.aggregate_id)
    return fold


def test_a_selection_names_all_of_an_arrays_jobs_or_those_of_some_indices() -> None:
    fold = folded(SubmitArray(array_id="array-0123456789ab", spec=SPEC, indices="0-9"))
    every = arrays.selected_jobs(fold.state, [ArraySelection(array_id="array-0123456789ab")])
    some = arrays.selected_jobs(fold.state, [ArraySelection(array_id="array-0123456789ab", indices="2,4-5")])
    assert isinstance(every, list) and len(every) == 10
    assert some == [arrays.member_id("array-0123456789ab", i) for i in (2, 4, 5)]
    missing = arrays.selected_jobs(fold.state, [ArraySelection(array_id="array-0123456789ab", indices="12")])
    assert isinstance(missing, CommandError) and missing.code == "not-found" and "0-9" in (missing.hint or "")


def test_at_most_the_cap_of_an_arrays_jobs_start_and_the_next_once_one_ended() -> None:
    fold = folded(SubmitArray(array_id="array-0123456789ab", spec=SPEC, indices="0-5%2"))
    decision = cycle.decide(fold.state, NOW)
    assert decision is not None
    started = [a.job_id for a in decision.admissions]
    assert started == [arrays.member_id("array-0123456789ab", i) for i in (0, 1)]  # the node has room for all
    for admission in decision.admissions:
        fold.admit(admission.job_id, admission.flavor, ["n1"])
    waiting = cycle.decide(fold.state, NOW)
    assert waiting is None or not waiting.admissions  # the others wait for one of the two to end
    fold.apply(JobSucceeded(job_id=started[0]))
    decision = cycle.decide(fold.state, NOW)
    assert decision is not None and [a.job_id for a in decision.admissions] == [
        arrays.member_id("array-0123456789ab", 2)]


def test_an_arrays_view_counts_its_jobs_by_status() -> None:
    fold = folded(SubmitArray(array_id="array-0123456789ab", spec=SPEC, indices="0-3"))
    fold.admit(arrays.member_id("array-0123456789ab", 1), "cpu-4", ["n1"])
    view = arrays.array_view(fold.state, fold.state.arrays["array-0123456789ab"])
    assert view.statuses == {"queued": 3, "running": 1} and view.status == "running" and view.size == 4
    details = arrays.array_details(fold.state, fold.state.arrays["array-0123456789ab"], after=0, limit=2)
    assert [job.index for job in details.jobs] == [1, 2] and details.more
