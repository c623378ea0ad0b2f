// The alerts page, live: each alert raised while the page is open is added on top of the table, from the
// gateway's follow stream (Server-Sent Events, event `alert`, data an event envelope of an AlertRaised). Where
// the stream is not served, the monitor is asked for new alerts (`list-alerts`) every few seconds instead.
// An alert's texts came from elsewhere: they are written with textContent only.
"use strict";
(function () {
  const POLL_MS = 5000;
  const PAGE = 200;

  document.addEventListener("DOMContentLoaded", () => {
    const table = document.getElementById("alerts");
    const ty = window.trainyard;
    if (!table || !ty) return;
    const body = table.tBodies[0];
    const state = document.getElementById("alerts-state");
    const texts = JSON.parse(document.getElementById("page-texts")?.textContent || "{}");
    const kinds = texts.kinds || {};
    const seen = new Set(Array.from(body.querySelectorAll("tr[data-event]"), (row) => row.dataset.event));
    // The table holds every alert up to this position of the monitor's log that it could show: the stream,
    // which starts from the first alert, adds only those after it.
    const shownUpTo = Number(table.dataset.after || "0") || 0;
    let after = shownUpTo;

    function say(key) {
      if (state) state.textContent = texts[key] || "";
    }

    // As the server writes a moment: YYYY-MM-DD HH:MM:SS of the instant as recorded (UTC).
    function moment(iso) {
      return typeof iso === "string" ? iso.replace("T", " ").slice(0, 19) : "";
    }

    function cell(content, className) {
      const td = ty.element("td", null, className);
      if (content instanceof Node) td.appendChild(content);
      else td.textContent = content;
      return td;
    }

    function row(envelope) {
      const alert = envelope.event;
      const tr = ty.element("tr", null, "alert " + String(alert.kind || ""));
      tr.dataset.event = String(envelope.event_id);
      tr.appendChild(cell(moment(envelope.recorded_at)));
      const kind = ty.element("span", kinds[alert.kind] || alert.kind, "alert-kind " + String(alert.kind || ""));
      tr.appendChild(cell(kind));
      if (alert.job_id) {
        const link = ty.element("a", alert.job_id);
        link.href = "/jobs/" + encodeURIComponent(alert.job_id);
        tr.appendChild(cell(link));
      } else {
        tr.appendChild(cell("–"));
      }
      tr.appendChild(cell(alert.node || "–"));
      const what = cell("", "wrap");
      what.appendChild(ty.element("strong", alert.title, "alert-title"));
      what.appendChild(document.createElement("br"));
      what.appendChild(ty.element("span", alert.message, "alert-message"));
      tr.appendChild(what);
      return tr;
    }

    function add(envelope) {
      const alert = envelope && envelope.event;
      if (!alert || alert.type !== "AlertRaised.v1" || seen.has(envelope.event_id)) return;
      if (typeof envelope.position === "number" && envelope.position <= shownUpTo) return;
      seen.add(envelope.event_id);
      if (typeof envelope.position === "number" && envelope.position > after) after = envelope.position;
      document.getElementById("no-alerts")?.remove();
      body.insertBefore(row(envelope), body.firstChild);
    }

    let polling = false;
    async function poll() {
      try {
        for (;;) {
          const page = await ty.api("list-alerts", { after: after, limit: PAGE });
          for (const envelope of page.alerts || []) add(envelope);
          after = Math.max(after, Number(page.next_after) || 0);
          if (!page.more) break;
        }
        say("polling");
      } catch (error) {
        say("unavailable");
      }
      window.setTimeout(poll, POLL_MS);
    }

    function startPolling() {
      if (polling) return;
      polling = true;
      poll();
    }

    if (typeof window.EventSource !== "function") {
      startPolling();
      return;
    }
    const source = new EventSource("/api/v1/follow/alerts");
    source.addEventListener("open", () => say("live"));
    source.addEventListener("alert", (event) => {
      try {
        add(JSON.parse(event.data));
      } catch (error) {
        // Not an envelope: nothing to show.
      }
    });
    source.addEventListener("error", (event) => {
      // The stream's own `error` event (a refusal while it streams, with its problem as data) ends it for good,
      // as does a refusal before it started (closed); otherwise the browser reconnects by itself.
      if (event.data || source.readyState === EventSource.CLOSED) {
        source.close();
        startPolling();
      } else {
        say("reconnecting");
      }
    });
  });
})();
