// A log line's ANSI colours as elements: SGR codes 30–37 and 90–97 (foreground), 1 (bold), 22 (bold off), 39 (the
// default foreground) and 0 (reset) become <span class="ansi-fg-N ansi-bold"> runs whose text is set with
// textContent; every other escape sequence and control character is dropped. The text never becomes markup.
"use strict";
(function () {
  // CSI (ESC [ … final), OSC (ESC ] … BEL or ESC \), DCS/SOS/PM/APC strings, other ESC sequences, C0 and C1 controls
  // but the tab.
  const ESCAPES = new RegExp([
    "\\x1b\\[([0-9;:<=>?]*)[\\x20-\\x2f]*([\\x40-\\x7e])",
    "\\x1b\\][^\\x07\\x1b]*(?:\\x07|\\x1b\\\\)?",
    "\\x1b[PX^_][^\\x1b]*(?:\\x1b\\\\)?",
    "\\x1b[\\x20-\\x2f]*[\\x30-\\x7e]?",
    "[\\x00-\\x08\\x0a-\\x1a\\x1c-\\x1f\\x7f-\\x9f]",
  ].join("|"), "g");

  function newState() {
    return { fg: null, bold: false };
  }

  function isForeground(code) {
    return (code >= 30 && code <= 37) || (code >= 90 && code <= 97);
  }

  // One SGR sequence's parameters applied to `state`; colours of 256 or 16 million are skipped whole.
  function applySgr(state, text) {
    const params = text === "" ? [""] : text.split(";");
    for (let i = 0; i < params.length; i++) {
      const param = params[i];
      if (param.includes(":")) continue; // a colon form (38:5:n): an extended colour, not shown
      const code = param === "" ? 0 : Number(param);
      if (code === 0) {
        state.fg = null;
        state.bold = false;
      } else if (code === 1) {
        state.bold = true;
      } else if (code === 22) {
        state.bold = false;
      } else if (code === 39) {
        state.fg = null;
      } else if (isForeground(code)) {
        state.fg = code;
      } else if (code === 38 || code === 48 || code === 58) {
        if (params[i + 1] === "5") i += 2;
        else if (params[i + 1] === "2") i += 4;
      }
    }
  }

  function run(text, state) {
    if (state.fg === null && !state.bold) return document.createTextNode(text);
    const span = document.createElement("span");
    const classes = [];
    if (state.fg !== null) classes.push("ansi-fg-" + state.fg);
    if (state.bold) classes.push("ansi-bold");
    span.className = classes.join(" ");
    span.textContent = text;
    return span;
  }

  // The nodes of one segment of a line, `state` carried on (it continues onto the stream's next line).
  function segment(text, state, into) {
    let at = 0;
    ESCAPES.lastIndex = 0;
    for (let match = ESCAPES.exec(text); match !== null; match = ESCAPES.exec(text)) {
      if (match.index > at && into) into.appendChild(run(text.slice(at, match.index), state));
      if (match[2] === "m") applySgr(state, match[1]);
      at = ESCAPES.lastIndex;
    }
    if (at < text.length && into) into.appendChild(run(text.slice(at), state));
  }

  // A line as a fragment of text nodes and spans. What a carriage return overwrote (a progress bar's earlier
  // states) is left out; its colour changes still count.
  function render(line, state) {
    const fragment = document.createDocumentFragment();
    const parts = String(line).replace(/\r+$/, "").split("\r");
    for (let i = 0; i < parts.length - 1; i++) segment(parts[i], state, null);
    segment(parts[parts.length - 1], state, fragment);
    return fragment;
  }

  window.trainyardAnsi = { newState, render };
})();
