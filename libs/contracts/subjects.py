"""Every NATS subject and JetStream stream name Trainyard uses (SPEC X2, X4).

Domain events are published on the `trainyard.events.>` tree for the services that follow them;
people send commands and queries (`trainyard.cmd.>`, `trainyard.query.>`) and read alerts with the
monitor's `ListAlerts`, never a stream. docs/architecture.md lists them all. Ids that appear in
subjects (job ids, node names) never contain `.`, `*` or `>`.
"""

from __future__ import annotations

from collections.abc import Sequence

# JetStream streams.
EVENTS_STREAM = "TRAINYARD_EVENTS"
AGENT_REPORTS_STREAM = "TRAINYARD_AGENT_REPORTS"
CACHE_REPORTS_STREAM = "TRAINYARD_CACHE_REPORTS"
LOGS_STREAM = "TRAINYARD_LOGS"

# Public domain events: trainyard.events.<service>.<aggregate type>.<EventName>. The aggregate's id is in the
# envelope, not in the subject: the subjects stay a few hundred however many jobs pass, where JetStream keeps an
# index entry per subject for as long as the stream holds a message on it (with an id in each subject its memory
# grew with every event, and its consumer requests slowed to seconds as the log reached a million events). One
# job's history is read by the stream sequences of its events, which the services note as they fold them.
EVENTS_ALL = "trainyard.events.>"


def event_subject(service: str, aggregate_type: str, event_name: str) -> str:
    return f"trainyard.events.{service}.{aggregate_type}.{event_name}"


# The events of one kind of aggregate that one append recorded, published together as one message (its body a JSON
# array of envelopes, in the order of the log): a follower takes each as if it came alone. A message costs the relay,
# nats-server and every follower far more than the few hundred bytes of an event (docs/benchmarks.md).
BUNDLE = "bundle"  # an event's name is its type's, capitalised: never this


def bundle_subject(service: str, aggregate_type: str) -> str:
    return event_subject(service, aggregate_type, BUNDLE)


def is_bundle(subject: str) -> bool:
    """Whether `subject` is where a bundle of events is published (`bundle_subject`)."""
    return subject.endswith(f".{BUNDLE}") and subject.startswith("trainyard.events.") and subject.count(".") == 4


def earlier_event_subject(service: str, aggregate_type: str, aggregate_id: str, event_name: str) -> str:
    """Where events were published before the aggregate id left the subject: a stream kept from then still holds
    them, and they are read as they were published."""
    return f"trainyard.events.{service}.{aggregate_type}.{aggregate_id}.{event_name}"


def earlier_events_of_job(job_id: str) -> str:
    """Every service's events about one job published while subjects named the aggregate (its id is the job's)."""
    return earlier_event_subject("*", "*", job_id, "*")


def events_of_service(service: str) -> str:
    return f"trainyard.events.{service}.>"


def events_of(service: str, *aggregate_types: str) -> tuple[str, ...]:
    """The subjects of `service`'s events about those kinds of aggregate. A follower that names the aggregates
    it reads is delivered their events only, new types of event among them included; events of the other
    aggregates, there now or added later, never reach it (NATS filters them out)."""
    return tuple(f"trainyard.events.{service}.{aggregate_type}.>" for aggregate_type in aggregate_types)


# Every service's records of upstream messages it set aside (UpstreamMessageSetAside), for the monitor.
SET_ASIDE_AGGREGATE = "upstream"  # aggregate id: events.set_aside_id(consumer, sequence)
SET_ASIDE_ALL = f"trainyard.events.*.{SET_ASIDE_AGGREGATE}.UpstreamMessageSetAside"


def service_of_events(subject: str | Sequence[str]) -> str | None:
    """The one service whose events `subject` (a filter such as `events_of_service`, or several such as
    `events_of`) names, if any."""
    found = {_service_of(one) for one in ([subject] if isinstance(subject, str) else subject)}
    return found.pop() if len(found) == 1 else None


def _service_of(subject: str) -> str | None:
    parts = subject.split(".")
    if len(parts) < 3 or parts[:2] != ["trainyard", "events"] or parts[2] in ("*", ">"):
        return None
    return parts[2]


# Commands and queries (core NATS request/reply) are declared with their requests and replies in the
# operation catalogue (libs/contracts/operations).

# M7: alerts as published (one AlertRaised per incident, then AlertMailed once mailed), for services;
# people read them with ListAlerts (operations.alerts.LIST_ALERTS).
ALERTS_ALL = "trainyard.events.monitor.alert.>"

# Node agents.
HEARTBEAT_ALL = "trainyard.nodes.heartbeat.*"
# The monitor asks agents to register again (agent.AnnounceNodes): at its start, and when it hears a node
# it does not know, so nodes come back after any loss of its history.
ANNOUNCE_NODES = "trainyard.nodes.announce"


def heartbeat(node: str) -> str:
    return f"trainyard.nodes.heartbeat.{node}"


def agent_start(node: str) -> str:
    return f"trainyard.agent.{node}.start"


def agent_starts(node: str) -> str:
    return f"trainyard.agent.{node}.starts"


def agent_stop(node: str) -> str:
    return f"trainyard.agent.{node}.stop"


