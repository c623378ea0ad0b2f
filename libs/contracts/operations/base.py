"""What every operation shares: the `Operation` declaration, the bases of requests and replies, the one
error reply (`CommandError`) and the plain `Done`.

An operation is one request/reply exchange over core NATS: its subject, its request and reply types, the
service (or node agent) that answers it, the roles NATS lets send it, how the answerer authenticates the
sender, the largest request it decodes and whether it changes state. Each is declared once, beside its
request and reply (`libs/contracts/operations/<area>.py`); `catalogue.py` gathers them for the services'
route tables, the client, the NATS permissions and the docs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Generic, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from libs.contracts.jobspec import FieldError

# Who answers an operation: a service, or the node agent of the node its subject names.
Answerer = Literal["scheduler", "monitor", "autoscaler", "agent"]
# Who may send it, as NATS enforces it (libs/natsroles.py): a person (the CLI, the client), a node
# agent, a job's remote shell, or a service.
Caller = Literal["user", "agent", "job", "launcher", "monitor"]
# How the answerer knows the sender: a person's signed token (libs/auth.py, the handler gets the
# identity); the control plane's signature (libs/controlsign.py, requests to agents); a job's token
# (an exec into the job); an agent's credential, which the handler checks itself (registration).
Authentication = Literal["user-token", "control-signature", "job-token", "agent-credential"]

# The largest request body decoded: NATS's default max payload. A server configured for larger messages
# still gets nothing bigger decoded (the largest valid request, a spec at its limit, is a quarter of this).
MAX_REQUEST_BYTES = 1024 * 1024
# In the subject of an operation answered by node agents, the node's name (`Operation.subject_for`).
NODE = "*"

RequestT = TypeVar("RequestT", bound=Struct)
ReplyT = TypeVar("ReplyT", bound=Struct)


@dataclass(frozen=True)
class Operation(Generic[RequestT, ReplyT]):
    """One request/reply operation, declared once."""

    name: str  # kebab-case, for people: the docs and the list of operations
    subject: str  # where it is asked; for an agent's, `*` stands for the node (`subject_for`)
    request: type[RequestT]
    reply: type[ReplyT]  # the reply when it succeeds; a refusal is a `CommandError`
    answered_by: Answerer
    callers: frozenset[Caller]
    changes_state: bool
    summary: str
    authentication: Authentication = "user-token"
    max_request_bytes: int = MAX_REQUEST_BYTES
    progress: type[Struct] | None = None  # sent before the reply while a long request runs

    def subject_for(self, node: str) -> str:
        """An agent's operation's subject for one node."""
        return self.subject.replace(f".{NODE}.", f".{node}.", 1)


def people_operation(name: str, subject: str, request: type[RequestT], reply: type[ReplyT], answered_by: Answerer,
                     *, changes_state: bool, summary: str,
                     progress: type[Struct] | None = None) -> Operation[RequestT, ReplyT]:
    """An operation people send (the CLI, the client) with their token."""
    return Operation(name=name, subject=subject, request=request, reply=reply, answered_by=answered_by,
                     callers=frozenset({"user"}), changes_state=changes_state, summary=summary, progress=progress)


JobStatus = Literal["queued", "running", "succeeded", "failed", "stopped", "expired"]
JOB_STATUSES: tuple[JobStatus, ...] = ("queued", "running", "succeeded", "failed", "stopped", "expired")
TERMINAL_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "stopped", "expired"})

PastInstant = Annotated[datetime, Meta(tz=True)]
"""`at` of a view (`trainyard at TIME …`): answer it as the scheduler would have at that instant, from the events
recorded up to it; None (the default) is now. It must name its time zone."""


class RequestMessage(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    """Base of every command and query."""


# --- replies ---------------------------------------------------------------------------------------


class ReplyMessage(Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every reply."""


ErrorCode = Literal["invalid-request", "invalid-spec", "not-found", "conflict", "invalid-state",
                    "unauthenticated", "forbidden", "over-cap", "unavailable", "internal"]


class CommandError(ReplyMessage, frozen=True, tag="Error.v1"):
    """A refused request: `code` for programs, `message` and `hint` for people."""

    code: ErrorCode
    message: str
    hint: str | None = None
    errors: list[FieldError] = msgspec.field(default_factory=list)


class Done(ReplyMessage, frozen=True, tag="Done.v1"):
    """A command that changed (or found already changed) the named jobs."""

    job_ids: list[str]
    message: str = ""
