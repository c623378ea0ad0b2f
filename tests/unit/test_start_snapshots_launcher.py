"""The launcher's state saved in a snapshot and loaded back: over any history of its own and the scheduler's events
(hypothesis), a state loaded from a snapshot holds what the saved one did, behaves as it did, and, folded on with the
rest of the history, ends where the state that folded all of it ends."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from libs.contracts.events import (
    Event,
    EventEnvelope,
    JobAdmitted,
    JobArchived,
    JobFailed,
    JobRestarting,
    JobResuming,
    JobStopped,
    JobStopRequested,
    JobSubmitted,
    JobSucceeded,
    LaunchFailed,
    LaunchPlanned,
    LaunchStopped,
    LaunchSucceeded,
    LostProcessesStopped,
    Mount,
    NodeLaunch,
    NodeProcessExited,
    NodeProcessLost,
    NodeProcessStarted,
    Placement,
    SettingsChanged,
)
from libs.contracts.scheduling import AdminSettings
from services.launcher.rules import plan_admission
from services.launcher.state import LauncherState
from tests.support.platform import CLUSTER, plain_spec
from tests.support.strategies import SETTINGS

JOBS = ["job-00000000000a", "job-00000000000b"]
NODES = ["n1", "n2", "n3"]
T0 = datetime(2026, 5, 1, tzinfo=UTC)

Step = tuple[Any, ...]


def steps() -> st.SearchStrategy[list[Step]]:
    """What happens to a few jobs, in any order: the scheduler's events, the launcher's own, its dispatcher's
    passes (which drop settled launches from those it looks at) and the administrator's settings."""
    job = st.sampled_from(JOBS)
    nodes = st.lists(st.sampled_from(NODES), min_size=1, max_size=3, unique=True)
    processes = st.tuples(st.sampled_from(["started", "exited"]), job, st.integers(0, 2), st.sampled_from([0, 0, 1]))
    return st.lists(st.one_of(
        processes, processes, processes,
        st.tuples(st.just("submit"), job, st.integers(1, 3)),
        st.tuples(st.just("admit"), job, nodes, st.booleans()),
        st.tuples(st.just("end"), job, st.sampled_from(["stop", "resume", "restart", "failed", "succeeded",
                                                        "stopped"]), nodes),
        st.tuples(st.just("archive"), job),
        st.tuples(st.just("plan"), job),
        st.tuples(st.just("lost"), job, st.integers(0, 2)),
        st.tuples(st.just("lost_stopped"), job, st.sampled_from(NODES)),
        st.tuples(st.just("outcome"), job, st.sampled_from(["succeeded", "failed", "stopped"])),
        st.tuples(st.just("pass")),
        st.tuples(st.just("settings"), st.integers(0, 600)),
    ), min_size=5, max_size=60)


