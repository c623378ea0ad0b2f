"""S7 cluster resources, S8 flavors by board, O4 development environments, from the scheduler's state."""

from __future__ import annotations

from libs.contracts.events import JobPrechecking, NodeLost, NodeUnhealthy, Placement
from libs.contracts.jobspec import CheckpointResume, DatasetRef
from services.scheduler.domain.views import dev_env, flavor_list, node_resources, node_views
from tests.support.scheduler_state import AT, Fold


def test_resources_show_each_node_with_usage_per_application() -> None:
    fold = Fold()
    fold.node("gpu-1", "A100", 4)
    fold.node("gpu-2", "A100", 4)
    fold.node("gpu-3", "V100", 2)
    fold.node("cpu-1")
    fold.job("job-000000000001", "train-a", ["a100-1"], nodes=2)
    fold.admit("job-000000000001", "a100-1", ["gpu-1", "gpu-1"])
    fold.job("job-000000000002", "eval-b", ["a100-1"])
    fold.admit("job-000000000002", "a100-1", ["gpu-1"])
    fold.job("job-000000000003", "big", ["a100-4"])
    fold.admit("job-000000000003", "a100-4", ["gpu-2"])

    rows = {r.name: r for r in node_resources(fold.state, ["a100-1", "a100-4"])}
    assert set(rows) == {"gpu-1", "gpu-2"}  # the V100 and CPU nodes serve neither flavor
    gpu1 = rows["gpu-1"]
    assert gpu1.status == {"a100-1": "idle", "a100-4": "tight"}
    assert (gpu1.accelerators_used, gpu1.accelerators_total, gpu1.cpus_used) == (3, 4, 12)
    assert [str(u) for u in gpu1.usage] == ["2(2):train-a", "1(1):eval-b"]
    assert (gpu1.os, gpu1.kernel, gpu1.board, gpu1.driver_version) == ("Debian 12", "6.1.0", "A100", "535.1")
    assert gpu1.flavors == ["a100-1", "a100-4", "cpu-4"]
    assert rows["gpu-2"].status == {"a100-1": "tight", "a100-4": "tight"}


def test_lost_nodes_are_not_schedulable_resources() -> None:
    fold = Fold()
    fold.node("gpu-1", "A100", 4)
    fold.apply(NodeLost(node_name="gpu-1", last_seen=AT, reason="gone"), "monitor")
    assert node_resources(fold.state, ["a100-1"]) == []


def test_unhealthy_nodes_are_listed_with_their_problems_but_not_schedulable() -> None:
    fold = Fold()
    fold.node("gpu-1", "A100", 4)
    fold.node("gpu-2", "A100", 4)
    fold.apply(NodeUnhealthy(node_name="gpu-2", problems=["board:1 faulty (xid 79)"]), "monitor")
    assert [r.name for r in node_resources(fold.state, ["a100-1"])] == ["gpu-1"]
    assert [f.schedulable_nodes for f in flavor_list(fold.state, "A100").flavors] == [1, 1]
    views = node_views(fold.state)
    assert [(v.info.name, v.status, v.problems) for v in views] == [
        ("gpu-1", "ready", []), ("gpu-2", "unhealthy", ["board:1 faulty (xid 79)"])]


def test_a_job_being_prechecked_shows_on_its_nodes() -> None:
    fold = Fold()
    fold.node("gpu-1", "A100", 4)
    fold.job("job-000000000001", "train", ["a100-1"], pool="p", checkpoint_resume=CheckpointResume())
    fold.apply(JobPrechecking(job_id="job-000000000001", attempt=1, flavor="a100-1",
                              placement=[Placement(rank=0, node="gpu-1", address="gpu-1", slots=1)]))
    [view] = node_views(fold.state)
    assert (view.jobs, view.used.accelerators) == (["job-000000000001"], 1)


def test_flavors_by_board_with_the_boards_queued_jobs_need() -> None:
    fold = Fold()
    fold.node("gpu-1", "A100", 4)
    fold.node("gpu-3", "V100", 2)
    fold.job("job-000000000001", "a", ["a100-4"], nodes=2)  # 8 A100 boards
    fold.job("job-000000000002", "b", ["cpu-4", "a100-1"])  # its first board flavor: 1 A100
    fold.job("job-000000000003", "c", ["v100-2"])
    fold.job("job-000000000004", "d", ["a100-1"])
    fold.admit("job-000000000004", "a100-1", ["gpu-1"])  # running: not demand

    listing = flavor_list(fold.state, "A100")
    assert [(f.flavor.name, f.schedulable_nodes) for f in listing.flavors] == [("a100-1", 1), ("a100-4", 1)]
    assert [(d.board, d.boards_needed, d.queued_jobs) for d in listing.demand] == [("A100", 9, 2)]
    everything = flavor_list(fold.state, None)
    assert {d.board: d.boards_needed for d in everything.demand} == {"A100": 9, "V100": 2}


def test_a_dev_environment_has_the_jobs_mounts_image_and_variables() -> None:
    fold = Fold()
    fold.job("job-000000000001", "bert", ["cpu-4"], image="trainyard/pytorch:2", env={"SEED": "7"},
             datasets=[DatasetRef(name="wiki")])
    devenv = dev_env(fold.state.jobs["job-000000000001"])
    assert (devenv.image, devenv.flavor, devenv.env, devenv.command) == (
        "trainyard/pytorch:2", "cpu-4", {"SEED": "7"}, "python3 t.py")
    assert {(m.target, m.read_only) for m in devenv.mounts} == {
        ("algorithm", False), ("dataset/private/wiki", True), ("outputs", False)}
