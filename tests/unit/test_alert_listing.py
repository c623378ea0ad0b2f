"""Who reads which alert through the monitor's ListAlerts (M7, J2), page by page."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from libs.contracts.codec import encode
from libs.contracts.events import AlertRaised, EventEnvelope
from libs.contracts.identity import Identity
from libs.contracts.operations.alerts import MAX_ALERT_PAGE_BYTES, ListAlerts
from libs.contracts.scheduling import AdminSettings
from libs.jobstatus import JobLifecycle, JobRecord
from services.monitor.alerts import node_lost, page
from tests.support.specs import sleeper

OWN, SHARED, OTHER, GONE = "job-00000000000a", "job-00000000000b", "job-00000000000c", "job-00000000000d"
ALICE = Identity(user="alice", projects=["vision"], admin=False)
ADMIN = Identity(user="root", projects=[], admin=True)


def jobs() -> JobLifecycle:
    lifecycle = JobLifecycle()
    specs = {OWN: ("alice", "vision", "none"), SHARED: ("bob", "vision", "read-only"),
             OTHER: ("carol", "nlp", "read-only"), GONE: ("alice", "vision", "none")}
    for job_id, (creator, project, access) in specs.items():
        spec = msgspec.structs.replace(sleeper(job_id), project=project, access=access)
        lifecycle.jobs[job_id] = JobRecord(job_id=job_id, spec=spec, creator=creator, creator_email=None)
    lifecycle.jobs[GONE].deleted = True
    return lifecycle


def raised(position: int, alert_id: str, *, job_id: str | None = None, kind: str = "job-resuming",
           message: str = "") -> EventEnvelope:
    alert = AlertRaised(alert_id=alert_id, kind=kind, title=alert_id, message=message,  # type: ignore[arg-type]
                        job_id=job_id, node=None if job_id or kind == "message-set-aside" else "node-a")
    return EventEnvelope(event_id=alert_id, service="monitor", aggregate_type="alert", aggregate_id=alert_id,
                         version=1, position=position, recorded_at=datetime.now(UTC), event=alert)


ALERTS = [raised(3, "own", job_id=OWN), raised(5, "node", kind="node-lost"), raised(8, "shared", job_id=SHARED),
          raised(9, "other", job_id=OTHER), raised(10, "gone", job_id=GONE),
          raised(12, "aside", kind="message-set-aside")]


def ids(found: list[EventEnvelope]) -> list[str]:
    return [e.aggregate_id for e in found]


def test_a_user_sees_node_alerts_and_alerts_about_jobs_she_may_show() -> None:
    assert ids(page(ALERTS, ListAlerts(), ALICE, jobs()).alerts) == ["own", "node", "shared"]
    assert ids(page(ALERTS, ListAlerts(), ADMIN, jobs()).alerts) == ["own", "node", "shared", "other", "gone",
                                                                      "aside"]


def test_a_node_alert_names_other_peoples_jobs_and_the_recipients_to_administrators_only() -> None:
    lifecycle = jobs()
    lost = node_lost("node-a", 2, "no heartbeat for 10s", [lifecycle.jobs[OTHER], lifecycle.jobs[OWN]],
                     ["ops@example.com"])
    envelope = msgspec.structs.replace(raised(5, "lost"), event=lost)

    [as_admin] = page([envelope], ListAlerts(), ADMIN, lifecycle).alerts
    [as_alice] = page([envelope], ListAlerts(), ALICE, lifecycle).alerts

    assert as_admin == envelope
    alert = as_alice.event
    assert isinstance(alert, AlertRaised)
    assert OTHER not in alert.message and OWN not in alert.message and alert.recipients == []
    assert alert.message.startswith("Node node-a was lost (no heartbeat for 10s).")
    assert "administrators" in alert.message


def test_with_sharing_off_a_user_sees_only_her_own_jobs_alerts() -> None:
    lifecycle = jobs()
    lifecycle.settings = AdminSettings(sharing_enabled=False)
    assert ids(page(ALERTS, ListAlerts(), ALICE, lifecycle).alerts) == ["own", "node"]


def test_pages_go_on_where_the_last_one_ended_looking_at_limit_alerts_each() -> None:
    first = page(ALERTS, ListAlerts(limit=2), ALICE, jobs())
    assert (ids(first.alerts), first.next_after, first.more) == (["own", "node"], 5, True)
    second = page(ALERTS, ListAlerts(after=first.next_after, limit=2), ALICE, jobs())
    assert (ids(second.alerts), second.next_after, second.more) == (["shared"], 9, True)
    # Alerts she may not see still move the cursor: the last page is empty and says so.
    last = page(ALERTS, ListAlerts(after=second.next_after, limit=2), ALICE, jobs())
    assert (last.alerts, last.next_after, last.more) == ([], 12, False)
    assert page(ALERTS, ListAlerts(after=12), ALICE, jobs()) == last


def test_a_page_stops_before_it_would_not_fit_one_nats_message() -> None:
    big = "x" * (MAX_ALERT_PAGE_BYTES // 3)
    many = [raised(position, f"n{position}", kind="node-lost", message=big) for position in range(1, 6)]
    first = page(many, ListAlerts(), ADMIN, jobs())
    assert ids(first.alerts) == ["n1", "n2"] and first.more and first.next_after == 2
    assert len(encode(first)) < MAX_ALERT_PAGE_BYTES
    assert ids(page(many, ListAlerts(after=2), ADMIN, jobs()).alerts) == ["n3", "n4"]
    # One alert always goes, whatever its size, or paging would stall on it.
    huge = [raised(1, "huge", kind="node-lost", message="x" * MAX_ALERT_PAGE_BYTES)]
    assert ids(page(huge, ListAlerts(), ADMIN, jobs()).alerts) == ["huge"]
