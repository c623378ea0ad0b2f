"""Alert mail (M7): every alert raised and not yet mailed is sent, then AlertMailed is recorded.

What is still to send is rebuilt from the log at start, so an alert raised just before a crash is
mailed after it. A send that fails is retried with a growing delay. The message id is the alert id,
so a mail sent again (a crash between sending and recording) can be recognised by mail clients.

Each send is a client span `monitor mail` in the trace of the alert's raising, with the SMTP server and the
alert (and its job) as attributes; a failed send marks it an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from email.message import EmailMessage
from urllib.parse import unquote, urlsplit

import aiosmtplib
from opentelemetry.trace import SpanKind

from libs.contracts.events import AlertRaised
from libs.telemetry.logs import get_logger
from libs.telemetry.tracing import context_from_headers, span_failed, tracer
from services.monitor.state import PendingMail

log = get_logger(__name__)
span_tracer = tracer("trainyard.monitor")
FIRST_RETRY_SECONDS = 1.0
MAX_RETRY_SECONDS = 300.0


@dataclass(frozen=True)
class SmtpServer:
    hostname: str
    port: int
    use_tls: bool
    username: str | None = None
    password: str | None = None

    @classmethod
    def from_url(cls, url: str) -> SmtpServer:
        """`smtp://[user:password@]host[:port]` (STARTTLS when offered) or `smtps://...` (TLS)."""
        parts = urlsplit(url)
        if parts.scheme not in ("smtp", "smtps") or not parts.hostname:
            raise ValueError(f"TRAINYARD_SMTP_URL {url!r} is not like smtp://host:port")
        tls = parts.scheme == "smtps"
        return cls(hostname=parts.hostname, port=parts.port or (465 if tls else 25), use_tls=tls,
                   username=unquote(parts.username) if parts.username else None,
                   password=unquote(parts.password) if parts.password else None)


def compose(alert: AlertRaised, sender: str) -> EmailMessage:
    message = EmailMessage()
    message["From"] = sender
    message["To"] = ", ".join(alert.recipients)
    message["Subject"] = f"[Trainyard] {alert.title}"
    message["Message-ID"] = f"<{alert.alert_id}@trainyard>"
    facts = [f"Alert: {alert.alert_id} ({alert.kind})"]
    if alert.job_id:
        facts.append(f"Job: {alert.job_id}")
    if alert.node:
        facts.append(f"Node: {alert.node}")
    message.set_content(alert.message + "\n\n" + "\n".join(facts) + "\n")
    return message


class Mailer:
    """Sends pending alerts one by one; `wake()` when a new one was raised."""

    def __init__(self, smtp_url: str | None, sender: str, pending: Callable[[], list[PendingMail]],
                 mailed: Callable[[AlertRaised], Awaitable[None]]) -> None:
        self.server = SmtpServer.from_url(smtp_url) if smtp_url else None
        self.sender = sender
        self.pending = pending
        self.mailed = mailed
        self._wake = asyncio.Event()
        self._retry: dict[str, tuple[float, float]] = {}  # alert id -> (next try, delay), in memory

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        if self.server is None:
            log.info("alerts.mail_off", reason="TRAINYARD_SMTP_URL is not set; alerts are published on NATS only")
            return
        while True:
            self._wake.clear()
            for item in self.pending():
                if self._due(item.alert.alert_id):
                    await self._send(self.server, item)
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel that
            # arrives together with the wake, and the service would not stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._seconds_to_next_retry()):
                    await self._wake.wait()

    def _due(self, alert_id: str) -> bool:
        retry = self._retry.get(alert_id)
        return retry is None or retry[0] <= time.monotonic()

    def _seconds_to_next_retry(self) -> float:
        now = time.monotonic()
        return max(0.05, min([5.0, *(at - now for at, _ in self._retry.values())]))

    async def _send(self, server: SmtpServer, item: PendingMail) -> None:
        alert = item.alert
        attributes: dict[str, str | int] = {"server.address": server.hostname, "server.port": server.port,
                                            "trainyard.alert.id": alert.alert_id, "trainyard.alert.kind": alert.kind}
        if alert.job_id:
            attributes["trainyard.job.id"] = alert.job_id
        with span_tracer.start_as_current_span("monitor mail", context=context_from_headers(item.trace),
                                               kind=SpanKind.CLIENT, attributes=attributes) as span:
            try:
                await aiosmtplib.send(compose(alert, self.sender), hostname=server.hostname, port=server.port,
                                      use_tls=server.use_tls, username=server.username, password=server.password,
                                      timeout=30)
            except (aiosmtplib.SMTPException, OSError) as exc:
                span.record_exception(exc)
                span_failed(span, type(exc).__qualname__, str(exc)[:200])
                _, delay = self._retry.get(alert.alert_id, (0.0, FIRST_RETRY_SECONDS / 2))
                delay = min(delay * 2, MAX_RETRY_SECONDS)
                self._retry[alert.alert_id] = (time.monotonic() + delay, delay)
                log.warning("alert.mail_failed", alert_id=alert.alert_id, job_id=alert.job_id, node=alert.node,
                            error=str(exc), retry_seconds=delay)
                return
            self._retry.pop(alert.alert_id, None)
            await self.mailed(alert)
            log.info("alert.mailed", alert_id=alert.alert_id, job_id=alert.job_id, node=alert.node,
                     recipients=alert.recipients)