class History:
    """Folds steps into a launcher state as the launcher does (its own events and the scheduler's)."""

    def __init__(self) -> None:
        self.position = 0
        self.versions: dict[tuple[str, str], int] = {}

    def envelope(self, service: str, aggregate: tuple[str, str], event: Event) -> EventEnvelope:
        self.position += 1
        self.versions[aggregate] = self.versions.get(aggregate, 0) + 1
        return EventEnvelope(event_id=str(uuid.uuid4()), service=service, aggregate_type=aggregate[0],
                             aggregate_id=aggregate[1], version=self.versions[aggregate], position=self.position,
                             recorded_at=T0 + timedelta(seconds=self.position), event=event,
                             trace={"traceparent": f"00-{self.position:032x}-{self.position:016x}-01"})

    def scheduler(self, state: LauncherState, job_id: str, event: Event) -> None:
        state.apply_scheduler(self.envelope("scheduler", ("job", job_id), event))

    def own(self, state: LauncherState, job_id: str, event: Event) -> None:
        state.apply(self.envelope("launcher", ("launch", job_id), event))

    def fold(self, state: LauncherState, step: Step) -> None:
        kind, *args = step
        launch = state.launches.get(args[0]) if args else None
        job = state.lifecycle.jobs.get(args[0]) if args else None
        attempt = launch.attempt if launch else 1
        if kind == "submit":
            self.scheduler(state, args[0], JobSubmitted(job_id=args[0], spec=plain_spec(args[1]), creator="alice"))
        elif kind == "admit":  # submitted first when it is not known (again), and planned at once or later
            if job is None:
                self.fold(state, ("submit", args[0], len(args[1])))
                job = state.lifecycle.jobs[args[0]]
            placement = [Placement(rank=rank, node=node, address=f"10.0.0.{rank}", slots=1)
                         for rank, node in enumerate(args[1])]
            self.scheduler(state, args[0], JobAdmitted(job_id=args[0], attempt=job.attempt + 1, flavor="cpu-4",
                                                       placement=placement))
            if args[2]:
                self.fold(state, ("plan", args[0]))
        elif kind == "end" and job is not None:
            self.scheduler(state, args[0], _ending(args[0], args[1], job.attempt, args[2]))
        elif kind == "archive" and job is not None:
            self.scheduler(state, args[0], JobArchived(job_id=args[0], retention="1h"))
        elif kind == "settings":
            settings = AdminSettings(max_graceful_shutdown_seconds=args[0])
            state.apply_scheduler(self.envelope("scheduler", ("settings", "platform"),
                                                SettingsChanged(settings=settings, by="root")))
        elif kind == "plan":
            for change in plan_admission(state, CLUSTER, args[0], {}):
                self.own(state, args[0], change.event)
        elif kind == "pass":
            state.active()
            state.take_touched()
        elif launch is not None:
            self._launch_event(state, launch.job_id, kind, args[1:], attempt)

    def _launch_event(self, state: LauncherState, job_id: str, kind: str, args: list[Any], attempt: int) -> None:
        launch = state.launches[job_id]
        rank = args[0] % len(launch.plan.units) if kind in ("started", "exited", "lost") else 0
        if kind == "started":
            self.own(state, job_id, NodeProcessStarted(job_id=job_id, attempt=attempt, rank=rank,
                                                       node=launch.node((0, rank)), pid=100 + rank))
        elif kind == "exited":
            self.own(state, job_id, NodeProcessExited(job_id=job_id, attempt=attempt, rank=rank,
                                                      node=launch.node((0, rank)), exit_code=args[1]))
        elif kind == "lost":
            self.own(state, job_id, NodeProcessLost(job_id=job_id, attempt=attempt, rank=rank,
                                                    node=launch.node((0, rank)), reason="lost"))
        elif kind == "lost_stopped":  # of the attempt whose processes there were given up, if any
            fenced = [a for j, a, n in state.fences if (j, n) == (job_id, args[0])]
            self.own(state, job_id, LostProcessesStopped(job_id=job_id, attempt=min(fenced, default=attempt),
                                                         node=args[0]))
        elif kind == "outcome":
            outcomes: dict[str, Event] = {"succeeded": LaunchSucceeded(job_id=job_id, attempt=attempt),
                                          "failed": LaunchFailed(job_id=job_id, attempt=attempt, reason="exit 1"),
                                          "stopped": LaunchStopped(job_id=job_id, attempt=attempt)}
            self.own(state, job_id, outcomes[args[0]])


def _ending(job_id: str, kind: str, attempt: int, nodes: list[str]) -> Event:
    if kind == "stop":
        return JobStopRequested(job_id=job_id, by="bob")
    if kind == "resume":
        return JobResuming(job_id=job_id, attempt=attempt, reason="node lost", lost_nodes=nodes[:1])
    if kind == "restart":
        return JobRestarting(job_id=job_id, attempt=attempt, restarts=1, reason="exit 1")
    if kind == "failed":
        return JobFailed(job_id=job_id, reason="exit 1")
    if kind == "succeeded":
        return JobSucceeded(job_id=job_id)
    return JobStopped(job_id=job_id, by="bob")


def behaviour(state: LauncherState) -> list[Any]:
    """What the dispatcher and the rules read of each launch under way, in the order they find them."""
    return [(launch.job_id, launch.attempt, launch.pending(), launch.leftovers(), launch.running(),
             launch.current_task(), launch.node_names, state.stop_wanted(launch), state.reports_stop(launch),
             sorted(state.lost_nodes_of(launch)), [launch.finished_with(unit, 0) for unit in launch.plan.units])
            for launch in state.active()]


@SETTINGS
@given(steps())
def test_a_state_loaded_from_its_snapshot_holds_and_does_what_it_did(history: list[Step]) -> None:
    folding, state = History(), LauncherState()
    for step in history:
        folding.fold(state, step)
    saved = state.saved()
    loaded = LauncherState.loaded(saved)
    assert loaded.saved() == saved
    assert loaded.lifecycle == state.lifecycle
    assert behaviour(loaded) == behaviour(state)
    assert loaded.saved() == state.saved()  # the dispatcher's pass left both alike


