"""Least-privilege NATS permissions for every kind of process, and a nats-server configuration from them.

Each process gets its own NATS user, whose permissions follow what the code does on NATS:

- a service (scheduler, launcher, monitor, autoscaler) publishes only its own events
  (`trainyard.events.<service>.>`), the requests it sends and its replies, into the inboxes of those who
  ask it (`reply_inboxes`), subscribes to the subjects it answers, and uses the JetStream API only for the
  streams it owns (`STREAM_OWNERS`), the consumers it reads through and the key-value bucket where it uses it;
- a node agent publishes only its own node's reports, registration, heartbeat, session output, log chunks,
  metrics and usage samples (each subject, or usage key, ends with the node: the services compare it with
  the node the message names), answers only its own `trainyard.agent.<node>.>` requests, into the
  inboxes of the launcher, the monitor and jobs, and manages no stream at all;
- a person (CLI, client) sends command and query requests and takes part in their own debug sessions
  (the session subjects name their owner); nothing else;
- a job (MPI's remote shell) asks only the agents of its own nodes to run a command inside it.

Every user receives replies only on its own inbox prefix (`inbox_prefix`), so nobody reads another's
replies. No role may publish to the reply subject a request names unless the subject is an inbox of
a role that asks it (no `allow_responses`): a request cannot lend its responder's rights to whatever
subject it names, and the responders check that it is the caller's own inbox (`reply_refusal`).
Services are static users of the rendered configuration; everyone else logs in with a token
through the auth callout (libs/natsauth.py), which grants these same permissions. docs/security.md
has the table.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from libs.contracts import subjects
from libs.contracts.ids import is_job_id
from libs.contracts.operations.catalogue import OPERATIONS, answered_by, sent_by

SERVICES = ("scheduler", "launcher", "monitor", "autoscaler")

# Which service declares (creates and updates) each stream; the others only read or publish into it.
# The scheduler owns the event stream every service publishes to and the usage bucket it serves from,
# the launcher the agent reports it alone follows, the monitor the log stream its durable consumer reads.
STREAM_OWNERS: Mapping[str, str] = {
    subjects.EVENTS_STREAM: "scheduler",
    subjects.USAGE_STREAM: "scheduler",
    subjects.AGENT_REPORTS_STREAM: "launcher",
    subjects.LOGS_STREAM: "monitor",
    subjects.CACHE_REPORTS_STREAM: "monitor",
    subjects.METRICS_STREAM: "monitor",
}

# The server asks here who a connection is (libs/natsauth.py); these services hold the issuer key and
# answer in one queue group, so people and agents can log in while either of them runs.
AUTH_CALLOUT_SUBJECT = "$SYS.REQ.USER.AUTH"
CALLOUT_SERVICES = ("scheduler", "monitor")


def request_subjects() -> tuple[str, ...]:
    """Every command and query subject a person may send: the catalogue's operations for people."""
    return tuple(sorted(operation.subject for operation in sent_by("user")))


def answered_subjects(service: str) -> tuple[str, ...]:
    """The request subjects `service` answers (core NATS request/reply, faststream queue groups)."""
    return tuple(sorted(operation.subject for operation in OPERATIONS if operation.answered_by == service))


NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


class RoleError(ValueError):
    """A node or user name that cannot be used in a subject or a NATS user name."""


def _checked(kind: str, name: str) -> str:
    if not NAME.fullmatch(name):
        raise RoleError(f"{kind} name {name!r} must be a lower-case DNS label (letters, digits, '-')")
    return name


@dataclass(frozen=True)
class Permissions:
    """One NATS user's permissions, as nats-server's `permissions` block takes them. There is no
    `allow_responses`: it would let a role publish to any reply subject a request names, past its deny list;
    replies go only to the inboxes listed in `publish_allow`."""

    publish_allow: tuple[str, ...]
    subscribe_allow: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()


INBOX = "_INBOX"  # nats-py's default inbox prefix, and the root of every role's own
# People's, agents' and jobs' inboxes each lie under a token of their kind: NATS wildcards match whole tokens
# only, so this is how a responder may be let publish into every person's inbox and nowhere else.
USERS, AGENTS, JOBS = "users", "agents", "jobs"


