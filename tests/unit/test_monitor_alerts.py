"""M7: alert ids come from the incident, so one incident is never raised twice."""

from __future__ import annotations

from libs.contracts.events import JobResuming
from libs.contracts.jobspec import AlgorithmRef, CheckpointResume, JobSpec, OutputRef, PerformanceDetection
from libs.contracts.scheduling import AdminSettings
from libs.jobstatus import JobRecord
from services.monitor import alerts
from services.monitor.performance.detector import Incident

JOB = JobRecord(job_id="job-0123456789ab", creator="alice", creator_email="alice@example.com",
                spec=JobSpec(name="bert", flavors=["cpu-1"], algorithm=AlgorithmRef(name="a"),
                             command="python3 t.py", output=OutputRef(name="o"),
                             checkpoint_resume=CheckpointResume(max_resumes=3)))
OPERATORS = ["ops@example.com", "alice@example.com"]


def test_the_same_incident_gives_the_same_alert_id_and_another_one_another() -> None:
    rule = PerformanceDetection(threshold=0.8)
    first = Incident(job_id=JOB.job_id, attempt=1, rank=0, node="node-a", ratio=0.9, number=1, rule=rule)
    again = alerts.performance(JOB, first, OPERATORS)
    assert again.alert_id == alerts.performance(JOB, first, OPERATORS).alert_id == "performance-job-0123456789ab-1-0-1"
    second = Incident(job_id=JOB.job_id, attempt=1, rank=0, node="node-a", ratio=0.95, number=2, rule=rule)
    assert alerts.performance(JOB, second, OPERATORS).alert_id != again.alert_id


def test_ids_name_the_incident() -> None:
    resuming = JobResuming(job_id=JOB.job_id, attempt=2, reason="node node-a is unhealthy", exclude_nodes=["node-a"])
    assert alerts.job_resuming(JOB, resuming, AdminSettings(), OPERATORS).alert_id == "job-resuming-job-0123456789ab-2"
    assert alerts.node_unhealthy("node-a", 7, ["board:0 faulty"], [], OPERATORS).alert_id == "node-unhealthy-node-a-7"
    assert alerts.node_lost("node-a", 8, "no heartbeat for 12s", [], OPERATORS).alert_id == "node-lost-node-a-8"
    assert alerts.precheck_failed(JOB, JOB.job_id, 3, [], OPERATORS).alert_id == "precheck-failed-job-0123456789ab-3"


def test_a_move_names_the_node_whose_fault_caused_it() -> None:
    unhealthy = JobResuming(job_id=JOB.job_id, attempt=2, reason="node node-a is unhealthy", fault_nodes=["node-a"])
    assert alerts.job_resuming(JOB, unhealthy, AdminSettings(), OPERATORS).node == "node-a"


def test_job_alerts_go_to_the_creator_and_the_operators_once_each_node_alerts_to_operators() -> None:
    resuming = JobResuming(job_id=JOB.job_id, attempt=2, reason="node node-a is unhealthy")
    assert alerts.job_resuming(JOB, resuming, AdminSettings(), OPERATORS).recipients == [
        "alice@example.com", "ops@example.com"]
    assert alerts.node_lost("node-a", 8, "gone", [JOB], OPERATORS).recipients == OPERATORS
