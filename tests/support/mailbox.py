"""A real SMTP server for tests of alert mail (M7): aiosmtpd on a free local port, keeping every mail."""

from __future__ import annotations

import socket

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, Envelope, Session


class Mailbox:
    def __init__(self) -> None:
        self.messages: list[Envelope] = []
        with socket.socket() as probe:  # a free port (the controller's own readiness check needs a real one)
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.controller = Controller(self, hostname="127.0.0.1", port=port)

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        self.messages.append(envelope)
        return "250 OK"

    @property
    def url(self) -> str:
        return f"smtp://127.0.0.1:{self.controller.port}"