def inbox_prefix(nats_user: str) -> str:
    """The inbox prefix a process connects with (`nats.connect(inbox_prefix=…)`): its replies,
    JetStream acknowledgements and consumer deliveries arrive under it, and only it may subscribe there.
    A service's is `_INBOX.<service>`; a person's `_INBOX.users.user-<name>`, an agent's
    `_INBOX.agents.agent-<node>`, a job's `_INBOX.jobs.<job>`."""
    if is_job_id(nats_user):
        return job_inbox(nats_user)
    if nats_user.startswith("user-"):
        return f"{INBOX}.{USERS}.{nats_user}"
    if nats_user.startswith("agent-"):
        return f"{INBOX}.{AGENTS}.{nats_user}"
    return f"{INBOX}.{nats_user}"


def agent_user(node: str) -> str:
    return f"agent-{_checked('node', node)}"


def user_nats_name(user: str) -> str:
    """A person's NATS user: `user-<name>`, or `user-<hash>` for a name that is no DNS label (an e-mail)."""
    if NAME.fullmatch(user) and len(user) <= 40:
        return f"user-{user}"
    return "user-" + hashlib.sha256(user.encode()).hexdigest()[:24]


def job_user(job_id: str) -> str:
    """A job's NATS user (its remote shell); the job id (`job-<hex>`) is already a safe name."""
    if not is_job_id(job_id):
        raise RoleError(f"{job_id!r} is not a job id")
    return job_id


JOB_INBOXES = f"{INBOX}.{JOBS}"  # agents answer a job's remote shell here, under the job's own inbox


def job_inbox(job_id: str) -> str:
    return f"{JOB_INBOXES}.{job_user(job_id)}"


# --- where replies may go ---------------------------------------------------------------------------
#
# Who asks whom: people ask the scheduler, the monitor and the autoscaler; node agents ask the monitor
# (registration); the launcher and the monitor ask agents, and so do jobs (an exec); nats-server asks the
# services that answer its auth callout. Each responder may publish into the inboxes of those callers
# only, and answers a request only in its own caller's inbox.

USER_INBOXES = f"{INBOX}.{USERS}.*.>"
AGENT_INBOXES = f"{INBOX}.{AGENTS}.*.>"
EXEC_INBOXES = f"{JOB_INBOXES}.*.>"
# nats-server asks the auth callout with a reply subject of its own, `$SYS._INBOX.<server hash>.<id>`
# (newRespInbox in its server/events.go), and reads the answer in the account of the callout's users.
CALLOUT_REPLIES = "$SYS._INBOX.*.*"

def agent_request_sender(node: str, subject: str) -> str | None:
    """The service that alone sends the request `subject` to `node`'s agent; None for an exec (a job asks it)."""
    for operation in answered_by("agent"):
        if subject == operation.subject_for(node):
            return next((caller for caller in operation.callers if caller in SERVICES), None)
    return None


