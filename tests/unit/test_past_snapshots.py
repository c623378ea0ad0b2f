"""Snapshots of past states: what a view restores from one is the state that was saved, and goes on folding alike."""

from __future__ import annotations

import gc
from datetime import timedelta

from libs.contracts.events import JobStopped, JobSucceeded, NodeRegistered
from services.scheduler.domain.state import SchedulerState
from services.scheduler.history.past_snapshots import dump, load
from services.scheduler.planning.decision_inputs import queued_jobs, running_jobs
from services.scheduler.planning.prediction_cache import PredictionCache
from tests.support.scheduler_state import AT, Fold


def folded() -> tuple[Fold, PredictionCache]:
    """Jobs in every state a snapshot meets: queued, running with a limit, ended; the decision logic's views of
    them worked out (as a cycle leaves them)."""
    fold = Fold()
    fold.node("gpu-1", "A100", 4)
    fold.node("gpu-2", "A100", 4)
    for n in range(6):
        fold.job(f"job-{n:012x}", f"run-{n}", ["a100-4", "a100-1"], duration="2h" if n % 2 else None)
    for n, node in ((0, "gpu-1"), (1, "gpu-2"), (2, "gpu-1")):
        fold.admit(f"job-{n:012x}", "a100-1", [node])
    fold.apply(JobSucceeded(job_id="job-000000000000"), aggregate="job-000000000000")
    fold.apply(JobStopped(job_id="job-000000000003", by="alice"), aggregate="job-000000000003")
    queued_jobs(fold.state, AT), running_jobs(fold.state, AT + timedelta(minutes=5))
    return fold, PredictionCache()


def test_a_restored_state_is_the_saved_one_and_folds_on_alike() -> None:
    fold, predictions = folded()
    versions = {("job", "job-000000000001"): 2}
    state, _, restored_versions = load(dump(fold.state, predictions, versions))
    assert restored_versions == versions
    saved = fold.state
    assert state.jobs == saved.jobs and state.nodes == saved.nodes
    assert [j.job_id for j in state.queue()] == [j.job_id for j in saved.queue()] == ["job-000000000004",
                                                                                       "job-000000000005"]
    assert [j.job_id for j in state.holding()] == ["job-000000000001", "job-000000000002"]
    assert state.used() == saved.used() and state.used()["gpu-1"].accelerators == 1
    # One job, one object: the indexes hold the jobs the state holds, not copies of them.
    assert all(state.active[job_id] is state.jobs[job_id] for job_id in state.active)
    assert all(job is state.jobs[job.job_id] for job in state.queue())
    # The decision logic's views are worked out again from the restored job, as from the saved one.
    assert [(q.job_id, q.duration_seconds) for q in queued_jobs(state, AT)] == \
           [(q.job_id, q.duration_seconds) for q in queued_jobs(saved, AT)]
    later = AT + timedelta(minutes=5)
    assert [(r.job_id, r.ends_at) for r in running_jobs(state, later)] == \
           [(r.job_id, r.ends_at) for r in running_jobs(saved, later)]
    # And the next events fold into both alike.
    restored = Fold()
    restored.state, restored.position = state, fold.position
    for each in (fold, restored):
        each.apply(JobSucceeded(job_id="job-000000000002"), aggregate="job-000000000002")
    assert state.jobs == saved.jobs and state.used() == saved.used()
    assert [j.job_id for j in state.holding()] == ["job-000000000001"]


def test_a_restored_state_let_go_leaves_no_cycles_for_the_collector() -> None:
    """A view freezes a large past state out of the collector's sight: it must still be freed by reference counts."""
    fold, predictions = folded()
    fold.apply(NodeRegistered(node=fold.state.nodes["gpu-1"].info), "monitor")
    data = dump(fold.state, predictions, {})
    gc.collect()
    gc.disable()
    try:
        restored: tuple[SchedulerState, PredictionCache, dict[tuple[str, str], int]] | None = load(data)
        assert restored is not None and restored[0].jobs == fold.state.jobs
        del restored
        assert gc.collect() == 0
        del fold
        assert gc.collect() == 0
    finally:
        gc.enable()
