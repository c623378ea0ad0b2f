// A one-time sign-in link (`/signin#code=…`): the code is in the fragment, which the browser never sends to a
// server; it is posted once, then dropped from the address bar and the history.
"use strict";
document.addEventListener("DOMContentLoaded", async () => {
  const match = /^#code=([A-Za-z0-9_-]{1,128})$/.exec(window.location.hash);
  if (!match) return;
  history.replaceState(null, "", window.location.pathname);
  const response = await fetch("/signin/link", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ code: match[1] }),
    credentials: "same-origin",
  });
  const answer = await response.json();
  if (response.ok) {
    window.location.assign(answer.next);
    return;
  }
  const shown = document.getElementById("link-error");
  shown.textContent = answer.error;
  shown.hidden = false;
});
