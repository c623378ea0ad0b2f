"""Signed identity tokens (SPEC J2): who a request comes from, verified by the services.

A token is a JWT signed with HMAC-SHA256 by the platform's secret. It names the user, the projects
they belong to and whether they administer the platform. Administrators issue tokens
(`trainyard admin token`); clients send them in the `Authorization: Bearer` header of every request;
the services, which hold the same secret, verify the signature and expiry and act for that identity
only. Node agents do not use tokens: they speak to the services on their own subjects, which a
deployment restricts with NATS permissions (docs/security.md).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path

from libs.contracts.identity import AUTH_HEADER, Identity

ALGORITHM = "HS256"
ISSUER = "trainyard"
DEFAULT_TTL_SECONDS = 30 * 86400


class AuthError(Exception):
    """A missing, malformed, forged or expired token; the message says which and what to do."""


def new_secret() -> str:
    return secrets.token_urlsafe(48)


def issue_token(secret: str, identity: Identity, *, ttl_seconds: int = DEFAULT_TTL_SECONDS) -> str:
    now = int(time.time())
    claims: dict[str, object] = {"iss": ISSUER, "sub": identity.user, "projects": list(identity.projects),
                                 "admin": identity.admin, "iat": now, "exp": now + ttl_seconds}
    if identity.email:
        claims["email"] = identity.email
    import jwt  # here, not at the top: a CLI command that only sends a token need not load PyJWT

    return jwt.encode(claims, secret, algorithm=ALGORITHM)


def verify_token(secret: str, token: str) -> Identity:
    import jwt

    try:
        claims = jwt.decode(token, secret, algorithms=[ALGORITHM], issuer=ISSUER,
                            options={"require": ["exp", "iat", "sub", "iss"]})
    except jwt.ExpiredSignatureError:
        raise AuthError("the token has expired; ask an administrator for a new one") from None
    except jwt.InvalidTokenError as exc:
        raise AuthError(f"the token is not valid ({exc}); ask an administrator for a new one") from None
    projects = claims.get("projects", [])
    if not isinstance(projects, list) or not all(isinstance(p, str) for p in projects):
        raise AuthError("the token's projects are not a list of names")
    email = claims.get("email")
    return Identity(user=str(claims["sub"]), projects=projects, admin=bool(claims.get("admin", False)),
                    email=str(email) if email else None)


def bearer_headers(token: str | None) -> dict[str, str]:
    return {AUTH_HEADER: f"Bearer {token}"} if token else {}


def identity_from_headers(secret: str, headers: Mapping[str, str] | None) -> Identity:
    value = (headers or {}).get(AUTH_HEADER, "")
    if not value:
        raise AuthError("the request carries no token; set TRAINYARD_TOKEN or ask an administrator for one "
                        "(trainyard admin token)")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise AuthError(f"the {AUTH_HEADER} header must read 'Bearer <token>'")
    return verify_token(secret, token.strip())


def read_secret(*, required: bool = True) -> str | None:
    """The platform secret from TRAINYARD_AUTH_SECRET or the file TRAINYARD_AUTH_SECRET_FILE names."""
    if secret := os.environ.get("TRAINYARD_AUTH_SECRET"):
        return secret
    if path := os.environ.get("TRAINYARD_AUTH_SECRET_FILE"):
        return Path(path).read_text().strip()
    if required:
        raise AuthError("no signing secret: set TRAINYARD_AUTH_SECRET or TRAINYARD_AUTH_SECRET_FILE")
    return None