@SETTINGS
@given(steps(), st.data())
def test_folding_on_from_a_snapshot_ends_where_folding_everything_ends(history: list[Step], data: st.DataObject,
                                                                       ) -> None:
    cut = data.draw(st.integers(0, len(history)))
    whole, part = History(), History()
    everything = LauncherState()
    for step in history:
        whole.fold(everything, step)
    before = LauncherState()
    for step in history[:cut]:
        part.fold(before, step)
    restored = LauncherState.loaded(before.saved())
    for step in history[cut:]:
        part.fold(restored, step)
    assert restored.saved() == everything.saved()


def test_a_plan_recorded_before_shapes_is_saved_whole() -> None:
    """A launch planned before plans had shapes (every node's launch recorded) comes back with every launch."""
    state, history = LauncherState(), History()
    history.scheduler(state, JOBS[0], JobSubmitted(job_id=JOBS[0], spec=plain_spec(2), creator="alice"))
    nodes = [NodeLaunch(rank=rank, node=node, address="10.0.0.1", argv=["python3", "train.py"], env={"R": str(rank)},
                        mounts=[Mount(source="outputs/out", target="outputs", read_only=False)], master=rank == 0)
             for rank, node in enumerate(NODES[:2])]
    history.own(state, JOBS[0], LaunchPlanned(job_id=JOBS[0], attempt=1, mode="pytorch", nodes=nodes,
                                              ports={0: 29500}))
    history.own(state, JOBS[0], NodeProcessExited(job_id=JOBS[0], attempt=1, rank=1, node="n2", exit_code=0))
    loaded = LauncherState.loaded(state.saved())
    launch = loaded.launches[JOBS[0]]
    assert launch.plan.every() == nodes and launch.ports == {0: 29500}
    assert launch.pending() == [(0, 0)] and launch.finished_with((0, 0), 0)


# A history where each thing the state keeps happens: a batch-like job of three ranks that starts, loses a node,
# resumes on the others, is stopped and archived while a given-up node has not answered; another that is admitted
# and waits for its plan; the administrator's settings.
STORY: list[Step] = [
    ("settings", 120), ("submit", JOBS[0], 3), ("admit", JOBS[0], NODES, True), ("started", JOBS[0], 0, 0),
    ("started", JOBS[0], 1, 0), ("started", JOBS[0], 2, 0), ("exited", JOBS[0], 2, 0), ("pass",),
    ("lost", JOBS[0], 1), ("end", JOBS[0], "resume", ["n2"]), ("admit", JOBS[1], ["n3"], False),
    ("outcome", JOBS[0], "stopped"), ("admit", JOBS[0], ["n1", "n3"], True), ("started", JOBS[0], 0, 0),
    ("end", JOBS[0], "stop", ["n1"]), ("pass",), ("end", JOBS[0], "stopped", ["n1"]), ("archive", JOBS[0]),
    ("outcome", JOBS[0], "stopped"), ("pass",), ("exited", JOBS[0], 0, 137), ("pass",),
    ("lost_stopped", JOBS[0], "n2"), ("pass",),
]


def test_every_cut_of_a_story_folded_on_from_its_snapshot_ends_where_the_whole_story_ends() -> None:
    whole, everything = History(), LauncherState()
    kept: list[tuple[str, ...]] = []
    for step in STORY:
        whole.fold(everything, step)
        kept.append(tuple(sorted(field for field in ("launches", "ending", "renewing", "lost_nodes", "fences",
                                                      "unplanned", "archived") if getattr(everything, field))))
    assert {field for fields in kept for field in fields} == {"launches", "ending", "renewing", "lost_nodes",
                                                              "fences", "unplanned", "archived"}
    assert JOBS[0] not in everything.lifecycle.jobs and JOBS[0] not in everything.launches  # left at last
    for cut in range(len(STORY) + 1):
        part, before = History(), LauncherState()
        for step in STORY[:cut]:
            part.fold(before, step)
        restored = LauncherState.loaded(before.saved())
        assert behaviour(restored) == behaviour(before)
        for step in STORY[cut:]:
            part.fold(restored, step)
        assert restored.saved() == everything.saved(), cut
