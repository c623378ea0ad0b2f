// The debug terminal (J15) of a job's page: xterm.js in the element #terminal (data-job, and data-node for a
// node other than the master's), joined to a shell in the job's environment over the gateway's WebSocket
// (services/gateway/terminal.py). The page loads /static/vendor/xterm/xterm.js (window.Terminal) and
// /static/vendor/xterm-addon-fit/addon-fit.js (window.FitAddon.FitAddon) before this file.
"use strict";
(function () {
  const MAX_FRAME_BYTES = 64 * 1024; // the gateway refuses larger frames: a long paste goes in pieces
  const RED = "\x1b[31m";
  const DIM = "\x1b[2m";
  const PLAIN = "\x1b[0m";

  // The page's texts in the reader's language when it has them (console.js); the English text is the key.
  function text(english) {
    const translate = window.trainyard && window.trainyard.text;
    return translate ? translate(english) : english;
  }

  function csrfToken() {
    const meta = document.querySelector('meta[name="csrf-token"]');
    return meta ? meta.content : "";
  }

  function socketAddress(job, node, columns, rows) {
    const query = new URLSearchParams({ columns: String(columns), rows: String(rows) });
    if (node) query.set("node", node);
    const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
    return scheme + "//" + window.location.host + "/console/jobs/" + encodeURIComponent(job) + "/terminal?" +
      query.toString();
  }

  // Output from the job is written as bytes: xterm decodes UTF-8, also across frames. What the gateway says
  // (an exit, a refusal) is written as plain lines after it.
  function note(terminal, line, colour) {
    terminal.write("\r\n" + colour + line.replace(/[\x00-\x1f\x7f]/g, " ") + PLAIN + "\r\n");
  }

  function start(element) {
    const job = element.dataset.job;
    if (!job || typeof window.Terminal !== "function" || !window.FitAddon) return;
    const terminal = new window.Terminal({ cursorBlink: true, scrollback: 5000 });
    const fit = new window.FitAddon.FitAddon();
    terminal.loadAddon(fit);
    terminal.open(element);
    fit.fit();

    const asked = { cols: terminal.cols, rows: terminal.rows }; // the size the session opens with
    const socket = new WebSocket(socketAddress(job, element.dataset.node, asked.cols, asked.rows));
    socket.binaryType = "arraybuffer";
    const encoder = new TextEncoder();
    let ready = false; // the CSRF token went first: keystrokes and sizes may follow
    let ended = false; // the gateway said how it ended: exit or refusal

    function sendBytes(bytes) {
      if (!ready || socket.readyState !== WebSocket.OPEN) return;
      for (let start = 0; start < bytes.length; start += MAX_FRAME_BYTES) {
        socket.send(bytes.subarray(start, start + MAX_FRAME_BYTES));
      }
    }

    socket.addEventListener("open", () => {
      socket.send(JSON.stringify({ csrf: csrfToken() }));
      ready = true;
      if (terminal.cols !== asked.cols || terminal.rows !== asked.rows) {
        socket.send(JSON.stringify({ resize: [terminal.cols, terminal.rows] })); // resized while it connected
      }
      terminal.focus();
    });
    socket.addEventListener("message", (event) => {
      if (typeof event.data !== "string") {
        terminal.write(new Uint8Array(event.data));
        return;
      }
      let said;
      try {
        said = JSON.parse(event.data);
      } catch (_) {
        return;
      }
      if (said && typeof said.exit === "number") {
        ended = true;
        note(terminal, text("The session ended with exit code") + " " + said.exit, DIM);
      } else if (said && said.error) {
        ended = true;
        note(terminal, String(said.error.message || said.error.code || ""), RED);
        if (said.error.hint) note(terminal, String(said.error.hint), DIM);
      }
    });
    socket.addEventListener("close", (event) => {
      ready = false;
      terminal.options.disableStdin = true;
      if (!ended) note(terminal, text("The connection to the terminal was closed") + " (" + event.code + ")", RED);
    });

    terminal.onData((typed) => sendBytes(encoder.encode(typed)));
    // Some mouse reports are bytes in a string, one character each: sent as they are, not as UTF-8.
    terminal.onBinary((typed) => sendBytes(Uint8Array.from(typed, (c) => c.charCodeAt(0) & 0xff)));
    terminal.onResize((size) => {
      if (ready && socket.readyState === WebSocket.OPEN) {
        socket.send(JSON.stringify({ resize: [size.cols, size.rows] }));
      }
    });

    let pending = false;
    function refit() {
      if (pending) return;
      pending = true;
      window.requestAnimationFrame(() => {
        pending = false;
        fit.fit(); // a new size reaches the session through onResize
      });
    }
    window.addEventListener("resize", refit);
    return function dispose() {
      ended = true;
      window.removeEventListener("resize", refit);
      socket.close();
      terminal.dispose();
    };
  }

  // On a job page the session opens when the person asks for it (the button), on the node chosen beside it;
  // each click opens a new one. A page with the terminal alone opens it at once.
  function startWhenThere() {
    const element = document.getElementById("terminal");
    if (!element) return;
    const button = document.getElementById("open-terminal");
    if (!button) {
      start(element);
      return;
    }
    let dispose = null; // the session opened last: a new click ends it first
    button.addEventListener("click", () => {
      if (dispose) dispose();
      const node = document.getElementById("terminal-node");
      if (node && node.value) element.dataset.node = node.value;
      element.replaceChildren();
      element.hidden = false;
      dispose = start(element);
    });
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", startWhenThere);
  } else {
    startWhenThere();
  }
})();