def agent_ports(node: str) -> str:
    """Rendezvous ports chosen on the node (ReservePorts), asked by the launcher before it plans a launch."""
    return f"trainyard.agent.{node}.ports"


def agent_exec(node: str) -> str:
    return f"trainyard.agent.{node}.exec"


def agent_precheck(node: str) -> str:
    return f"trainyard.agent.{node}.precheck"


def agent_stage(node: str) -> str:
    """D2: the monitor asks a node to copy a dataset into its cache (a preload)."""
    return f"trainyard.agent.{node}.stage"


def agent_release(node: str) -> str:
    return f"trainyard.agent.{node}.release"


def agent_open_session(node: str) -> str:
    return f"trainyard.agent.{node}.session.open"


def session(node: str, owner: str, session_id: str, channel: str) -> str:
    """One debug session's channel: `in`, `out`, `control` or `exit` (see agent.OpenSession). `owner` is the
    NATS user of the person who opened it: NATS lets only that user type into it or read it."""
    return f"trainyard.agent.{node}.session.{owner}.{session_id}.{channel}"


AGENT_REPORTS_ALL = "trainyard.agent-reports.>"


def agent_report(node: str) -> str:
    return f"trainyard.agent-reports.{node}"


# D1, D2: each node's dataset cache, reported whole by its agent whenever it changes (CacheReport).
CACHE_REPORTS_ALL = "trainyard.agent-cache.>"


def agent_cache(node: str) -> str:
    return f"trainyard.agent-cache.{node}"


# Log chunks: trainyard.logs.<job>.<rank>.<node>, published by the node's agent (LogChunk).
LOGS_ALL = "trainyard.logs.>"
# R1, R2: the metrics a job's processes log into its run, as their nodes' agents publish them (MetricBatch).
METRICS_STREAM = "TRAINYARD_METRICS"
METRICS_ALL = "trainyard.metrics.>"


def job_metrics(job_id: str, node: str) -> str:
    """What `node`'s agent publishes of the job's run: NATS lets an agent publish only its own node's."""
    return f"trainyard.metrics.{job_id}.{node}"


def metrics_of_job(job_id: str) -> str:
    return f"trainyard.metrics.{job_id}.*"


def agent_metrics(node: str) -> str:
    return f"trainyard.metrics.*.{node}"

# Key-value bucket with each running node's latest resource usage (key: <job>.<attempt>.<rank>.<node>).
USAGE_BUCKET = "trainyard-usage"


def usage_key(job_id: str, attempt: int, rank: int, node: str) -> str:
    """The key of a rank's usage sample: it ends with the node whose agent wrote it (NATS lets an agent write
    only its own node's keys)."""
    return f"{job_id}.{attempt}.{rank}.{node}"


def agent_usage(node: str) -> str:
    """Every usage key `node`'s agent may write, as subjects of the bucket's stream."""
    return f"$KV.{USAGE_BUCKET}.*.*.*.{node}"


# The stream behind the bucket, and the subjects of one job's keys in it (nats-py's KV naming).
USAGE_STREAM = f"KV_{USAGE_BUCKET}"


def usage_of_job(job_id: str) -> str:
    return f"$KV.{USAGE_BUCKET}.{job_id}.>"


def job_logs(job_id: str, rank: int | str = "*") -> str:
    """The subjects of a job's log chunks (of one rank, or of all), whichever node published them."""
    return f"trainyard.logs.{job_id}.{rank}.*"


def node_logs(job_id: str, rank: int, node: str) -> str:
    """Where `node`'s agent publishes a rank's log chunks: NATS lets an agent publish only its own node's."""
    return f"trainyard.logs.{job_id}.{rank}.{node}"


def agent_logs(node: str) -> str:
    return f"trainyard.logs.*.*.{node}"


# --- the node a subject of an agent's message names (bound to its sender by NATS) -----------------------

# Per prefix, how many tokens such a subject has and which of them is the node.
_SENDER_TOKEN: dict[str, tuple[int, int]] = {
    "trainyard.agent-reports.": (3, 2),
    "trainyard.agent-cache.": (3, 2),
    "trainyard.nodes.heartbeat.": (4, 3),
    "trainyard.logs.": (5, 4),
    "trainyard.metrics.": (4, 3),
    f"$KV.{USAGE_BUCKET}.": (6, 5),
}


def sender_of(subject: str) -> str | None:
    """The node an agent's report, cache report, heartbeat, log chunk, metrics or usage sample was published
    for, read from its subject (NATS permits an agent only its own node's); None for any other subject."""
    for prefix, (length, index) in _SENDER_TOKEN.items():
        if subject.startswith(prefix):
            parts = subject.split(".")
            return parts[index] if len(parts) == length else None
    return None


def sender_refusal(subject: str, node: str) -> str | None:
    """Why a message naming `node` cannot have come from that node's agent, having been published on
    `subject`; None when it can. A message of another node's is a forgery, never to be applied."""
    sender = sender_of(subject)
    if sender is None:
        return f"published on {subject}, which names no node"
    if sender != node:
        return f"published by node {sender} on {subject} but it names node {node}"
    return None