def asks_agents(service: str) -> list[str]:
    """The subjects (every node's) of the requests only `service` sends to agents."""
    return [operation.subject for operation in answered_by("agent") if service in operation.callers]


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` one token, `>` one or more at the end."""
    want, have = pattern.split("."), subject.split(".")
    for index, token in enumerate(want):
        if token == ">":
            return len(have) > index
        if index >= len(have) or token not in ("*", have[index]):
            return False
    return len(want) == len(have)


_LITERAL_SUBJECT = re.compile(r"(?:(?![*>](?:\.|$))[^.\s]+)(?:\.(?![*>](?:\.|$))[^.\s]+)*")


def _literal(subject: str) -> bool:
    """A subject one can publish to: tokens that are neither empty nor wildcards, no white space."""
    return _LITERAL_SUBJECT.fullmatch(subject) is not None


def anonymous_inbox(subject: str) -> bool:
    """Whether `subject` is in an inbox no role owns (`_INBOX.<id>…`, nats-py's default): what a connection
    without a login uses on a server that asks none. Where NATS enforces the roles, no role may publish or
    subscribe there, so an answer sent there reaches nobody."""
    parts = subject.split(".")
    if len(parts) < 2 or parts[0] != INBOX:
        return False
    owner = parts[1]  # a role's inbox starts with a service's name or a kind of role (`users`, `agents`, `jobs`)
    return owner.isalnum() and owner not in (*SERVICES, USERS, AGENTS, JOBS)


def reply_refusal(caller: str | None, reply: str) -> str | None:
    """Why a request from `caller` (its NATS user: who its credential names; None when it names nobody) must
    not be answered on `reply`, or None when it may: only under the caller's own inbox prefix, or in an
    anonymous inbox. Anything else (a stream's subject, the JetStream API, another's inbox) is refused."""
    if not _literal(reply):
        return f"the reply subject {reply!r} is no subject one can publish to"
    if caller is not None and reply.startswith(inbox_prefix(caller) + "."):
        return None
    if anonymous_inbox(reply):
        return None
    own = f"the caller's inbox {inbox_prefix(caller)}." if caller is not None else "an inbox of its own"
    return f"the reply subject is not under {own}"


def nats_user_of(claims: Mapping[str, object]) -> str:
    """The NATS user a token's claims log in as, by their `role`: the auth callout names a login so once
    it has verified them, and a client reads them unverified to pick the inbox its role may read."""
    role = claims.get("role")
    if role == "node":
        return agent_user(str(claims.get("node", "")))
    if role == "job":
        return job_user(str(claims.get("job", "")))
    return user_nats_name(str(claims.get("sub", "")))


# Kept by token: a service reads the caller of every request from its token, and a client sends the same token
# with each (a decode costs some 40 µs; a deployment has far fewer callers than this at once).
@functools.lru_cache(maxsize=4096)
def nats_user_for(token: str) -> str | None:
    """The NATS user a token logs in as, without checking its signature (the auth callout does); None
    for what is no token of ours."""
    import jwt  # here, not at the top: most processes never log in with a token

    try:
        return nats_user_of(jwt.decode(token, options={"verify_signature": False}))
    except (jwt.InvalidTokenError, RoleError):
        return None


# --- JetStream API subjects (nats-py 2.x against nats-server 2.10+) ----------------------------------

API = "$JS.API"


def _manage(stream: str) -> list[str]:
    """Create and update a stream (`ensure_streams`; nats-py creates a KV bucket as a stream)."""
    return [f"{API}.STREAM.CREATE.{stream}", f"{API}.STREAM.UPDATE.{stream}", f"{API}.STREAM.INFO.{stream}"]


def _ordered_reader(stream: str) -> list[str]:
    """A follower (`libs.messaging.follower`): what the stream holds at its start fetched by an ephemeral pull
    consumer, then `js.subscribe(ordered_consumer=True)`: ephemeral consumers, recreated on a gap,
    flow-controlled."""
    return [f"{API}.STREAM.INFO.{stream}", f"{API}.CONSUMER.CREATE.{stream}", f"{API}.CONSUMER.CREATE.{stream}.>",
            f"{API}.CONSUMER.INFO.{stream}.*", f"{API}.CONSUMER.DELETE.{stream}.*", f"$JS.FC.{stream}.>",
            f"{API}.CONSUMER.MSG.NEXT.{stream}.*"]


def _durable_puller(stream: str, durable: str) -> list[str]:
    """`js.pull_subscribe(durable=…)`: look up or create the consumer, fetch batches, acknowledge."""
    return [f"{API}.CONSUMER.INFO.{stream}.{durable}", f"{API}.CONSUMER.CREATE.{stream}.{durable}",
            f"{API}.CONSUMER.CREATE.{stream}.{durable}.>", f"{API}.CONSUMER.DURABLE.CREATE.{stream}.{durable}",
            f"{API}.CONSUMER.MSG.NEXT.{stream}.{durable}", f"$JS.ACK.{stream}.{durable}.>"]


def _pulled_reader(stream: str) -> list[str]:
    """`reader.read_pulled`: ephemeral pull consumers (made unnamed, as `PulledReader` makes them), fetched from,
    deleted once read."""
    return [f"{API}.STREAM.INFO.{stream}", f"{API}.CONSUMER.CREATE.{stream}", f"{API}.CONSUMER.CREATE.{stream}.>",
            f"{API}.CONSUMER.INFO.{stream}.*",
            f"{API}.CONSUMER.MSG.NEXT.{stream}.*", f"{API}.CONSUMER.DELETE.{stream}.*"]


def _message_getter(stream: str) -> list[str]:
    """`js.get_msg`: the scheduler's pages of a job's logs and usage samples; a relay's and a follower's
    look at the stream they write and read, to tell whether JetStream lost history."""
    return [f"{API}.STREAM.MSG.GET.{stream}"]


def _owned(service: str) -> list[str]:
    return [rule for stream, owner in STREAM_OWNERS.items() if owner == service for rule in _manage(stream)]


# The names of the services' consumers and queue groups, for every site that names one. A stream follower is
# named after what it follows; the name is also its tracking row in the service's schema and the consumer its
# set-aside records and alerts name, so it never changes once used. The monitor's durable consumer on the log
# stream is the one NATS keeps by name (`service_permissions` lets only the monitor use it).


def events_consumer(upstream: str) -> str:
    """A service's follower of `upstream`'s events: `scheduler-events`, `launcher-events`, …"""
    return f"{upstream}-events"


SET_ASIDE_CONSUMER = "set-aside-events"  # the monitor's follower of every service's UpstreamMessageSetAside
AGENT_REPORTS_CONSUMER = "agent-reports"  # the launcher's follower of the agents' process reports
CACHE_REPORTS_CONSUMER = "cache-reports"  # the monitor's follower of the agents' dataset cache reports
MONITOR_LOGS_CONSUMER = "monitor-logs"  # the monitor's durable pull consumer on TRAINYARD_LOGS (M6)


def queue_group(name: str) -> str:
    """The queue group that shares what `name` takes: a service's requests (and the monitor's heartbeats), or the
    auth callout (`nats-auth`), which the scheduler and the monitor answer together."""
    return f"trainyard-{name}"


def reply_inboxes(answers: Sequence[str]) -> tuple[str, ...]:
    """The inboxes a service that answers `answers` publishes its replies (and progress) to: those of whoever
    may send it one of them."""
    found: list[str] = []
    if set(answers) & set(request_subjects()):
        found.append(USER_INBOXES)
    if set(answers) & {operation.subject for operation in sent_by("agent")}:
        found.append(AGENT_INBOXES)
    if AUTH_CALLOUT_SUBJECT in answers:
        found.append(CALLOUT_REPLIES)
    return tuple(found)


def service_permissions(service: str) -> Permissions:
    if service not in SERVICES:
        raise RoleError(f"unknown service {service!r}; one of {', '.join(SERVICES)}")
    publish = [subjects.events_of_service(service), *_owned(service), *_ordered_reader(subjects.EVENTS_STREAM),
               *_message_getter(subjects.EVENTS_STREAM)]
    answers: tuple[str, ...] = ()
    if service == "scheduler":
        answers = answered_subjects(service)
        publish += [*_message_getter(subjects.LOGS_STREAM), *_message_getter(subjects.USAGE_STREAM),
                    *_pulled_reader(subjects.EVENTS_STREAM)]  # its past states read the streams it follows
    elif service == "launcher":
        publish += [*asks_agents(service),
                    *_ordered_reader(subjects.AGENT_REPORTS_STREAM), *_message_getter(subjects.AGENT_REPORTS_STREAM)]
    elif service == "monitor":
        answers = (*answered_subjects(service), subjects.HEARTBEAT_ALL)
        publish += [*asks_agents(service),
                    subjects.ANNOUNCE_NODES,
                    *_durable_puller(subjects.LOGS_STREAM, MONITOR_LOGS_CONSUMER),
                    *_ordered_reader(subjects.CACHE_REPORTS_STREAM), *_message_getter(subjects.CACHE_REPORTS_STREAM),
                    *_pulled_reader(subjects.METRICS_STREAM)]
    else:
        answers = answered_subjects(service)
    if service in CALLOUT_SERVICES:
        answers = (*answers, AUTH_CALLOUT_SUBJECT)
    return Permissions(publish_allow=_unique([*publish, *reply_inboxes(answers)]),
                       subscribe_allow=(*answers, f"{inbox_prefix(service)}.>"))


def agent_permissions(node: str) -> Permissions:
    user = agent_user(node)
    publish = [
        *(operation.subject for operation in sent_by("agent")),  # registration
        subjects.heartbeat(node), subjects.agent_report(node), subjects.agent_cache(node),
        subjects.agent_logs(node),  # any job's log chunks, as its own node's
        subjects.agent_metrics(node),  # any job's metrics, as its own node's (R1)
        subjects.agent_usage(node),  # likewise any job's usage samples
        f"{API}.STREAM.INFO.{subjects.USAGE_STREAM}",  # js.key_value looks the bucket up
        subjects.session(node, "*", "*", "out"), subjects.session(node, "*", "*", "exit"),
        # Replies to the launcher and the monitor; an exec's answer and exit to the job whose remote shell asked.
        f"{inbox_prefix('launcher')}.>", f"{inbox_prefix('monitor')}.>", EXEC_INBOXES,
    ]
    return Permissions(publish_allow=tuple(publish),
                       subscribe_allow=(f"trainyard.agent.{node}.>", subjects.ANNOUNCE_NODES,
                                        f"{inbox_prefix(user)}.>"),
                       # Never the stream API beyond that lookup, whatever is allowed above.
                       publish_deny=(f"{API}.STREAM.CREATE.>", f"{API}.STREAM.UPDATE.>", f"{API}.STREAM.DELETE.>",
                                     f"{API}.STREAM.PURGE.>"))


def user_permissions(user: str) -> Permissions:
    """A person: commands and queries, and the debug sessions opened for them (`user` in their subjects)."""
    own = _checked("user", user)
    return Permissions(
        publish_allow=(*request_subjects(), subjects.session("*", own, "*", "in"),
                       subjects.session("*", own, "*", "control")),
        subscribe_allow=(subjects.session("*", own, "*", "out"), subjects.session("*", own, "*", "exit"),
                         f"{inbox_prefix(own)}.>"),
        publish_deny=("$JS.>", "$KV.>"),
        subscribe_deny=(subjects.EVENTS_ALL, subjects.LOGS_ALL, subjects.AGENT_REPORTS_ALL, subjects.CACHE_REPORTS_ALL,
                        subjects.METRICS_ALL),
    )


def job_permissions(job_id: str, nodes: Sequence[str]) -> Permissions:
    """A job's remote shell (MPI): exec requests to the agents of its own nodes, answers in its own inbox."""
    return Permissions(
        publish_allow=tuple(operation.subject_for(_checked("node", node)) for operation in sent_by("job")
                            for node in nodes),
        subscribe_allow=(f"{job_inbox(job_id)}.>",),
        publish_deny=("$JS.>", "$KV.>"),
    )


def roles(nodes: Sequence[str], users: Sequence[str] = ()) -> dict[str, Permissions]:
    """Every NATS user of a cluster and its permissions: the services, one agent per node, the users."""
    found: dict[str, Permissions] = {service: service_permissions(service) for service in SERVICES}
    for node in nodes:
        found[agent_user(node)] = agent_permissions(node)
    for user in users:
        if user in found:
            raise RoleError(f"user name {user!r} is taken by a service or a node agent")
        found[user] = user_permissions(user)
    return found


# --- nats-server configuration --------------------------------------------------------------------


@dataclass(frozen=True)
class NKey:
    """A user's public nkey (`U…`); the server then takes no password for it."""

    public_key: str


Credential = str | NKey  # a password, or `$NAME` for a variable the server reads from its environment

VARIABLE = re.compile(r"\$[A-Z][A-Z0-9_]*")


def _quoted(text: str) -> str:
    return json.dumps(text)  # a double-quoted string nats-server reads literally (`$JS…` included)


def _list(items: Sequence[str]) -> str:
    return "[" + ", ".join(_quoted(item) for item in items) + "]"


def _credential(credential: Credential) -> str:
    if isinstance(credential, NKey):
        return f"nkey: {_quoted(credential.public_key)}"
    if VARIABLE.fullmatch(credential):
        return f"password: {credential}"
    return f"password: {_quoted(credential)}"


def _permissions(p: Permissions) -> str:
    def half(allow: Sequence[str], deny: Sequence[str]) -> str:
        parts = [f"allow: {_list(allow)}"] + ([f"deny: {_list(deny)}"] if deny else [])
        return "{\n        " + ",\n        ".join(parts) + "\n      }"

    lines = [f"publish: {half(p.publish_allow, p.publish_deny)}",
             f"subscribe: {half(p.subscribe_allow, p.subscribe_deny)}"]
    return "{\n      " + "\n      ".join(lines) + "\n    }"


def render_config(nodes: Sequence[str], credentials: Mapping[str, Credential], users: Sequence[str] = (), *,
                  issuer: str | None = None) -> str:
    """A nats-server `authorization` block with one NATS user per service, node agent and user.

    `credentials` gives each NATS user (`roles(nodes, users)`'s keys) its password, `$VARIABLE` or nkey;
    a missing one is an error, so no user is left open. With an `issuer` (the auth callout's account
    public key, libs/natsauth.py) every other connection is handed to the callout, which admits node
    agents, people and jobs by their Trainyard token; the users listed here bypass it.
    """
    every = roles(nodes, users)
    missing = [name for name in every if name not in credentials]
    if missing:
        raise RoleError(f"no credential for {', '.join(missing)}")
    unknown = [name for name in credentials if name not in every]
    if unknown:
        raise RoleError(f"credentials for unknown users {', '.join(unknown)}")
    entries = [f"  {{\n    user: {_quoted(name)}, {_credential(credentials[name])}\n"
               f"    permissions: {_permissions(permissions)}\n  }}"
               for name, permissions in every.items()]
    callout = ""
    if issuer is not None:
        named = issuer if VARIABLE.fullmatch(issuer) else _quoted(issuer)
        callout = f" auth_callout {{\n  issuer: {named}\n  auth_users: {_list(list(every))}\n }}\n"
    return ("# Generated by libs/natsroles.py (python -m libs.natsroles CLUSTER.yaml [USER...]);\n"
            "# roles and what they may do: docs/security.md#roles-and-their-subjects.\n"
            "authorization {\n users = [\n" + "\n".join(entries) + "\n ]\n" + callout + "}\n")


# JetStream writes every acknowledged message to disk before it acknowledges it: the event history, the
# agents' reports and the logs survive a crash of the server's machine, not only of its process. What deploy/
# runs, beside a PostgreSQL that syncs its commits as well. The default syncs every two minutes; a message is
# still handed to the operating system before it is acknowledged (a single server's streams flush in place),
# so it survives a crash of nats-server itself: the durability of the local stack's PostgreSQL, which does not
# fsync either (docs/local-stack.md). docs/benchmarks.md measures what the sync costs.
DURABLE_JETSTREAM = "jetstream {\n sync_interval: always\n}\n"
DEVELOPMENT_JETSTREAM = "jetstream {\n}\n"


def callout_config(credentials: Mapping[str, Credential], issuer: str, *, sync_every_write: bool = True) -> str:
    """The configuration of a cluster whose services are static users and everyone else logs in with a
    token through the auth callout: what deploy/ runs (JetStream syncing every write) and, with
    `sync_every_write=False`, the local stack."""
    jetstream = DURABLE_JETSTREAM if sync_every_write else DEVELOPMENT_JETSTREAM
    return render_config((), credentials, (), issuer=issuer) + jetstream


def placeholder_credentials(nodes: Sequence[str] = (), users: Sequence[str] = ()) -> dict[str, Credential]:
    """`$<USER>_PASSWORD` for every NATS user, for a configuration whose secrets come from the environment."""
    return {name: "$" + re.sub(r"[^A-Z0-9]", "_", name.upper()) + "_PASSWORD" for name in roles(nodes, users)}


ISSUER_VARIABLE = "$TRAINYARD_NATS_ISSUER"


def _unique(items: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def main() -> None:
    """`python -m libs.natsroles`: the shipped configuration (deploy/nats/nats-server.conf), whose service
    passwords (`$SCHEDULER_PASSWORD`, …) and callout issuer (`$TRAINYARD_NATS_ISSUER`, the public key
    `python -m libs.natsauth` prints) the server reads from its environment."""
    print(callout_config(placeholder_credentials(), ISSUER_VARIABLE), end="")


if __name__ == "__main__":
    main()
