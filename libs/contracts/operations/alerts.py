"""The monitor's alerts, read page by page (SPEC M7).

Each operation is declared below its request and reply (`base.Operation`).
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from libs.contracts.events import EventEnvelope
from libs.contracts.operations.base import ReplyMessage, RequestMessage, people_operation

MAX_ALERT_PAGE = 1000
MAX_ALERT_PAGE_BYTES = 512 * 1024  # well under NATS's default max payload, like a log page


class ListAlerts(RequestMessage, frozen=True, tag="ListAlerts.v1"):
    """M7: alerts the caller may see, oldest first, raised after position `after` (0: from the first).

    `after` is a position in the monitor's event log: asking again with the reply's `next_after` goes on
    where the page ended. The monitor looks at no more than `limit` alerts per page and sends about
    `MAX_ALERT_PAGE_BYTES` of them at most, so a page of someone who may see few alerts can be short, even
    empty, while `more` says there are more to look at. Answered by the monitor.
    """

    after: Annotated[int, Meta(ge=0)] = 0
    limit: Annotated[int, Meta(ge=1, le=MAX_ALERT_PAGE)] = 200


class AlertPage(ReplyMessage, frozen=True, tag="AlertPage.v1"):
    """A page of `ListAlerts`: envelopes whose event is an `AlertRaised`, oldest first, and where the next
    page starts (`next_after`); `more` is false once the page reached the newest alert."""

    alerts: list[EventEnvelope]
    next_after: int
    more: bool


# --- operations ------------------------------------------------------------------------------------

LIST_ALERTS = people_operation(
    "list-alerts", "trainyard.query.alerts", ListAlerts, AlertPage, "monitor", changes_state=False,
    summary="A page of the monitor's alerts.")
