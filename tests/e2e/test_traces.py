"""A job's trace as a collector gets it: the whole stack exports its spans over OTLP/HTTP to a real receiver
(tests/support/otlp.py), and the spans of one job make one tree from its submit to its end, named and
described as OpenTelemetry's messaging conventions say for NATS."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from client.api import TrainyardClient
from devstack.harness import CLUSTER
from libs.contracts.events import EventEnvelope
from tests.support.otlp import OtlpReceiver, ReceivedSpan
from tests.support.specs import sleeper
from tests.support.stack import Stack

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.e2e]

TEST_ALGORITHMS = Path(__file__).parent / "algorithms"
NODES = ("node-a", "node-b")
SCHEDULER, LAUNCHER, MONITOR = "trainyard-scheduler", "trainyard-launcher", "trainyard-monitor"
# What a span that handles or sends a NATS message says about it.
MESSAGING = ("messaging.system", "messaging.destination.name", "messaging.operation.name",
             "messaging.operation.type")
RANK_START = "start rank"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


@pytest_asyncio.fixture(loop_scope="session")
async def stack(tmp_path: Path, database_url: str, receiver: OtlpReceiver) -> AsyncIterator[Stack]:
    """The whole stack as the e2e tests' own fixture starts it, every process exporting its spans to `receiver`."""
    tmp_path.chmod(0o755)
    platform = Stack(tmp_path, None, database_url, connect=TrainyardClient.open, cluster=CLUSTER,
                     algorithms=TEST_ALGORITHMS,
                     env={"TRAINYARD_TRACES": "otlp", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
                          "OTEL_BSP_SCHEDULE_DELAY": "200"})
    yield platform
    await platform.close()
    print(platform.dump_logs())  # shown by pytest only when the test failed


def traceparent(envelope: EventEnvelope) -> tuple[str, str]:
    """The trace id and span id of the span that recorded `envelope`."""
    _, trace_id, span_id, _ = envelope.trace["traceparent"].split("-")
    return trace_id, span_id


def is_agent(span: ReceivedSpan) -> bool:
    return span.service.startswith("trainyard-agent")


