"""Who is calling: a bearer token (programs), or a console session (people in a browser).

A console session is held here, server-side: the browser keeps only a random id, in an HttpOnly, SameSite=Strict
cookie, and the token it stands for never leaves the gateway again. A cookie rides along with any request
the browser makes, so whatever a cookie-borne request would change must also carry the session's CSRF token (a
header, or a form field) and, when the browser says where it came from, come from the gateway's own origin.
Sessions live in this process's memory: a restart, or another replica, asks people to sign in again.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.requests import HTTPConnection

from libs.auth import ISSUER, AuthError, bearer_token
from libs.contracts.identity import Identity
from libs.contracts.operations.base import CommandError
from libs.natsroles import nats_user_for
from services.gateway.calls import Refused

SESSION_COOKIE = "trainyard_session"
CSRF_HEADER = "x-csrf-token"
CSRF_FIELD = "csrf_token"
IDLE_SECONDS = 8 * 3600.0  # a session unused this long is over
LONGEST_SECONDS = 24 * 3600.0  # and any session, after this long
MOST_SESSIONS = 10_000  # beyond it the least recently used is closed
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
TOKEN_HINT = "send `Authorization: Bearer <token>`; `trainyard admin token` issues one"


@dataclass
class Session:
    token: str
    identity: Identity
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    created: float = 0.0
    used: float = 0.0
    closed: bool = False  # signed out, expired or pushed out: its open streams end too

    @property
    def user(self) -> str:
        return self.identity.user

    @property
    def admin(self) -> bool:
        return self.identity.admin


@dataclass(frozen=True)
class Caller:
    token: str
    session: Session | None = None  # None: a program with a bearer token


def _key(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


class Sessions:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic, idle_seconds: float = IDLE_SECONDS,
                 longest_seconds: float = LONGEST_SECONDS, most: int = MOST_SESSIONS) -> None:
        self.clock = clock
        self.idle_seconds = idle_seconds
        self.longest_seconds = longest_seconds
        self.most = most
        self._open: OrderedDict[str, Session] = OrderedDict()  # digest of the cookie's id -> session

    def open(self, token: str, identity: Identity) -> tuple[str, Session]:
        """A new session for a checked token: its id (the cookie's value) and the session."""
        session_id = secrets.token_urlsafe(32)
        now = self.clock()
        session = Session(token=token, identity=identity, created=now, used=now)
        self._open[_key(session_id)] = session
        while len(self._open) > self.most:
            _, dropped = self._open.popitem(last=False)
            dropped.closed = True
        return session_id, session

    def get(self, session_id: str) -> Session | None:
        key = _key(session_id)
        session = self._open.get(key)
        if session is None:
            return None
        now = self.clock()
        if now - session.used > self.idle_seconds or now - session.created > self.longest_seconds:
            del self._open[key]
            session.closed = True
            return None
        session.used = now
        self._open.move_to_end(key)
        return session

    def close(self, session_id: str) -> None:
        session = self._open.pop(_key(session_id), None)
        if session is not None:
            session.closed = True

    def is_open(self, session: Session) -> bool:
        """Whether `session` is still open (not signed out, not expired), without counting as a use of it."""
        now = self.clock()
        return (not session.closed and now - session.used <= self.idle_seconds
                and now - session.created <= self.longest_seconds)

    def __len__(self) -> int:
        return len(self._open)

    def of(self, connection: HTTPConnection) -> Session | None:
        """The session of the request's cookie, if it is one still open."""
        session_id = connection.cookies.get(SESSION_COOKIE)
        return self.get(session_id) if session_id else None


def own_origin(connection: HTTPConnection) -> bool:
    """Whether the request comes from a page of this gateway, as far as the browser tells (`Origin`, else
    `Referer`); a request that tells neither is taken as a program's, which carries no cookie of ours."""
    told = connection.headers.get("origin") or connection.headers.get("referer")
    if not told:
        return True
    host = connection.headers.get("host", "")
    return any(told == f"{scheme}://{host}" or told.startswith(f"{scheme}://{host}/") for scheme in ("http", "https"))


def csrf_matches(session: Session, presented: str | None) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), session.csrf.encode())


def from_console_page(connection: HTTPConnection, session: Session, presented: object) -> bool:
    """Whether a change a session's cookie came with was sent by one of the console's own pages: from its own
    origin, with the session's CSRF token (`presented`: a header's or a form field's value)."""
    return own_origin(connection) and csrf_matches(session, presented if isinstance(presented, str) else None)


def bearer_caller(connection: HTTPConnection) -> Caller:
    """The caller of a request with an `Authorization` header; what is no Trainyard token is refused here,
    without a login to NATS."""
    try:
        token = bearer_token(connection.headers)
    except AuthError as exc:
        raise Refused(CommandError(code="unauthenticated", message=str(exc), hint=TOKEN_HINT)) from None
    problem = not_a_persons_token(token)
    if problem is not None:
        raise Refused(CommandError(code="unauthenticated", message=problem, hint=TOKEN_HINT))
    return Caller(token=token)


def not_a_persons_token(token: str, *, now: float | None = None) -> str | None:
    """Why `token` is no person's Trainyard token, read without its signature (NATS's auth callout and the
    services check that): what fails here is refused without a login to NATS. None when it may be one."""
    import jwt  # here, not at the top: as libs.natsroles reads tokens

    try:
        claims = jwt.decode(token, options={"verify_signature": False, "verify_exp": False})
    except jwt.InvalidTokenError:
        return "the token is not a Trainyard token"
    if claims.get("iss") != ISSUER or not isinstance(claims.get("sub"), str) or not claims["sub"] \
            or nats_user_for(token) is None:
        return "the token is not a Trainyard token"
    if claims.get("role") is not None:
        return f"the token is a {claims['role']}'s, not a person's: the gateway acts for people only"
    expires = claims.get("exp")
    if not isinstance(expires, int) or expires <= (time.time() if now is None else now):
        return "the token has expired"
    return None


def caller_of(connection: HTTPConnection, sessions: Sessions, *, csrf: str | None = None) -> Caller:
    """Who sends the request: its bearer token, else its console session. A session's request that is not a
    plain read must carry the session's CSRF token (`csrf`, from a form, or the X-CSRF-Token header) and come
    from this gateway's own pages."""
    if "authorization" in connection.headers:
        return bearer_caller(connection)
    session = sessions.of(connection)
    if session is None:
        raise Refused(CommandError(code="unauthenticated", message="the request carries no token",
                                   hint=TOKEN_HINT + ", or sign in to the console at /signin"))
    method = connection.scope.get("method", "GET")  # a WebSocket's handshake is a GET
    if method not in SAFE_METHODS or connection.scope["type"] == "websocket":
        # A WebSocket's page sends the token as its first message (`csrf`): a browser cannot set its headers.
        presented = csrf if csrf is not None else connection.headers.get(CSRF_HEADER)
        if not from_console_page(connection, session, presented):
            raise Refused(CommandError(code="forbidden", message="the request does not come from the console's "
                                       "own page (its CSRF token is missing or wrong)",
                                       hint="reload the page and try again"))
    return Caller(token=session.token, session=session)
