"""The autoscaler's state saved in a snapshot and loaded back: over any history of its own, the scheduler's and the
monitor's events (hypothesis), a state loaded from a snapshot holds and decides what the saved one did and, folded on
with the rest of the history, ends where the state that folded all of it ends; the log it shows comes back too."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from libs.contracts.cluster import Accelerators, NodeInfo, Resources
from libs.contracts.events import (
    Event,
    InstanceDraining,
    InstanceKept,
    InstanceLaunched,
    InstanceReady,
    InstanceReleased,
    InstanceRequested,
    JobAdmitted,
    JobArchived,
    JobDeleted,
    JobPrechecking,
    JobSubmitted,
    JobSucceeded,
    NodeDrained,
    NodeLost,
    NodeRegistered,
    NodeRetired,
    Placement,
    ProvisionFailed,
    WaitingJobsPacked,
)
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from services.autoscaler.service import Autoscaler
from services.autoscaler.state import AutoscalerState
from tests.support.autoscaling import AT, CLUSTER
from tests.support.eventlog import EventLog, fake_runtime
from tests.support.strategies import SETTINGS

SPEC = JobSpec(name="j", flavors=["gpu-1"], algorithm=AlgorithmRef(name="a"), command="true",
               output=OutputRef(name="o"))
JOBS = ["job-1", "job-2", "job-3"]
INSTANCES = ["gpu-aaa", "gpu-bbb"]

Step = tuple[Any, ...]


def gpu_node(name: str) -> NodeInfo:
    return NodeInfo(name=name, address="10.0.0.9", cpus=8.0, memory_mib=32768,
                    accelerators=[Accelerators(board="a100", count=2)])


def steps() -> st.SearchStrategy[list[Step]]:
    job, instance = st.sampled_from(JOBS), st.sampled_from(INSTANCES)
    return st.lists(st.one_of(
        st.tuples(st.just("submit"), job), st.tuples(st.just("precheck"), job, instance),
        st.tuples(st.just("admit"), job, instance), st.tuples(st.just("succeed"), job),
        st.tuples(st.just("delete"), job), st.tuples(st.just("archive"), job),
        st.tuples(st.just("request"), instance, st.lists(job, max_size=2, unique=True)),
        st.tuples(st.just("launched"), instance), st.tuples(st.just("ready"), instance),
        st.tuples(st.just("draining"), instance), st.tuples(st.just("drained"), instance),
        st.tuples(st.just("kept"), instance), st.tuples(st.just("released"), instance),
        st.tuples(st.just("failed"), instance), st.tuples(st.just("registered"), instance),
        st.tuples(st.just("lost"), instance), st.tuples(st.just("retired"), instance),
        st.tuples(st.just("packed"), st.lists(job, max_size=2, unique=True), instance),
    ), min_size=5, max_size=50)


class History:
    """Folds steps into an autoscaler's state as the autoscaler does, numbered in one log."""

    def __init__(self) -> None:
        self.log = EventLog()

    def own(self, state: AutoscalerState, event: Event) -> None:
        state.apply(self.log.record("autoscaler", "instance", getattr(event, "instance", "packing"), event))

    def scheduler(self, state: AutoscalerState, event: Event) -> None:
        kind = "drain" if isinstance(event, NodeDrained) else "job"
        aggregate = event.node_name if isinstance(event, NodeDrained) else getattr(event, "job_id", "")
        state.apply_scheduler(self.log.record("scheduler", kind, aggregate, event))

    def monitor(self, state: AutoscalerState, event: Event) -> None:
        state.apply_monitor(self.log.record("monitor", "node", getattr(event, "node_name", ""), event))

    def fold(self, state: AutoscalerState, step: Step) -> None:
        kind, *args = step
        now = self.log.now
        placed = [Placement(rank=0, node=args[1], address="10.0.0.9", slots=1)] if kind in ("precheck", "admit") \
            else []
        events: dict[str, tuple[str, Any]] = {
            "submit": ("scheduler", lambda: JobSubmitted(job_id=args[0], spec=SPEC, creator="alice")),
            "precheck": ("scheduler", lambda: JobPrechecking(job_id=args[0], attempt=1, flavor="gpu-1",
                                                             placement=placed)),
            "admit": ("scheduler", lambda: JobAdmitted(job_id=args[0], attempt=1, flavor="gpu-1", placement=placed)),
            "succeed": ("scheduler", lambda: JobSucceeded(job_id=args[0])),
            "delete": ("scheduler", lambda: JobDeleted(job_id=args[0], by="alice")),
            "archive": ("scheduler", lambda: JobArchived(job_id=args[0], retention="1h")),
            "drained": ("scheduler", lambda: NodeDrained(node_name=args[0], instance=args[0])),
            "request": ("own", lambda: InstanceRequested(instance=args[0], instance_type="gpu", provider="local",
                                                         jobs=args[1])),
            "launched": ("own", lambda: InstanceLaunched(instance=args[0], provider_id=f"i-{args[0]}")),
            "ready": ("own", lambda: InstanceReady(instance=args[0], node=args[0])),
            "draining": ("own", lambda: InstanceDraining(instance=args[0], node=args[0], idle_since=now)),
            "kept": ("own", lambda: InstanceKept(instance=args[0], node=args[0], reason="a job came")),
            "released": ("own", lambda: InstanceReleased(instance=args[0], reason="idle")),
            "failed": ("own", lambda: ProvisionFailed(instance=args[0], instance_type="gpu", reason="no capacity",
                                                      capacity=True, retry_after=now + timedelta(minutes=5))),
            "packed": ("own", lambda: WaitingJobsPacked(packed={job_id: {args[1]: Resources(cpus=1.0)}
                                                                for job_id in args[0]}, unpacked=JOBS[:1])),
            "registered": ("monitor", lambda: NodeRegistered(node=gpu_node(args[0]))),
            "lost": ("monitor", lambda: NodeLost(node_name=args[0], last_seen=now, reason="silent")),
            "retired": ("monitor", lambda: NodeRetired(node_name=args[0], reason="released")),
        }
        source, event = events[kind]
        {"own": self.own, "scheduler": self.scheduler, "monitor": self.monitor}[source](state, event())


