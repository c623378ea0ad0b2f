"""Signed identity tokens (SPEC J2): who a request comes from, verified by the services.

A token is a JWT signed with HMAC-SHA256 by the platform's secret. It names the user, the projects
they belong to and whether they administer the platform. Administrators issue tokens
(`trainyard admin token`); clients send them in the `Authorization: Bearer` header of every request;
the services, which hold the same secret, verify the signature and expiry and act for that identity
only.

A job token (`role: job`) is a third kind: issued by the launcher with each start request, it lets
that job's processes (MPI's remote shell) log in to NATS as the job and nothing more.

A node credential is a token of another kind, signed with the same secret: it names one node
(`role: node`, subject `node:<name>`). An agent sends it with its registration and heartbeats; the
monitor accepts a node only with a credential for exactly that node (docs/security.md). The two
kinds are never usable as each other: user verification refuses node credentials and node
verification refuses user tokens.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libs.contracts.identity import AUTH_HEADER, Identity
from libs.contracts.ids import is_job_id
from libs.contracts.jobspec import NODE_NAME

ALGORITHM = "HS256"
ISSUER = "trainyard"
DEFAULT_TTL_SECONDS = 30 * 86400
NODE_ROLE = "node"
NODE_SUBJECT_PREFIX = "node:"  # a node credential's `sub`; no user token carries it
DEFAULT_NODE_TTL_SECONDS = 365 * 86400
NODE_CREDENTIAL_HINT = "ask an administrator for a node credential: trainyard admin node-token {node}"


class AuthError(Exception):
    """A missing, malformed, forged or expired token; the message says which and what to do."""


def new_secret() -> str:
    return secrets.token_urlsafe(48)


def _sign(secret: str, claims: dict[str, object], ttl_seconds: int, issued_at: int | None = None) -> str:
    """A token of `claims`, issued by Trainyard at `issued_at` (now by default) and valid for `ttl_seconds`."""
    import jwt  # here, not at the top: a CLI command that only sends a token need not load PyJWT

    now = int(time.time()) if issued_at is None else issued_at
    return jwt.encode({"iss": ISSUER, **claims, "iat": now, "exp": now + ttl_seconds}, secret, algorithm=ALGORITHM)


def issue_token(secret: str, identity: Identity, *, ttl_seconds: int = DEFAULT_TTL_SECONDS) -> str:
    claims: dict[str, object] = {"sub": identity.user, "projects": list(identity.projects), "admin": identity.admin}
    if identity.email:
        claims["email"] = identity.email
    return _sign(secret, claims, ttl_seconds)


# Checking a token's signature costs more than most requests it comes with, and a client sends the same
# token with each of them: the claims of the tokens verified last are kept, by the exact token and the
# secret that verified it. Only time can make a verified token invalid (its expiry), which is checked on
# every use; a token that failed is never kept. The monitor sees every node's credential with each of its
# heartbeats, in turn, so more are kept than one deployment has nodes (about 1 KiB each): with fewer, the
# oldest would always be the next to come, and none would be found.
VERIFIED_TOKENS_KEPT = 32_768
_verified: dict[tuple[str, str], tuple[dict[str, object], int]] = {}


def _claims(secret: str, token: str, *, renew: str) -> dict[str, object]:
    """The verified claims of a token of either kind; `renew` says how to get a new one."""
    if (kept := _verified.get((secret, token))) is not None:
        claims, expires = kept
        if time.time() < expires:
            return claims
        _verified.pop((secret, token), None)
        raise AuthError(f"the token has expired; {renew}")
    import jwt  # here, not at the top: a CLI command that only sends a token need not load PyJWT

    try:
        verified: dict[str, Any] = jwt.decode(token, secret, algorithms=[ALGORITHM], issuer=ISSUER,
                                              options={"require": ["exp", "iat", "sub", "iss"]})
    except jwt.ExpiredSignatureError:
        raise AuthError(f"the token has expired; {renew}") from None
    except jwt.InvalidTokenError as exc:
        raise AuthError(f"the token is not valid ({exc}); {renew}") from None
    if len(_verified) >= VERIFIED_TOKENS_KEPT:
        _verified.pop(next(iter(_verified)))  # the oldest
    _verified[(secret, token)] = (verified, int(verified["exp"]))  # as PyJWT read it
    return verified


def _is_node_credential(claims: Mapping[str, object]) -> bool:
    return "role" in claims or str(claims["sub"]).startswith(NODE_SUBJECT_PREFIX)


def verify_token(secret: str, token: str) -> Identity:
    """The user a user token speaks for; a node credential is refused."""
    claims = _claims(secret, token, renew="ask an administrator for a new one")
    if _is_node_credential(claims):
        raise AuthError("the token is a node or job credential, not a user token; ask an administrator for a "
                        "user token (trainyard admin token)")
    projects = claims.get("projects", [])
    if not isinstance(projects, list) or not all(isinstance(p, str) for p in projects):
        raise AuthError("the token's projects are not a list of names")
    email = claims.get("email")
    return Identity(user=str(claims["sub"]), projects=list(projects), admin=bool(claims.get("admin", False)),
                    email=str(email) if email else None)


def issue_node_token(secret: str, node: str, *, ttl_seconds: int = DEFAULT_NODE_TTL_SECONDS) -> str:
    """A credential that lets an agent register and heartbeat as `node`, and as nothing else."""
    if not re.fullmatch(NODE_NAME, node):
        raise AuthError(f"{node!r} is not a node name; node names are lower-case DNS labels such as node-a")
    from libs.controlsign import control_public_keys  # here: a CLI that only sends tokens need not load nacl

    # The control plane's public keys ride along: the agent obeys requests signed with them (libs/controlsign.py).
    return _sign(secret, {"sub": NODE_SUBJECT_PREFIX + node, "role": NODE_ROLE, "node": node,
                          "control_keys": control_public_keys(secret)}, ttl_seconds)


def node_token_control_keys(token: str) -> object:
    """The control-plane keys a node credential carries, read by its agent, which cannot check the token's
    signature (it holds no secret) and needs none: the credential came from an administrator."""
    import jwt

    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError as exc:
        raise AuthError(f"the node credential is not a token ({exc}); ask an administrator for a new one "
                        "(trainyard admin node-token NODE)") from None
    return claims.get("control_keys")


def verify_node_token(secret: str, token: str) -> str:
    """The node a node credential was issued for; a user token is refused."""
    renew = "ask an administrator for a new node credential (trainyard admin node-token NODE)"
    claims = _claims(secret, token, renew=renew)
    node = claims.get("node")
    if claims.get("role") != NODE_ROLE or not isinstance(node, str) or claims["sub"] != NODE_SUBJECT_PREFIX + node:
        raise AuthError(f"the token is not a node credential (a user token cannot register a node); {renew}")
    if not re.fullmatch(NODE_NAME, node):
        raise AuthError(f"the node credential names no valid node ({node!r}); {renew}")
    return node


JOB_ROLE = "job"
JOB_SUBJECT_PREFIX = "job:"  # a job token's `sub`


@dataclass(frozen=True)
class JobGrant:
    """What a job token allows: MPI's remote shell of this job attempt, on these nodes."""

    job_id: str
    attempt: int
    nodes: tuple[str, ...]


