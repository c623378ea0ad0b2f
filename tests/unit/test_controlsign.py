"""An agent obeys a request only when the launcher or the monitor signed it, for this subject and body,
recently, once; the keys it trusts come with its node credential."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.__main__ import control_of
from libs.auth import issue_node_token
from libs.controlsign import MAX_SKEW_SECONDS, SIGNATURE_HEADER, ControlSigner, ControlVerifier
from tests.support.strategies import SETTINGS

SECRET = "control-signing-tests-secret-" * 2
NOW = 1_800_000_000.0
SUBJECT = "trainyard.agent.node-a.start"
LAUNCHER = ControlSigner.of(SECRET, "launcher")


def verifier() -> ControlVerifier:
    return ControlVerifier.of_secret(SECRET)


@SETTINGS
@given(body=st.binary(max_size=2048), flip=st.integers(min_value=0))
def test_a_signature_covers_every_byte_of_the_body(body: bytes, flip: int) -> None:
    headers = LAUNCHER.headers(SUBJECT, body, NOW)
    if body:
        index = flip % len(body)
        altered = body[:index] + bytes([body[index] ^ 1]) + body[index + 1:]
    else:
        altered = b"x"

    assert verifier().refusal("launcher", SUBJECT, altered, headers, NOW) is not None
    assert verifier().refusal("launcher", SUBJECT, body, headers, NOW) is None


def test_a_request_is_obeyed_once_for_its_own_subject_and_role_only() -> None:
    body = b'{"type": "StartProcess.v1"}'
    headers = LAUNCHER.headers(SUBJECT, body, NOW)
    control = verifier()

    assert control.refusal("monitor", SUBJECT, body, headers, NOW) == \
        "only the monitor may send this, and the request is signed as 'launcher'"
    assert "does not verify" in str(control.refusal("launcher", "trainyard.agent.node-b.start", body, headers, NOW))
    assert control.refusal("launcher", SUBJECT, body, headers, NOW + 1) is None
    assert "replay" in str(control.refusal("launcher", SUBJECT, body, headers, NOW + 2))


def test_a_monitor_key_cannot_stand_in_for_the_launchers() -> None:
    body = b"{}"
    posing = ControlSigner(role="launcher", key=ControlSigner.of(SECRET, "monitor").key)

    refusal = verifier().refusal("launcher", SUBJECT, body, posing.headers(SUBJECT, body, NOW), NOW)

    assert refusal is not None and "does not verify" in refusal


@pytest.mark.parametrize("offset", [-MAX_SKEW_SECONDS - 1, MAX_SKEW_SECONDS + 1])
def test_a_request_signed_too_long_ago_or_ahead_is_refused_with_a_clock_hint(offset: float) -> None:
    headers = LAUNCHER.headers(SUBJECT, b"{}", NOW + offset)

    assert "check both machines' clocks" in str(verifier().refusal("launcher", SUBJECT, b"{}", headers, NOW))


@pytest.mark.parametrize("header", ["", "launcher", "launcher.x.y.z", "launcher.1.n", "launcher.9999999999999999.n.s",
                                    "launcher.1.n.!!!!", "a.b.c.d.e"])
def test_a_malformed_signature_header_is_refused(header: str) -> None:
    assert verifier().refusal("launcher", SUBJECT, b"{}", {SIGNATURE_HEADER: header}, NOW) is not None


def test_what_was_seen_is_forgotten_once_too_old_to_be_accepted_anyway() -> None:
    control = verifier()
    for second in range(100):
        body = str(second).encode()
        assert control.refusal("launcher", SUBJECT, body, LAUNCHER.headers(SUBJECT, body, NOW + second),
                               NOW + second) is None

    assert len(control._seen) <= MAX_SKEW_SECONDS + 2
    later = NOW + 10 * MAX_SKEW_SECONDS
    control.refusal("launcher", SUBJECT, b"{}", LAUNCHER.headers(SUBJECT, b"{}", later), later)
    assert len(control._seen) == 1


def test_an_agent_trusts_the_keys_its_node_credential_carries() -> None:
    control = control_of(issue_node_token(SECRET, "node-a"), "node-a")
    other = control_of(issue_node_token("another-platform-secret-" * 2, "node-a"), "node-a")
    headers = LAUNCHER.headers(SUBJECT, b"{}", NOW)

    assert control.refusal("launcher", SUBJECT, b"{}", headers, NOW) is None
    assert other.refusal("launcher", SUBJECT, b"{}", headers, NOW) is not None


def test_an_old_node_credential_without_keys_stops_the_agent_saying_what_to_do() -> None:
    import jwt

    old = jwt.encode({"sub": "node:node-a", "role": "node", "node": "node-a"}, SECRET, algorithm="HS256")

    with pytest.raises(SystemExit, match="trainyard admin node-token node-a"):
        control_of(old, "node-a")
    with pytest.raises(SystemExit, match="not a token"):
        control_of("garbage", "node-a")


def test_a_signature_noted_again_to_stay_longer_is_kept_until_its_later_end() -> None:
    """What the agents before accepted is read back from several files: a signature in two is kept to its later end."""
    control = verifier()
    first = LAUNCHER.headers(SUBJECT, b"{}", NOW)
    assert control.refusal("launcher", SUBJECT, b"{}", first, NOW) is None
    [(signature, until)] = control._seen.items()
    control.restore(control.journal or Journal(), {signature: until + 60}, NOW)
    later = NOW + MAX_SKEW_SECONDS + 30  # past its first end, before its second
    control.refusal("launcher", SUBJECT, b"[]", LAUNCHER.headers(SUBJECT, b"[]", later), later)
    assert control._seen.get(signature) == until + 60
    gone = NOW + MAX_SKEW_SECONDS + 90
    control.refusal("launcher", SUBJECT, b"()", LAUNCHER.headers(SUBJECT, b"()", gone), gone)
    assert signature not in control._seen


class Journal:
    def remember(self, signature: bytes, until: float, now: float) -> None:
        pass
