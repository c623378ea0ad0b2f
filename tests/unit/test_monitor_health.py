"""M2 health verdicts: probed components and administrator marks make a node's problems."""

from __future__ import annotations

from libs.contracts.events import ComponentMarked
from libs.contracts.health import ComponentHealth
from services.monitor.health import changed, faulty_components, problems_of

HEALTHY = [ComponentHealth(kind="nic", name="eth0", healthy=True),
           ComponentHealth(kind="board", name="0", healthy=True),
           ComponentHealth(kind="runtime", name="storage", healthy=True)]


def mark(component: str, *, faulty: bool = True, by: str = "root", reason: str = "drill") -> ComponentMarked:
    return ComponentMarked(node_name="node-a", component=component, faulty=faulty, by=by, reason=reason)


def test_a_healthy_probe_without_marks_has_no_problems() -> None:
    assert faulty_components(HEALTHY, {}) == []


def test_a_mark_makes_a_healthy_component_faulty_and_says_who_and_why() -> None:
    problems = problems_of(faulty_components(HEALTHY, {"board:0": mark("board:0")}))
    assert problems == ["board:0 faulty (marked by root: drill)"]


def test_a_mark_without_a_reason_names_who_marked_it() -> None:
    problems = problems_of(faulty_components(HEALTHY, {"nic:eth0": mark("nic:eth0", reason="")}))
    assert problems == ["nic:eth0 faulty (marked by root)"]


def test_probed_faults_are_problems_and_a_mark_wins_over_the_probe() -> None:
    probed = [ComponentHealth(kind="nic", name="eth0", healthy=False, detail="link down"),
              ComponentHealth(kind="board", name="0", healthy=False, detail="ECC errors")]
    problems = problems_of(faulty_components(probed, {"board:0": mark("board:0")}))
    assert problems == ["board:0 faulty (marked by root: drill)", "nic:eth0 faulty (link down)"]


def test_before_the_first_probe_the_recorded_probe_problems_stand_and_marks_apply() -> None:
    recorded = ["board:0 faulty (marked by root: drill)", "nic:eth0 faulty (link down)"]
    # The board mark was cleared since; the NIC problem came from a probe and stays until one arrives.
    assert problems_of(faulty_components(None, {}, recorded)) == ["nic:eth0 faulty (link down)"]


def test_a_probe_detail_that_changes_is_not_a_change_of_problems() -> None:
    assert not changed(["runtime:disk faulty (812 MiB free)"], ["runtime:disk faulty (790 MiB free)"])
    assert changed(["runtime:disk faulty (812 MiB free)"], ["runtime:disk faulty (790 MiB free)", "board:0 faulty"])
    assert changed([], ["board:0 faulty"])


def test_a_new_reason_of_a_mark_is_a_change_of_problems() -> None:
    assert changed(["board:0 faulty (marked by root: drill)"], ["board:0 faulty (marked by root: real fault)"])
