"""The role permission matrix (libs/natsroles.py): who may publish and subscribe to what."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from devstack.servers import nats_server_binary
from libs.contracts import subjects
from libs.contracts.operations.agents import REGISTER_NODE
from libs.contracts.operations.autoscaler import QUEUE_STATUS
from libs.contracts.operations.jobs import SUBMIT_JOB
from libs.natsauth import issuer_public_key, new_issuer_seed
from libs.natsroles import (
    ISSUER_VARIABLE,
    NAME,
    SERVICES,
    STREAM_OWNERS,
    NKey,
    Permissions,
    RoleError,
    agent_permissions,
    callout_config,
    job_permissions,
    placeholder_credentials,
    render_config,
    request_subjects,
    roles,
    service_permissions,
    subject_matches,
    user_nats_name,
    user_permissions,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "nats" / "nats-server.conf"


matches = subject_matches  # NATS subject matching: `*` one token, `>` the rest


def may_publish(p: Permissions, subject: str) -> bool:
    return (any(matches(a, subject) for a in p.publish_allow)
            and not any(matches(d, subject) for d in p.publish_deny))


def may_subscribe(p: Permissions, subject: str) -> bool:
    return (any(matches(a, subject) for a in p.subscribe_allow)
            and not any(matches(d, subject) for d in p.subscribe_deny))


def test_every_request_subject_is_answered_by_exactly_one_service_and_sent_by_users() -> None:
    assert SUBMIT_JOB.subject in request_subjects() and QUEUE_STATUS.subject in request_subjects()
    for subject in request_subjects():
        answering = [s for s in SERVICES if may_subscribe(service_permissions(s), subject)]
        assert len(answering) == 1, (subject, answering)
        assert may_publish(user_permissions("alice"), subject)


def test_a_service_publishes_its_own_events_only() -> None:
    for service in SERVICES:
        for other in SERVICES:
            subject = subjects.event_subject(other, "job", "Something")
            assert may_publish(service_permissions(service), subject) == (service == other)


def test_only_a_streams_owner_manages_it() -> None:
    assert set(STREAM_OWNERS) == {subjects.EVENTS_STREAM, subjects.AGENT_REPORTS_STREAM, subjects.LOGS_STREAM,
                                  subjects.USAGE_STREAM, subjects.CACHE_REPORTS_STREAM, subjects.METRICS_STREAM}
    everyone = roles(["node-a"], ["alice"])
    for stream, owner in STREAM_OWNERS.items():
        for name, permissions in everyone.items():
            for action in ("CREATE", "UPDATE", "DELETE", "PURGE"):
                allowed = may_publish(permissions, f"$JS.API.STREAM.{action}.{stream}")
                assert allowed == (name == owner and action in ("CREATE", "UPDATE")), (name, action, stream)


def test_an_agent_speaks_for_its_own_node_only() -> None:
    agent = agent_permissions("node-a")
    for own in (subjects.agent_report("node-a"), subjects.agent_cache("node-a"), subjects.heartbeat("node-a"),
                REGISTER_NODE.subject,
                subjects.session("node-a", "user-alice", "s1", "out"),
                subjects.node_logs("job-000000000001", 0, "node-a"),
                subjects.job_metrics("job-000000000001", "node-a"),
                f"$KV.{subjects.USAGE_BUCKET}.{subjects.usage_key('job-000000000001', 1, 0, 'node-a')}"):
        assert may_publish(agent, own), own
    for other in (subjects.agent_report("node-b"), subjects.agent_cache("node-b"), subjects.heartbeat("node-b"),
                  subjects.node_logs("job-000000000001", 0, "node-b"),
                  subjects.job_metrics("job-000000000001", "node-b"),
                  f"$KV.{subjects.USAGE_BUCKET}.{subjects.usage_key('job-000000000001', 1, 0, 'node-b')}",
                  f"$KV.{subjects.USAGE_BUCKET}.job-000000000001.1.0",
                  subjects.session("node-b", "user-alice", "s1", "out"),
                  subjects.agent_exec("node-b"), subjects.agent_start("node-b"), SUBMIT_JOB.subject):
        assert not may_publish(agent, other), other
    assert may_subscribe(agent, subjects.agent_start("node-a"))
    assert not may_subscribe(agent, subjects.agent_start("node-b"))
    # Asked by the monitor, and by no one else, to register again.
    assert may_subscribe(agent, subjects.ANNOUNCE_NODES) and not may_publish(agent, subjects.ANNOUNCE_NODES)
    assert may_publish(service_permissions("monitor"), subjects.ANNOUNCE_NODES)
    assert not may_publish(user_permissions("user-alice"), subjects.ANNOUNCE_NODES)
    assert not may_subscribe(agent, subjects.EVENTS_ALL)


def test_a_user_reads_no_stream_and_sends_nothing_to_agents() -> None:
    user = user_permissions("user-alice")
    for subject in (subjects.EVENTS_ALL, subjects.LOGS_ALL, subjects.AGENT_REPORTS_ALL, "_INBOX.scheduler.x"):
        assert not may_subscribe(user, subject), subject
    for subject in (subjects.agent_start("node-a"), subjects.agent_open_session("node-a"),
                    "$JS.API.CONSUMER.CREATE.TRAINYARD_EVENTS", "$JS.API.STREAM.DELETE.TRAINYARD_EVENTS"):
        assert not may_publish(user, subject), subject
    assert may_publish(user, subjects.session("node-a", "user-alice", "s1", "in"))
    assert may_subscribe(user, subjects.session("node-a", "user-alice", "s1", "out"))


def test_a_user_reaches_only_her_own_debug_sessions() -> None:
    """Nobody reads another's session (its output, learning its id) or types into it."""
    bob = user_permissions("user-bob")
    for channel in ("out", "exit"):
        assert not may_subscribe(bob, subjects.session("node-a", "user-alice", "s1", channel))
        assert not may_subscribe(bob, subjects.session("*", "*", "*", channel))
        assert not may_subscribe(bob, "trainyard.agent.>")
    for channel in ("in", "control"):
        assert not may_publish(bob, subjects.session("node-a", "user-alice", "s1", channel))