def decisions(state: AutoscalerState) -> list[Any]:
    """What a decision and the queries read of the state."""
    return [state.demand(CLUSTER), state.on_the_way(), state.promised(), state.alive_per_type(),
            state.cooling(AT), state.busy_nodes(), state.to_launch(), state.queued, state.running,
            state.instance_views(), state.queued_by_flavor(), dict(state.instance_counts)]


@SETTINGS
@given(steps(), st.data())
def test_an_autoscaler_state_folded_on_from_its_snapshot_ends_where_folding_everything_ends(
        history: list[Step], data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(history)))
    whole, everything = History(), AutoscalerState()
    for step in history:
        whole.fold(everything, step)
    part, before = History(), AutoscalerState()
    for step in history[:cut]:
        part.fold(before, step)
    saved = before.saved()
    restored = AutoscalerState.loaded(saved)
    assert restored.saved() == saved
    assert decisions(restored) == decisions(before)
    for job_id, job in restored.open_jobs.items():  # the same records as the lifecycle's, as the folds keep them
        assert job is restored.lifecycle.jobs[job_id]
    assert all(restored.live[name] is restored.instances[name] for name in restored.live)
    for step in history[cut:]:
        part.fold(restored, step)
    assert restored.saved() == everything.saved()
    assert decisions(restored) == decisions(everything)


def test_an_autoscaler_started_from_its_snapshot_shows_the_log_it_showed() -> None:
    log = EventLog()
    autoscaler = Autoscaler(fake_runtime(log, "autoscaler"), CLUSTER, providers={})
    history = History()
    history.log = log
    for step in [("submit", "job-1"), ("request", "gpu-aaa", ["job-1"]), ("launched", "gpu-aaa"),
                 ("packed", ["job-1"], "gpu-aaa"), ("ready", "gpu-aaa")]:
        kind = step[0]
        if kind == "submit":
            history.fold(autoscaler.state, step)
        else:  # the autoscaler's own: through its fold, as a rebuild does
            before = len(log.envelopes)
            history.fold(AutoscalerState(), step)
            autoscaler.apply(log.envelopes[before])
    again = Autoscaler(fake_runtime(log, "autoscaler"), CLUSTER, providers={})
    again.load_state(autoscaler.save_state())
    assert list(again.history) == list(autoscaler.history) and len(again.history) == 3  # not the packing
    assert again.state.saved() == autoscaler.state.saved()
