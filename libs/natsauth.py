"""NATS auth callout: everyone but the services logs in to NATS with a Trainyard token.

nats-server hands every connection that is not a service (`auth_users` in its configuration) to
`$SYS.REQ.USER.AUTH`, as a JWT signed by the server. A service that holds the issuer key (the
scheduler and the monitor in the local stack, in one queue group so either can answer) verifies the
token the client connected with and answers with a NATS user JWT carrying the permissions of the
token's role (libs/natsroles.py):

- a node credential (libs/auth.py) logs in as `agent-<node>`, with that node's permissions only;
- a user token logs in as `user-<name>`: command and query subjects, its own inbox, nothing else;
- a job token (libs/auth.py, issued by the launcher with each start) logs in as the job: exec requests to the
  agents of its own nodes and its own inbox.

Anything else (no token, a forged or expired one) is refused with the reason, which the server logs.
The user JWT expires with the token, so NATS closes a connection whose token ran out.

The NATS JWTs (alg `ed25519-nkey`) are encoded here with nkeys' signatures: the only Python encoder
published for them is marked untested by its authors, and the format is three base64url parts.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys
import structlog
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

from libs.auth import AuthError, verify_job_token, verify_node_token, verify_token
from libs.natsroles import (
    AUTH_CALLOUT_SUBJECT,
    CALLOUT_REPLIES,
    Permissions,
    agent_permissions,
    job_permissions,
    nats_user_of,
    queue_group,
    subject_matches,
    user_permissions,
)

log = structlog.get_logger()

QUEUE = queue_group("nats-auth")  # the scheduler and the monitor answer the auth callout together
GLOBAL_ACCOUNT = "$G"  # the server's account when its configuration declares none
ISSUER_SEED_FILE_VARIABLE = "TRAINYARD_NATS_ISSUER_SEED_FILE"
JWT_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
MAX_REQUEST_BYTES = 64 * 1024  # a connect request is a few hundred bytes; refuse anything far larger


class CalloutRefused(Exception):
    """A connection is not let in; the message says why and what to do."""


@dataclass(frozen=True)
class Login:
    """What a token logs in as: a NATS user name, its permissions and when the login ends."""

    nats_user: str
    permissions: Permissions
    expires: int | None


# --- keys -----------------------------------------------------------------------------------------


def new_issuer_seed() -> bytes:
    """A fresh account nkey seed (`SA…`): the auth callout signs user JWTs with it."""
    return bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT))


def issuer_public_key(seed: bytes) -> str:
    """The account public key (`A…`) nats-server's `auth_callout.issuer` names."""
    return bytes(nkeys.from_seed(seed).public_key).decode()


def read_issuer_seed() -> bytes | None:
    path = os.environ.get(ISSUER_SEED_FILE_VARIABLE)
    return Path(path).read_bytes().strip() if path else None


def _public_key_bytes(encoded: str, prefix: int) -> bytes:
    """The raw ed25519 key of a public nkey (`N…` for a server), its prefix and checksum checked."""
    try:
        raw = base64.b32decode(encoded + "=" * (-len(encoded) % 8))
    except (binascii.Error, ValueError):
        raise CalloutRefused("the request names no valid server key") from None
    body, checksum = raw[:-2], raw[-2:]
    if len(body) != 33 or body[0] != prefix or nkeys.crc16_checksum(body) != checksum:
        raise CalloutRefused("the request names no valid server key")
    return bytes(body[1:])


# --- JWTs -----------------------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def encode_jwt(claims: Mapping[str, Any], seed: bytes) -> str:
    """A NATS JWT of `claims` signed with the nkey `seed`; `jti` is the hash of the claims, as NATS does."""
    body = dict(claims)
    body["jti"] = ""
    body["jti"] = base64.b32encode(hashlib.sha256(json.dumps(body).encode()).digest()).decode().rstrip("=")
    signing_input = f"{_b64(json.dumps(JWT_HEADER).encode())}.{_b64(json.dumps(body).encode())}"
    signature = nkeys.from_seed(seed).sign(signing_input.encode())
    return f"{signing_input}.{_b64(signature)}"


def decode_request(data: bytes) -> dict[str, Any]:
    """The claims of the server's authorization request, its signature checked against the server key
    it names (the request arrives on a subject only the server publishes to; this proves it)."""
    if len(data) > MAX_REQUEST_BYTES:
        raise CalloutRefused("the authorization request is too large")
    try:
        header_b64, claims_b64, signature_b64 = data.decode().split(".")
        header, claims = json.loads(_unb64(header_b64)), json.loads(_unb64(claims_b64))
        signature = _unb64(signature_b64)
    except (ValueError, UnicodeDecodeError, binascii.Error):
        raise CalloutRefused("the authorization request is not a JWT") from None
    if not isinstance(header, dict) or header.get("alg") != JWT_HEADER["alg"] or not isinstance(claims, dict):
        raise CalloutRefused("the authorization request is not a NATS JWT")
    nats_part = claims.get("nats")
    if not isinstance(nats_part, dict) or nats_part.get("type") != "authorization_request":
        raise CalloutRefused("the JWT is not an authorization request")
    key = _public_key_bytes(str(claims.get("iss", "")), nkeys.PREFIX_BYTE_SERVER)
    try:
        VerifyKey(key).verify(f"{header_b64}.{claims_b64}".encode(), signature)
    except BadSignatureError:
        raise CalloutRefused("the authorization request's signature does not verify") from None
    return claims