def broken_links(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    """The spans whose parent was not received."""
    ids = {span.span_id for span in spans}
    return [span for span in spans if span.parent_span_id and span.parent_span_id not in ids]


def ancestors(span: ReceivedSpan, by_id: dict[str, ReceivedSpan]) -> Iterator[ReceivedSpan]:
    while (parent := by_id.get(span.parent_span_id)) is not None:
        yield parent
        span = parent


def follows_the_messaging_conventions(span: ReceivedSpan) -> bool:
    """`messaging.system=nats`, the destination and the operation, and the name `<operation> <destination>`
    (its template when the destination names a job or a node)."""
    attributes = span.attributes
    if any(not attributes.get(key) for key in MESSAGING) or attributes["messaging.system"] != "nats":
        return False
    destination = attributes.get("messaging.destination.template") or attributes["messaging.destination.name"]
    return span.name == f"{attributes['messaging.operation.name']} {destination}"


def described(spans: list[ReceivedSpan]) -> str:
    return "\n".join(f"{s.service} {s.kind} {s.name!r} {s.span_id}<-{s.parent_span_id or 'root'} {s.attributes}"
                     for s in spans)


async def test_the_spans_of_a_job_arrive_as_one_trace_from_submit_to_end(stack: Stack,
                                                                       receiver: OtlpReceiver) -> None:
    api = await stack.up()
    accepted = await api.submit(sleeper("traced", nodes=2, seconds=0.2))
    job_id = accepted.job_id
    job = await stack.wait_until(job_id, "ended", timeout=90)
    assert job.status == "succeeded", job.reason
    events = await api.history(job_id)
    untraced = [type(e.event).name() for e in events if "traceparent" not in e.trace]
    assert untraced == [], f"events recorded outside any trace: {untraced}"
    history = {type(e.event).name(): e for e in events}
    trace_id, submit_span = traceparent(history["JobSubmitted"])
    recorders = {traceparent(e)[1] for e in events}

    def arrived() -> bool:
        spans = receiver.trace(trace_id)
        ids = {span.span_id for span in spans}
        services = {span.service for span in spans}
        return ({SCHEDULER, LAUNCHER, MONITOR} <= services and any(map(is_agent, spans))
                and sum(span.name == RANK_START for span in spans) >= len(NODES)
                and recorders <= ids and not broken_links(spans))

    # Spans are exported in batches as they end, a parent after its children: wait until the tree is whole (what
    # is missing after that, the assertions below name).
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(120):
            while not arrived():
                await asyncio.sleep(0.1)
    spans = receiver.trace(trace_id)
    by_id = {span.span_id: span for span in spans}
    assert receiver.refused == []
    assert spans, f"nothing of trace {trace_id} arrived; spans received: {len(receiver.spans())}"

    # One trace: every span about the job is in it (but the queries people made about it, traces of their own),
    # and every event of the job's history was recorded in a span of it, from its submit to its end.
    elsewhere = [s for s in receiver.spans() if s.attributes.get("trainyard.job.id") == job_id
                 and s.trace_id != trace_id
                 and not str(s.attributes.get("messaging.destination.name", "")).startswith("trainyard.query.")]
    assert elsewhere == [], described(elsewhere)
    for envelope in events:
        name = type(envelope.event).name()
        assert traceparent(envelope)[0] == trace_id, name
        assert traceparent(envelope)[1] in by_id, f"the span that recorded {name} did not arrive"

    # A tree: no parent missing, one root, and that root the scheduler's answer to the submit.
    assert broken_links(spans) == [], described(broken_links(spans))
    roots = [span for span in spans if span.is_root]
    assert [(r.service, r.span_id) for r in roots] == [(SCHEDULER, submit_span)], described(roots)
    [root] = roots
    assert root.kind == "SERVER" and follows_the_messaging_conventions(root), described(roots)
    assert root.attributes["messaging.destination.name"] == "trainyard.cmd.jobs.submit"

    # Every process that worked for the job is in it: the scheduler, the launcher, the monitor and both agents.
    assert {SCHEDULER, LAUNCHER, MONITOR} <= {span.service for span in spans}
    assert {span.attributes.get("trainyard.node") for span in spans if is_agent(span)} == set(NODES)

    # Each rank's start once, on its node, under the start request the launcher sent for that rank.
    starts = sorted((span for span in spans if span.name == RANK_START), key=lambda s: s.attributes["trainyard.rank"])
    assert [(s.attributes["trainyard.rank"], s.attributes["trainyard.job.id"]) for s in starts] == [
        (0, job_id), (1, job_id)], described(starts)
    assert {s.attributes["trainyard.node"] for s in starts} == set(NODES)
    for start in starts:
        assert is_agent(start) and start.status != "ERROR", described([start])
        [request] = [a for a in ancestors(start, by_id) if a.name == "process trainyard.agent.{node}.starts"]
        assert request.kind == "SERVER" and request.attributes["trainyard.node"] == start.attributes["trainyard.node"]
        sent = [a for a in ancestors(start, by_id)
                if a.service == LAUNCHER and a.name == "send trainyard.agent.{node}.starts"]
        assert [(s.kind, s.attributes["trainyard.rank"], s.attributes["trainyard.node"]) for s in sent] == [
            ("CLIENT", start.attributes["trainyard.rank"], start.attributes["trainyard.node"])], described(sent)
        assert request.parent_span_id == sent[0].span_id  # the agent's span continues the launcher's request

    # Every message handled or sent is described as OpenTelemetry's messaging conventions say for NATS: the
    # requests answered (SERVER), the events reacted to (CONSUMER) and the requests sent (CLIENT, PRODUCER).
    messaging = [s for s in spans if s.kind in ("SERVER", "CONSUMER", "PRODUCER")
                 or (s.kind == "CLIENT" and s.name.startswith("send "))]
    unconventional = [s for s in messaging if not follows_the_messaging_conventions(s)]
    assert unconventional == [], described(unconventional)
    assert {s.attributes["messaging.destination.name"] for s in spans if is_agent(s) and s.kind == "SERVER"} >= {
        f"trainyard.agent.{node}.starts" for node in NODES}
    # The reactions that carried the job to its end handled a message each: the launcher's to its agents'
    # reports, the scheduler's to the launcher's outcome.
    for name in ("NodeProcessStarted", "NodeProcessExited", "LaunchSucceeded", "JobSucceeded"):
        recorder = by_id[traceparent(history[name])[1]]
        assert recorder.kind == "CONSUMER", f"{name} was recorded in {described([recorder])}"

    # Names stay few: no job id or node name in any of them (they are attributes).
    named = [s for s in spans if job_id in s.name or any(node in s.name for node in NODES)]
    assert named == [], described(named)
