"""Where replies may go (libs/natsroles.py): no role may answer on whatever reply subject a request names
(`allow_responses`), each publishes its replies only into the inboxes of those who ask it, and a responder
answers a request only in its own caller's inbox (`reply_refusal`)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from typing import Any

import nkeys
import pytest

from libs.auth import issue_token, new_secret
from libs.contracts import subjects
from libs.contracts.identity import Identity
from libs.natsauth import Login, encode_jwt, new_issuer_seed, serve, user_jwt
from libs.natsroles import (
    AUTH_CALLOUT_SUBJECT,
    SERVICES,
    Permissions,
    agent_permissions,
    agent_request_sender,
    agent_user,
    anonymous_inbox,
    callout_config,
    inbox_prefix,
    job_inbox,
    job_permissions,
    placeholder_credentials,
    render_config,
    reply_refusal,
    roles,
    service_permissions,
    subject_matches,
    user_nats_name,
)
from tests.support.refusals import count_refusals

JOB = "job-0123456789ab"
EVERYONE = roles(["node-a"], ["alice"]) | {JOB: job_permissions(JOB, ["node-a"])}


def may_publish(p: Permissions, subject: str) -> bool:
    return (any(subject_matches(a, subject) for a in p.publish_allow)
            and not any(subject_matches(d, subject) for d in p.publish_deny))


def may_subscribe(p: Permissions, subject: str) -> bool:
    return (any(subject_matches(a, subject) for a in p.subscribe_allow)
            and not any(subject_matches(d, subject) for d in p.subscribe_deny))


def test_no_role_may_answer_on_any_reply_subject_it_is_handed() -> None:
    assert "allow_responses" not in {f.name for f in fields(Permissions)}
    rendered = render_config(["node-a"], placeholder_credentials(["node-a"], ["alice"]), ["alice"], issuer="$ISSUER")
    assert "allow_responses" not in rendered and "allow_responses" not in callout_config(placeholder_credentials(),
                                                                                        "$ISSUER")
    for name, permissions in EVERYONE.items():  # nor do the logins the auth callout grants
        granted = user_jwt(Login(name, permissions, None), user_nkey="UABC", seed=new_issuer_seed(), account="$G",
                           now=0)
        body = granted.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        assert "resp" not in claims["nats"] and claims["nats"]["pub"]["allow"] == list(permissions.publish_allow)


# The inboxes of each kind of caller, and who answers into them.
ALICE, NODE = inbox_prefix(user_nats_name("alice")), inbox_prefix(agent_user("node-a"))
REPLIES_INTO = {
    f"{ALICE}.r1": {"scheduler", "monitor", "autoscaler"},  # people's commands and queries
    f"{inbox_prefix('user-bob')}.r1": {"scheduler", "monitor", "autoscaler"},
    f"{NODE}.r1": {"monitor"},  # a node's registration
    f"{inbox_prefix('launcher')}.r1": {agent_user("node-a")},  # starts, stops, ports
    f"{inbox_prefix('monitor')}.r1": {agent_user("node-a")},  # pre-checks, releases, staging, sessions
    f"{job_inbox(JOB)}.r1": {agent_user("node-a")},  # an exec and its exit
    f"{inbox_prefix('scheduler')}.r1": set(),
    f"{inbox_prefix('autoscaler')}.r1": set(),
    "_INBOX.b7Kq2uD9nW4xZ1aP3sR8tY.r1": set(),  # an anonymous inbox: no role's
    "$SYS._INBOX.Ab3dE5.q1W2e3R4": {"scheduler", "monitor"},  # nats-server's, for its auth callout
}


@pytest.mark.parametrize("inbox, answerers", REPLIES_INTO.items(), ids=REPLIES_INTO.keys())
def test_each_role_publishes_replies_only_into_its_callers_inboxes(inbox: str, answerers: set[str]) -> None:
    assert {name for name, p in EVERYONE.items() if may_publish(p, inbox)} == answerers


def test_the_inboxes_are_laid_out_by_kind_so_that_nats_wildcards_can_name_them() -> None:
    assert ALICE == "_INBOX.users.user-alice" and NODE == "_INBOX.agents.agent-node-a"
    assert job_inbox(JOB) == f"_INBOX.jobs.{JOB}" and inbox_prefix("scheduler") == "_INBOX.scheduler"
    for name, permissions in EVERYONE.items():  # each reads its own inbox, and no one else's
        assert may_subscribe(permissions, f"{inbox_prefix(name)}.r1"), name
        others = [inbox for inbox in REPLIES_INTO if may_subscribe(permissions, inbox)]
        assert all(inbox.startswith(inbox_prefix(name) + ".") for inbox in others), (name, others)


# What a hostile reply subject aimed at: none of it is a reply any role may publish.
LURES = {
    "another service's event stream": subjects.event_subject("launcher", "launch", "LaunchSucceeded"),
    "the usage bucket": f"$KV.{subjects.USAGE_BUCKET}.{subjects.usage_key(JOB, 1, 0, 'node-b')}",
    "the agent-report stream": subjects.agent_report("node-b"),
    "the JetStream API": f"$JS.API.STREAM.PURGE.{subjects.AGENT_REPORTS_STREAM}",
}


RESPONDERS = [service for service in SERVICES if service != "launcher"]  # the launcher answers no request


@pytest.mark.parametrize("lure", LURES.values(), ids=LURES.keys())
def test_no_responder_may_publish_what_a_hostile_reply_subject_names(lure: str) -> None:
    for service in RESPONDERS:
        assert not may_publish(service_permissions(service), lure), service
    assert not may_publish(agent_permissions("node-a"), lure)


def test_a_request_is_answered_only_in_its_callers_own_inbox() -> None:
    alice = user_nats_name("alice")
    assert reply_refusal(alice, f"{ALICE}.Zx81.3") is None
    assert reply_refusal(JOB, f"{job_inbox(JOB)}.exit") is None
    assert reply_refusal("launcher", "_INBOX.launcher.Zx81.3") is None
    for elsewhere in (*LURES.values(), f"{inbox_prefix('user-bob')}.Zx81", f"{ALICE}x.1", ALICE, f"{NODE}.1",
                      "_INBOX.jobs.job-0123456789ac.exit", "_INBOX.scheduler.1", "$SYS._INBOX.Ab3dE5.q1W2e3R4"):
        assert reply_refusal(alice, elsewhere) is not None, elsewhere
    for unusable in (f"{ALICE}.*", f"{ALICE}.>", f"{ALICE}..x", f"{ALICE}.a b", ""):
        assert reply_refusal(alice, unusable) is not None, unusable


def test_an_anonymous_inbox_is_answered_but_no_role_may_use_one() -> None:
    """A connection without a login (a server that asks none) has nats-py's inboxes, `_INBOX.<id>`: it is
    answered there, and where NATS enforces the roles nobody may publish or read there."""
    for anonymous in ("_INBOX.b7Kq2uD9nW4xZ1aP3sR8tY", "_INBOX.b7Kq2uD9nW4xZ1aP3sR8tY.17"):
        assert anonymous_inbox(anonymous)
        assert reply_refusal(None, anonymous) is None and reply_refusal("user-alice", anonymous) is None
        for name, permissions in EVERYONE.items():
            assert not may_publish(permissions, anonymous) and not may_subscribe(permissions, anonymous), name
    for owned in (f"{ALICE}.1", f"{NODE}.1", f"{job_inbox(JOB)}.1", "_INBOX.monitor.1", "_INBOX.users.x",
                  "trainyard.events.x.y"):
        assert not anonymous_inbox(owned) and reply_refusal(None, owned) is not None, owned


def test_an_agent_answers_the_launcher_and_the_monitor_in_their_inboxes() -> None:
    for ask in (subjects.agent_ports, subjects.agent_start, subjects.agent_stop):
        assert agent_request_sender("node-a", ask("node-a")) == "launcher"
    for ask in (subjects.agent_precheck, subjects.agent_release, subjects.agent_open_session, subjects.agent_stage):
        assert agent_request_sender("node-a", ask("node-a")) == "monitor"
    assert agent_request_sender("node-a", subjects.agent_exec("node-a")) is None  # a job's: its token says which
    assert agent_request_sender("node-a", subjects.agent_start("node-b")) is None
    for subject in (subjects.agent_start("node-a"), subjects.agent_precheck("node-a")):  # and only it sends them
        senders = {s for s in SERVICES if may_publish(service_permissions(s), subject)}
        assert senders == {agent_request_sender("node-a", subject)}


@dataclass
class Published:
    subject: str
    data: bytes


class FakeConnection:
    """What `serve` does on NATS: its one subscription, and what it publishes."""

    def __init__(self) -> None:
        self.callback: Callable[[Any], Awaitable[None]] | None = None
        self.published: list[Published] = []

    async def subscribe(self, subject: str, queue: str, cb: Callable[[Any], Awaitable[None]]) -> None:
        assert subject == AUTH_CALLOUT_SUBJECT
        self.callback = cb

    async def publish(self, subject: str, data: bytes) -> None:
        self.published.append(Published(subject, data))


@dataclass
class Request:
    reply: str
    data: bytes


def server_request(token: str) -> bytes:
    """An authorization request as nats-server sends it, signed with a server key."""
    server_seed = bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_SERVER))
    claims = {"iss": nkeys.from_seed(server_seed).public_key.decode(), "sub": "$G",
              "aud": "nats-authorization-request",
              "nats": {"type": "authorization_request", "version": 2, "user_nkey": "UABC",
                       "server_id": {"id": "SERVER1", "name": "n", "host": "h"},
                       "connect_opts": {"auth_token": token, "protocol": 1}}}
    return encode_jwt(claims, server_seed).encode()


def test_the_auth_callout_answers_only_in_the_servers_inbox(monkeypatch: pytest.MonkeyPatch) -> None:
    refusals = count_refusals(monkeypatch)
    secret = new_secret()
    login = server_request(issue_token(secret, Identity(user="alice", projects=["p"], admin=False)))
    servers = "$SYS._INBOX.Ab3dE5.q1W2e3R4"

    async def run() -> list[str]:
        nc = FakeConnection()
        await serve(nc, seed=new_issuer_seed(), secret=secret, service="scheduler")
        assert nc.callback is not None
        for reply in (*LURES.values(), f"{ALICE}.r1", servers):
            await nc.callback(Request(reply, login))
        return [published.subject for published in nc.published]

    assert asyncio.run(run()) == [servers]
    assert refusals.count(AUTH_CALLOUT_SUBJECT) == len(LURES) + 1