def _permissions_claims(permissions: Permissions) -> dict[str, Any]:
    """No `resp` claim: replies go only to the inboxes the permissions name (libs/natsroles.py)."""
    return {
        "pub": {"allow": list(permissions.publish_allow), "deny": list(permissions.publish_deny)},
        "sub": {"allow": list(permissions.subscribe_allow), "deny": list(permissions.subscribe_deny)},
    }


def user_jwt(login: Login, *, user_nkey: str, seed: bytes, account: str, now: int) -> str:
    """The NATS user the server lets the connection in as: its name, permissions and expiry."""
    claims: dict[str, Any] = {
        "aud": account, "sub": user_nkey, "iss": issuer_public_key(seed), "iat": now, "name": login.nats_user,
        "nats": {**_permissions_claims(login.permissions), "subs": -1, "data": -1, "payload": -1,
                 "type": "user", "version": 2},
    }
    if login.expires is not None:
        claims["exp"] = login.expires
    return encode_jwt(claims, seed)


def response_jwt(request: Mapping[str, Any], *, seed: bytes, now: int, jwt: str | None = None,
                 error: str | None = None) -> str:
    """The answer to one authorization request: a user JWT, or the reason it is refused."""
    details = request["nats"]
    answer: dict[str, Any] = {"type": "authorization_response", "version": 2}
    if jwt is not None:
        answer["jwt"] = jwt
    if error is not None:
        answer["error"] = error
    claims = {"iss": issuer_public_key(seed), "sub": details.get("user_nkey", ""),
              "aud": details.get("server_id", {}).get("id", ""), "iat": now, "nats": answer}
    return encode_jwt(claims, seed)


# --- the decision ---------------------------------------------------------------------------------


def decide(token: str | None, *, secret: str) -> Login:
    """Which role a connection's token gives it (pure: no I/O, the secret is a parameter).

    All three kinds are signed with the platform secret; the `role` claim says which check applies,
    and each check refuses the other kinds. Once it passed, the claims name the login (`nats_user_of`,
    as a client names its inbox) and its end.
    """
    import jwt  # here, not at the top: PyJWT is only needed once a token arrives

    if not token:
        raise CalloutRefused("no token: connect with a Trainyard token (users: trainyard admin token; node agents: "
                             "a node credential; services: their NATS user and password)")
    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.InvalidTokenError:
        raise CalloutRefused("the token is not a JWT; ask an administrator for a Trainyard token") from None
    role = claims.get("role")
    try:
        if role == "job":
            grant = verify_job_token(secret, token)
            permissions = job_permissions(grant.job_id, grant.nodes)
        elif role == "node":
            permissions = agent_permissions(verify_node_token(secret, token))
        else:
            verify_token(secret, token)
            permissions = user_permissions(nats_user_of(claims))
    except AuthError as exc:
        raise CalloutRefused(str(exc)) from None
    exp = claims.get("exp")
    return Login(nats_user_of(claims), permissions, int(exp) if isinstance(exp, int | float) else None)


def answer(data: bytes, *, seed: bytes, secret: str, account: str = GLOBAL_ACCOUNT,
           now: float | None = None) -> tuple[bytes | None, str]:
    """The reply to one authorization request and what to log of it; None: the request itself is bad
    (not from the server), so no reply is sent and the connection times out."""
    moment = int(now if now is not None else time.time())
    try:
        request = decode_request(data)
    except CalloutRefused as exc:
        return None, f"ignored: {exc}"
    details = request["nats"]
    token = details.get("connect_opts", {}).get("auth_token")
    try:
        login = decide(token if isinstance(token, str) else None, secret=secret)
    except CalloutRefused as exc:
        return response_jwt(request, seed=seed, now=moment, error=str(exc)).encode(), f"refused: {exc}"
    user = user_jwt(login, user_nkey=str(details.get("user_nkey", "")), seed=seed, account=account, now=moment)
    return response_jwt(request, seed=seed, now=moment, jwt=user).encode(), f"admitted as {login.nats_user}"


async def serve(nc: Any, *, seed: bytes, secret: str, service: str) -> None:
    """Answer the server's authorization requests on `nc` (a service's own connection), in one queue
    group with every other service that holds the issuer key."""

    async def on_request(msg: Any) -> None:
        if msg.reply and not subject_matches(CALLOUT_REPLIES, msg.reply):
            # Only nats-server asks here, and it reads answers in an inbox of its own: nothing is sent elsewhere.
            log.warning("nats_auth.reply_refused", reply_to=msg.reply[:200], service=service,
                        reason=f"the reply subject is not the server's ({CALLOUT_REPLIES})")
            from libs.telemetry.metrics import REPLIES_REFUSED, attributes, counter

            counter(REPLIES_REFUSED).add(1, attributes(REPLIES_REFUSED, AUTH_CALLOUT_SUBJECT))
            return
        reply, outcome = answer(msg.data, seed=seed, secret=secret)
        log.info("nats_auth.login", outcome=outcome, service=service)
        if reply is not None and msg.reply:
            await nc.publish(msg.reply, reply)

    await nc.subscribe(AUTH_CALLOUT_SUBJECT, queue=QUEUE, cb=on_request)


def main() -> None:
    """`python -m libs.natsauth`: a new issuer key for the auth callout. The seed goes to the services
    that answer the callout (TRAINYARD_NATS_ISSUER_SEED_FILE), the public key to nats-server
    (`TRAINYARD_NATS_ISSUER`, deploy/nats/nats-server.conf)."""
    seed = new_issuer_seed()
    print(f"seed (keep secret):  {seed.decode()}")
    print(f"public key (server): {issuer_public_key(seed)}")


if __name__ == "__main__":
    main()