def issue_job_token(secret: str, job_id: str, attempt: int, nodes: Sequence[str], *, issued_at: int | None = None,
                    ttl_seconds: int = DEFAULT_TTL_SECONDS) -> str:
    """A token scoped to one job attempt, handed to its processes: it logs in to NATS as that job, which
    may only ask the agents of its own nodes to run a command inside it (libs/natsroles.job_permissions).
    The same attempt always gets the same token (`issued_at` is when it was planned): every node of the
    attempt, started before or after a restart of the launcher, knows the one token its processes carry."""
    if not is_job_id(job_id):
        raise AuthError(f"{job_id!r} is not a job id")
    return _sign(secret, {"sub": JOB_SUBJECT_PREFIX + job_id, "role": JOB_ROLE, "job": job_id, "attempt": attempt,
                          "nodes": sorted(set(nodes))}, ttl_seconds, issued_at)


def verify_job_token(secret: str, token: str) -> JobGrant:
    """The job attempt and nodes a job token was issued for; a user token or node credential is refused."""
    claims = _claims(secret, token, renew="a job token comes with its job; it cannot be renewed")
    job, attempt, nodes = claims.get("job"), claims.get("attempt"), claims.get("nodes")
    if (claims.get("role") != JOB_ROLE or not isinstance(job, str) or not is_job_id(job)
            or claims["sub"] != JOB_SUBJECT_PREFIX + job or not isinstance(attempt, int)
            or not isinstance(nodes, list)
            or not all(isinstance(n, str) and re.fullmatch(NODE_NAME, n) for n in nodes)):
        raise AuthError("the token is not a job token")
    return JobGrant(job_id=job, attempt=attempt, nodes=tuple(nodes))


def _bearer(headers: Mapping[str, str] | None, *, what: str, missing: str) -> str:
    """The token in a message's `Authorization: Bearer` header; `missing` says what to do without one."""
    value = (headers or {}).get(AUTH_HEADER, "")
    if not value:
        raise AuthError(missing)
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise AuthError(f"the {AUTH_HEADER} header must read 'Bearer <{what}>'")
    return token.strip()


def node_from_headers(secret: str, headers: Mapping[str, str] | None) -> str:
    """The node whose credential a message carries in its `Authorization: Bearer` header."""
    return verify_node_token(secret, _bearer(
        headers, what="node credential",
        missing="the message carries no node credential; set TRAINYARD_NODE_TOKEN_FILE for the agent"))


def bearer_token(headers: Mapping[str, str] | None) -> str:
    """The token a message carries, unchecked: for a receiver that compares it with one it was given."""
    return _bearer(headers, what="token", missing="the request carries no token")


def bearer_headers(token: str | None) -> dict[str, str]:
    return {AUTH_HEADER: f"Bearer {token}"} if token else {}


def identity_from_headers(secret: str, headers: Mapping[str, str] | None) -> Identity:
    return verify_token(secret, _bearer(
        headers, what="token",
        missing="the request carries no token; set TRAINYARD_TOKEN or ask an administrator for one "
                "(trainyard admin token)"))


def read_secret(*, required: bool = True) -> str | None:
    """The platform secret from TRAINYARD_AUTH_SECRET or the file TRAINYARD_AUTH_SECRET_FILE names."""
    if secret := os.environ.get("TRAINYARD_AUTH_SECRET"):
        return secret
    if path := os.environ.get("TRAINYARD_AUTH_SECRET_FILE"):
        return Path(path).read_text().strip()
    if required:
        raise AuthError("no signing secret: set TRAINYARD_AUTH_SECRET or TRAINYARD_AUTH_SECRET_FILE")
    return None