def test_bad_names_and_missing_credentials_are_refused() -> None:
    with pytest.raises(RoleError, match=r"node name 'node\.a'"):
        roles(["node.a"])
    with pytest.raises(RoleError, match="taken by a service"):
        roles(["node-a"], ["scheduler"])
    credentials = placeholder_credentials(["node-a"])
    del credentials["agent-node-a"]
    with pytest.raises(RoleError, match="no credential for agent-node-a"):
        render_config(["node-a"], credentials)


def test_passwords_variables_and_nkeys_are_rendered_for_the_server(tmp_path: Path) -> None:
    credentials = {**placeholder_credentials(["node-a"]), "scheduler": 'pa"ss', "launcher": NKey("U" + "A" * 55)}
    text = render_config(["node-a"], credentials)
    assert 'password: "pa\\"ss"' in text and 'nkey: "UAAAA' in text and "password: $MONITOR_PASSWORD" in text


def test_the_deploy_configuration_is_fresh_and_accepted_by_nats_server() -> None:
    assert EXAMPLE.read_text() == callout_config(placeholder_credentials(), ISSUER_VARIABLE)
    variables = {str(v)[1:]: "secret" for v in placeholder_credentials().values()}
    variables[ISSUER_VARIABLE[1:]] = issuer_public_key(new_issuer_seed())
    check = subprocess.run([nats_server_binary(), "-t", "-c", str(EXAMPLE)], capture_output=True, text=True,
                           env={**os.environ, **variables}, check=False)
    assert check.returncode == 0, check.stderr + check.stdout


def test_a_job_may_ask_only_its_own_nodes_agents_and_read_only_its_inbox() -> None:
    job = job_permissions("job-0123456789ab", ["node-a", "node-b"])
    assert may_publish(job, subjects.agent_exec("node-a")) and may_publish(job, subjects.agent_exec("node-b"))
    for subject in (subjects.agent_exec("node-c"), subjects.agent_start("node-a"), SUBMIT_JOB.subject):
        assert not may_publish(job, subject)
    assert may_subscribe(job, "_INBOX.jobs.job-0123456789ab.abc")
    assert not may_subscribe(job, "_INBOX.jobs.job-0123456789ac.abc")
    assert not may_subscribe(job, "_INBOX.user-alice.abc")


def test_people_get_a_nats_name_of_their_own_that_no_service_agent_or_job_can_take() -> None:
    assert user_nats_name("alice") == "user-alice"
    assert user_nats_name("agent-node-a") == "user-agent-node-a"
    mail = user_nats_name("alice@example.com")
    assert mail.startswith("user-") and NAME.fullmatch(mail) and mail != user_nats_name("bob@example.com")
