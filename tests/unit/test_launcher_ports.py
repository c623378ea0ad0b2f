"""Rendezvous ports chosen on the nodes (L3, L4): the launcher plans a PyTorch or TensorFlow attempt with
the ports its nodes chose, and with its own choice for a node that stays silent.

The launcher runs on an in-memory event log with fake agents (tests/support/launcher.py).
"""

from __future__ import annotations

import json

import pytest

from libs.contracts.agent import ReservePorts
from libs.contracts.events import JobAdmitted, JobStopRequested, JobSubmitted, LaunchPlanned, Placement
from services.launcher.dispatcher import PORTS_WAIT_SECONDS
from services.launcher.service import Launcher
from services.launcher.state import FIRST_FALLBACK_PORT
from tests.support.eventlog import fake_runtime
from tests.support.launcher import Site, launches
from tests.support.platform import CLUSTER, JOB, plain_spec


@pytest.fixture
def site(monkeypatch: pytest.MonkeyPatch) -> Site:
    return Site(monkeypatch)


def port_requests(site: Site) -> list[tuple[str, ReservePorts]]:
    return [(subject.split(".")[2], request) for subject, request, _ in site.agents.calls
            if isinstance(request, ReservePorts)]


async def admit(site: Site, mode: str, nodes: list[str], **spec: object) -> None:
    await site.admit(plain_spec(len(nodes), mode=mode, **spec), nodes)


async def test_a_pytorch_attempt_listens_on_the_port_its_master_node_chose(site: Site) -> None:
    await admit(site, "pytorch", ["n1", "n2"])
    await site.dispatch()
    assert site.recorded(LaunchPlanned) == []  # not before the master's node answered
    assert [(node, r.count) for node, r in port_requests(site)] == [("n1", 1)]

    await site.dispatch()
    [plan] = site.recorded(LaunchPlanned)
    assert plan.rank_ports() == {0: 30000}
    assert [(n.rank, n.port, n.env["MASTER_PORT"]) for n in launches(plan)] == [(0, 30000, "30000"), (1, 0, "30000")]
    assert "--master_port=30000" in launches(plan)[1].argv
    assert len(site.agents.starts()) == 2


async def test_every_tensorflow_task_listens_on_a_port_its_own_node_chose(site: Site) -> None:
    await admit(site, "tensorflow", ["n1", "n2", "n2"])
    await site.dispatch()
    assert sorted((node, r.count) for node, r in port_requests(site)) == [("n1", 1), ("n2", 2)]
    await site.dispatch()
    [plan] = site.recorded(LaunchPlanned)
    ports = plan.rank_ports()
    assert ports == {0: 30000, 1: 30001, 2: 30002}  # n1 chose 30000, n2 30001 and 30002
    cluster = json.loads(launches(plan)[0].env["TF_CONFIG"])["cluster"]["worker"]
    assert cluster == [f"addr-n1:{ports[0]}", f"addr-n2:{ports[1]}", f"addr-n2:{ports[2]}"]
    assert [n.port for n in launches(plan)] == [ports[0], ports[1], ports[2]]


async def test_a_mode_without_a_rendezvous_is_planned_without_asking(site: Site) -> None:
    await admit(site, "horovod", ["n1", "n2"])
    await site.dispatch()
    [plan] = site.recorded(LaunchPlanned)
    assert plan.rank_ports() == {} and port_requests(site) == []
    assert len(site.agents.starts()) == 2  # in the same pass


async def test_a_silent_node_gets_the_launchers_own_choice_after_a_while(site: Site) -> None:
    site.agents.unreachable.add("n1")
    await admit(site, "pytorch", ["n1", "n2"])
    for _ in range(3):
        site.clock[0] += 1.0
        await site.launcher.dispatcher.dispatch_once()
    assert site.recorded(LaunchPlanned) == []
    assert len(port_requests(site)) == 3  # asked again every second meanwhile

    site.clock[0] += PORTS_WAIT_SECONDS
    await site.launcher.dispatcher.dispatch_once()
    [plan] = site.recorded(LaunchPlanned)
    assert plan.rank_ports() == {0: FIRST_FALLBACK_PORT}


async def test_the_fallback_avoids_the_ports_of_running_launches(site: Site) -> None:
    site.agents.unreachable.update({"n1", "n3"})
    await admit(site, "pytorch", ["n1", "n2"])
    await site.dispatch()
    await site.dispatch()
    other = "job-000000000002"
    await site.scheduler(JobSubmitted(job_id=other, spec=plain_spec(2, mode="pytorch"), creator="alice"))
    placement = [Placement(rank=r, node=n, address=f"addr-{n}", slots=1) for r, n in enumerate(["n3", "n4"])]
    await site.scheduler(JobAdmitted(job_id=other, attempt=1, flavor="cpu-4", placement=placement))
    await site.dispatch()
    await site.dispatch()
    [plan] = [e for e in site.log.of("launcher", other) if isinstance(e, LaunchPlanned)]
    assert plan.rank_ports() == {0: FIRST_FALLBACK_PORT + 1}


async def test_a_job_stopped_before_its_plan_is_planned_at_once_to_be_stopped(site: Site) -> None:
    await admit(site, "pytorch", ["n1", "n2"])
    await site.scheduler(JobStopRequested(job_id=JOB, by="alice"))
    await site.dispatch()
    assert port_requests(site) == []
    assert len(site.recorded(LaunchPlanned)) == 1


async def test_a_restarted_launcher_plans_each_attempt_once(site: Site) -> None:
    await admit(site, "pytorch", ["n1", "n2"])
    await site.dispatch()
    await site.dispatch()
    restarted = Launcher(fake_runtime(site.log, "launcher"), CLUSTER)
    for envelope in site.log.envelopes:  # its own log first, then the scheduler's, as at a start
        if envelope.service == "launcher":
            restarted.state.apply(envelope)
    for envelope in site.log.envelopes:
        if envelope.service == "scheduler":
            restarted.state.apply_scheduler(envelope)
    assert restarted.state.unplanned == {}
