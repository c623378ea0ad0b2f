"""Signed identity tokens (J2): what the services accept as the caller."""

from __future__ import annotations

import jwt
import pytest

from libs.auth import AuthError, bearer_headers, identity_from_headers, issue_token, verify_token
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
