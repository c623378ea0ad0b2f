// What every console page shares: its texts in the reader's language, the session's CSRF token, and asking the
// HTTP API as the signed-in person. Whatever came from a user is written with textContent, never as markup.
"use strict";
(function () {
  const texts = JSON.parse(document.getElementById("texts")?.textContent || "{}");
  const csrf = document.querySelector('meta[name="csrf-token"]')?.content || "";

  async function api(operation, body) {
    const response = await fetch("/api/v1/" + operation, {
      method: "POST",
      headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
      body: JSON.stringify(body || {}),
      credentials: "same-origin",
    });
    const answer = await response.json();
    if (!response.ok) {
      const error = new Error(answer.detail || answer.title || String(response.status));
      error.problem = answer;
      throw error;
    }
    return answer;
  }

  function element(tag, text, className) {
    const made = document.createElement(tag);
    if (text !== undefined && text !== null) made.textContent = String(text);
    if (className) made.className = className;
    return made;
  }

  window.trainyard = { text: (key) => texts[key] || key, csrf, api, element };

  document.addEventListener("DOMContentLoaded", () => {
    const all = document.getElementById("select-all");
    if (all) {
      all.addEventListener("change", () => {
        for (const box of document.querySelectorAll('#jobs tbody input[name="job_id"]:not(:disabled)')) {
          box.checked = all.checked;
        }
      });
    }
    // An open row menu closes when another opens or the page is clicked elsewhere.
    document.addEventListener("click", (event) => {
      for (const menu of document.querySelectorAll("details.menu[open]")) {
        if (!menu.contains(event.target)) menu.open = false;
      }
    });
  });
})();
