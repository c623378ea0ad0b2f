"""Node credentials: a node token registers one node only, and never works as a user token (or back)."""

from __future__ import annotations

import stat
from pathlib import Path

import jwt
import pytest
from typer.testing import CliRunner

from agent.__main__ import node_credential
from client import cli
from devstack.stack import provision_node_token
from libs.auth import (
    AuthError,
    bearer_headers,
    identity_from_headers,
    issue_node_token,
    issue_token,
    node_from_headers,
    verify_node_token,
    verify_token,
)
from libs.contracts.identity import Identity
from libs.settings import Settings
from services.monitor.rules import credential_refusal

SECRET = "a-signing-secret-for-the-unit-tests-0123456789"
OTHER_SECRET = "another-signing-secret-of-enough-length-987654"


def test_a_node_token_names_its_node() -> None:
    assert verify_node_token(SECRET, issue_node_token(SECRET, "node-a")) == "node-a"
    assert node_from_headers(SECRET, bearer_headers(issue_node_token(SECRET, "node-b"))) == "node-b"


def test_a_node_token_is_not_a_user_token() -> None:
    node_token = issue_node_token(SECRET, "node-a")
    with pytest.raises(AuthError, match="node or job credential, not a user token"):
        verify_token(SECRET, node_token)
    with pytest.raises(AuthError, match="node or job credential, not a user token"):
        identity_from_headers(SECRET, bearer_headers(node_token))


def test_a_user_token_is_not_a_node_token_even_an_administrators() -> None:
    for identity in (Identity(user="node-a"), Identity(user="root", admin=True)):
        with pytest.raises(AuthError, match="not a node credential"):
            verify_node_token(SECRET, issue_token(SECRET, identity))


def test_expired_forged_and_missing_node_tokens_are_refused_with_what_to_do() -> None:
    with pytest.raises(AuthError, match="expired; ask an administrator for a new node credential"):
        verify_node_token(SECRET, issue_node_token(SECRET, "node-a", ttl_seconds=-10))
    with pytest.raises(AuthError, match="not valid"):
        verify_node_token(SECRET, issue_node_token(OTHER_SECRET, "node-a"))
    claims = jwt.decode(issue_node_token(SECRET, "node-a"), options={"verify_signature": False})
    renamed = jwt.encode({**claims, "node": "evil", "sub": "node:evil"}, OTHER_SECRET, algorithm="HS256")
    with pytest.raises(AuthError, match="not valid"):
        verify_node_token(SECRET, renamed)
    with pytest.raises(AuthError, match="no node credential"):
        node_from_headers(SECRET, {})


def test_a_user_claim_edited_into_a_node_token_is_still_refused() -> None:
    # Signed correctly but mixed: a user token with a node's role is neither kind.
    claims = jwt.decode(issue_token(SECRET, Identity(user="alice")), options={"verify_signature": False})
    mixed = jwt.encode({**claims, "role": "node"}, SECRET, algorithm="HS256")
    with pytest.raises(AuthError):
        verify_token(SECRET, mixed)
    with pytest.raises(AuthError):
        verify_node_token(SECRET, mixed)


def test_node_names_are_dns_labels() -> None:
    with pytest.raises(AuthError, match="not a node name"):
        issue_node_token(SECRET, "Node_A")


def test_the_monitor_refuses_a_missing_credential_and_another_nodes() -> None:
    assert credential_refusal("node-a", "node-a") is None
    missing = credential_refusal("evil", AuthError("the message carries no node credential"))
    assert missing is not None and missing.code == "unauthenticated"
    assert "trainyard admin node-token evil" in (missing.hint or "")
    other = credential_refusal("evil", "node-a")
    assert other is not None and other.code == "forbidden"
    assert "for node node-a, not evil" in other.message
    assert "trainyard admin node-token evil" in (other.hint or "")


# --- trainyard admin node-token, the agent's credential, the hidden token file ---------------------------


@pytest.fixture
def no_stack(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("TRAINYARD_AUTH_SECRET", "TRAINYARD_AUTH_SECRET_FILE", "TRAINYARD_NODE_TOKEN",
                 "TRAINYARD_NODE_TOKEN_FILE", "TRAINYARD_HIDDEN_PATHS", "TRAINYARD_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))


def test_admin_node_token_writes_a_private_credential_for_the_node(
        no_stack: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRAINYARD_AUTH_SECRET", SECRET)
    printed = CliRunner().invoke(cli.app, ["admin", "node-token", "node-a", "--ttl", "2d"])
    assert printed.exit_code == 0, printed.output
    assert verify_node_token(SECRET, printed.stdout.strip()) == "node-a"
    path = tmp_path / "node-a.token"
    written = CliRunner().invoke(cli.app, ["admin", "node-token", "node-a", "--out", str(path)])
    assert written.exit_code == 0, written.output
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert verify_node_token(SECRET, path.read_text().strip()) == "node-a"
    assert f"TRAINYARD_NODE_TOKEN_FILE={path}" in written.output


@pytest.mark.parametrize(("args", "expected"), [
    (["Node_A"], "is not a node name"),
    (["node-a", "--ttl", "3w"], "is not a duration"),
])
def test_admin_node_token_refuses_bad_names_and_durations(no_stack: None, monkeypatch: pytest.MonkeyPatch,
                                                          args: list[str], expected: str) -> None:
    monkeypatch.setenv("TRAINYARD_AUTH_SECRET", SECRET)
    result = CliRunner().invoke(cli.app, ["admin", "node-token", *args])
    assert result.exit_code == 1
    assert expected in result.output and result.stdout == ""


def test_admin_node_token_without_a_secret_says_where_to_set_it(no_stack: None) -> None:
    result = CliRunner().invoke(cli.app, ["admin", "node-token", "node-a"])
    assert result.exit_code == 1
    assert "no signing secret" in result.output and "TRAINYARD_AUTH_SECRET" in result.output


def test_the_agent_reads_its_credential_from_the_file_first(tmp_path: Path) -> None:
    path = tmp_path / "node-a"
    path.write_text("from-the-file\n")
    assert node_credential("node-a", {"TRAINYARD_NODE_TOKEN_FILE": str(path),
                                      "TRAINYARD_NODE_TOKEN": "from-the-variable"}) == "from-the-file"
    assert node_credential("node-a", {"TRAINYARD_NODE_TOKEN": "from-the-variable"}) == "from-the-variable"


@pytest.mark.parametrize("environ", [{}, {"TRAINYARD_NODE_TOKEN_FILE": "/nonexistent/node-a"}])
def test_an_agent_without_a_credential_says_how_to_get_one(environ: dict[str, str]) -> None:
    with pytest.raises(SystemExit, match=r"^no node credential: .*ask an administrator: "
                                         r"trainyard admin node-token node-a$"):
        node_credential("node-a", environ)


def test_the_node_token_file_is_hidden_from_jobs(no_stack: None, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("TRAINYARD_NODE_TOKEN_FILE", str(tmp_path / "node-a"))
    assert (tmp_path / "node-a").resolve() in Settings().hidden_paths


def test_the_local_stack_gives_each_agent_its_own_credential(tmp_path: Path) -> None:
    secret_file = tmp_path / "auth-secret"
    secret_file.write_text(SECRET)
    env = provision_node_token(tmp_path, "node-b", secret_file)
    path = Path(env["TRAINYARD_NODE_TOKEN_FILE"])
    assert path.parent == tmp_path / "node-tokens"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert verify_node_token(SECRET, path.read_text()) == "node-b"
