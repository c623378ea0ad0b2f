"""The gateway refuses at its edge, without a login to NATS, what is no person's valid Trainyard token: it says
which it is (not ours, a node's or a job's, expired), so that the caller knows what to fix."""

from __future__ import annotations

import jwt

from libs.auth import issue_job_token, issue_node_token, issue_token
from libs.contracts.identity import Identity
from services.gateway.sessions import not_a_persons_token

SECRET = "a-test-secret-0123456789abcdef-0123456789"


def test_a_persons_token_passes() -> None:
    assert not_a_persons_token(issue_token(SECRET, Identity(user="alice"))) is None


def test_what_is_no_persons_valid_token_is_named() -> None:
    assert not_a_persons_token("not-a-token") == "the token is not a Trainyard token"
    assert not_a_persons_token(jwt.encode({}, SECRET, algorithm="HS256")) == "the token is not a Trainyard token"
    assert not_a_persons_token(jwt.encode({"iss": "trainyard", "sub": ""}, SECRET, algorithm="HS256")) \
        == "the token is not a Trainyard token"
    assert not_a_persons_token(jwt.encode({"iss": "elsewhere", "sub": "alice"}, SECRET, algorithm="HS256")) \
        == "the token is not a Trainyard token"
    assert "a node's, not a person's" in str(not_a_persons_token(issue_node_token(SECRET, "node-a")))
    job = issue_job_token(SECRET, "job-0123456789ab", 0, ["node-a"])
    assert "a job's, not a person's" in str(not_a_persons_token(job))
    old = issue_token(SECRET, Identity(user="alice"), ttl_seconds=60)
    assert not_a_persons_token(old) is None
    assert not_a_persons_token(old, now=10**12) == "the token has expired"
