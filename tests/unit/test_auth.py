"""Signed identity tokens (J2): what the services accept as the caller."""

from __future__ import annotations

import time

import jwt
import pytest

from libs.auth import (
    AuthError,
    bearer_headers,
    identity_from_headers,
    issue_node_token,
    issue_token,
    verify_node_token,
    verify_token,
)
from libs.contracts.identity import Identity

SECRET = "a-signing-secret-for-the-unit-tests-0123456789"
ALICE = Identity(user="alice", projects=["vision", "nlp"])


def test_a_token_carries_user_projects_and_admin_flag() -> None:
    assert verify_token(SECRET, issue_token(SECRET, ALICE)) == ALICE
    root = Identity(user="root", admin=True)
    assert verify_token(SECRET, issue_token(SECRET, root)).admin


def test_a_token_signed_with_another_secret_is_refused() -> None:
    with pytest.raises(AuthError, match="not valid"):
        verify_token(SECRET, issue_token("another-signing-secret-of-enough-length-987654", ALICE))


def test_an_edited_token_is_refused() -> None:
    claims = jwt.decode(issue_token(SECRET, ALICE), options={"verify_signature": False})
    forged = jwt.encode({**claims, "admin": True}, "a-guessed-secret-of-enough-length-to-sign-0000", algorithm="HS256")
    with pytest.raises(AuthError):
        verify_token(SECRET, forged)


def test_an_expired_token_is_refused_with_what_to_do() -> None:
    with pytest.raises(AuthError, match="expired; ask an administrator"):
        verify_token(SECRET, issue_token(SECRET, ALICE, ttl_seconds=-10))


def test_headers_need_a_bearer_token() -> None:
    assert identity_from_headers(SECRET, bearer_headers(issue_token(SECRET, ALICE))) == ALICE
    with pytest.raises(AuthError, match="carries no token"):
        identity_from_headers(SECRET, {})
    with pytest.raises(AuthError, match="Bearer"):
        identity_from_headers(SECRET, {"Authorization": "Basic abc"})


def test_a_token_accepted_before_is_refused_once_it_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    token = issue_token(SECRET, ALICE, ttl_seconds=60)
    assert verify_token(SECRET, token) == ALICE
    later = time.time() + 61
    monkeypatch.setattr(time, "time", lambda: later)
    with pytest.raises(AuthError, match="expired; ask an administrator"):
        verify_token(SECRET, token)


def test_a_token_accepted_with_one_secret_is_refused_with_another() -> None:
    token = issue_token(SECRET, ALICE)
    assert verify_token(SECRET, token) == ALICE
    with pytest.raises(AuthError, match="not valid"):
        verify_token("another-signing-secret-of-enough-length-987654", token)


def test_a_node_credential_accepted_as_one_is_still_no_user_token() -> None:
    credential = issue_node_token(SECRET, "node-a")
    assert verify_node_token(SECRET, credential) == "node-a"
    with pytest.raises(AuthError, match="not a user token"):
        verify_token(SECRET, credential)


def test_changing_what_a_caller_was_given_changes_nothing_for_the_next() -> None:
    token = issue_token(SECRET, ALICE)
    verify_token(SECRET, token).projects.append("secret-project")
    assert verify_token(SECRET, token) == ALICE
