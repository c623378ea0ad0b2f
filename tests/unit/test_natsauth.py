"""The auth callout's decision (libs/natsauth.py): which role a token logs in as, and the JWTs that
carry it to nats-server. Against a real server: tests/integration/test_nats_permissions.py."""

from __future__ import annotations

import base64
import json
import os

import nkeys
import pytest

from libs.auth import (
    AuthError,
    issue_job_token,
    issue_node_token,
    issue_token,
    new_secret,
    verify_job_token,
    verify_node_token,
    verify_token,
)
from libs.contracts import subjects
from libs.contracts.identity import Identity
from libs.natsauth import CalloutRefused, answer, decide, encode_jwt, issuer_public_key, new_issuer_seed
from libs.natsroles import inbox_prefix, nats_user_for

SECRET = new_secret()
JOB = "job-0123456789ab"


def claims_of(token: str) -> dict[str, object]:
    part = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))))


def test_each_kind_of_token_logs_in_as_its_own_role() -> None:
    person = decide(issue_token(SECRET, Identity(user="alice", projects=["p"], admin=False)), secret=SECRET)
    assert person.nats_user == "user-alice" and "_INBOX.users.user-alice.>" in person.permissions.subscribe_allow
    agent = decide(issue_node_token(SECRET, "node-a"), secret=SECRET)
    assert agent.nats_user == "agent-node-a" and subjects.heartbeat("node-a") in agent.permissions.publish_allow
    job = decide(issue_job_token(SECRET, JOB, 2, ["node-b", "node-a"]), secret=SECRET)
    assert job.nats_user == JOB
    assert job.permissions.publish_allow == (subjects.agent_exec("node-a"), subjects.agent_exec("node-b"))
    assert all(login.expires for login in (person, agent, job))  # NATS ends the login with the token


@pytest.mark.parametrize("token", [issue_token(SECRET, Identity(user="alice@example.com", projects=[])),
                                   issue_token(SECRET, Identity(user="bob", projects=[])),
                                   issue_node_token(SECRET, "node-b"), issue_job_token(SECRET, JOB, 1, ["node-a"])])
def test_a_client_reads_its_inbox_from_the_token_as_the_callout_names_its_login(token: str) -> None:
    login = decide(token, secret=SECRET)
    assert nats_user_for(token) == login.nats_user
    assert f"{inbox_prefix(login.nats_user)}.>" in login.permissions.subscribe_allow


@pytest.mark.parametrize("token", [None, "", "not-a-jwt", issue_token(new_secret(), Identity(user="a", projects=[])),
                                   issue_node_token(new_secret(), "node-a"), issue_job_token(new_secret(), JOB, 1, []),
                                   issue_token(SECRET, Identity(user="a", projects=[]), ttl_seconds=-5)])
def test_missing_forged_and_expired_tokens_are_refused(token: str | None) -> None:
    with pytest.raises(CalloutRefused):
        decide(token, secret=SECRET)


def test_a_job_token_is_no_user_token_or_node_credential_and_names_its_job() -> None:
    token = issue_job_token(SECRET, JOB, 3, ["node-a"])
    grant = verify_job_token(SECRET, token)
    assert (grant.job_id, grant.attempt, grant.nodes) == (JOB, 3, ("node-a",))
    with pytest.raises(AuthError, match="not a user token"):
        verify_token(SECRET, token)
    with pytest.raises(AuthError, match="not a node credential"):
        verify_node_token(SECRET, token)
    with pytest.raises(AuthError, match="not a job token"):
        verify_job_token(SECRET, issue_node_token(SECRET, "node-a"))


def server_request(token: str | None, server_seed: bytes) -> bytes:
    """An authorization request as nats-server sends it, signed with its server key."""
    server = nkeys.from_seed(server_seed)
    claims = {"iss": server.public_key.decode(), "sub": "$G", "aud": "nats-authorization-request",
              "nats": {"type": "authorization_request", "version": 2, "user_nkey": "UABC",
                       "server_id": {"id": "SERVER1", "name": "n", "host": "h"},
                       "connect_opts": {"auth_token": token, "protocol": 1}}}
    return encode_jwt(claims, server_seed).encode()


def test_the_answer_is_a_user_jwt_signed_by_the_issuer_for_the_server_that_asked() -> None:
    issuer = new_issuer_seed()
    server_seed = bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_SERVER))
    token = issue_token(SECRET, Identity(user="alice", projects=["p"], admin=False))
    reply, outcome = answer(server_request(token, server_seed), seed=issuer, secret=SECRET)
    assert reply is not None and outcome == "admitted as user-alice"
    response = claims_of(reply.decode())
    assert response["iss"] == issuer_public_key(issuer) and response["aud"] == "SERVER1"
    user = claims_of(str(dict(response["nats"])["jwt"]))  # type: ignore[call-overload]
    assert user["name"] == "user-alice" and user["sub"] == "UABC" and user["aud"] == "$G"

    refused, outcome = answer(server_request("forged", server_seed), seed=issuer, secret=SECRET)
    assert refused is not None and outcome.startswith("refused")
    assert "jwt" not in dict(claims_of(refused.decode())["nats"])  # type: ignore[call-overload]


def test_a_request_not_signed_by_a_server_key_gets_no_answer() -> None:
    issuer = new_issuer_seed()
    account_seed = new_issuer_seed()  # an account key, not a server's
    token = issue_token(SECRET, Identity(user="alice", projects=["p"], admin=True))
    assert answer(server_request(token, account_seed), seed=issuer, secret=SECRET)[0] is None
    assert answer(b"x" * 100, seed=issuer, secret=SECRET)[0] is None
