// The create-job page: rows added and removed in the list editors, the parts of the form that apply shown, the
// flavors filtered by board model, the cluster's resources for the chosen flavors, and the queue prediction kept
// up to date as the form changes. The server reads the form as a spec (action=check), exactly as it reads a
// submission, so the page and the submission never disagree on what the form says. User text: textContent only.
"use strict";
(function () {
  const CHECK_DELAY_MS = 400;
  let texts = {};

  // A page text with its {placeholders} filled in.
  function say(key, values) {
    let text = texts[key] || key;
    for (const [name, value] of Object.entries(values || {})) text = text.split("{" + name + "}").join(String(value));
    return text;
  }

  function element(tag, text, className) {
    return window.trainyard.element(tag, text, className);
  }

  // --- the list editors (datasets, tasks, …) -----------------------------------------------------------------------

  function rowEditors(form) {
    for (const button of form.querySelectorAll("[data-add]")) {
      button.hidden = false;
      button.addEventListener("click", () => addRow(form, button.dataset.add));
    }
    for (const button of form.querySelectorAll(".remove-row")) button.hidden = false;
    form.addEventListener("click", (event) => {
      const button = event.target.closest(".remove-row");
      if (!button) return;
      const table = button.closest("table");
      button.closest("tr.row").remove();
      table.dispatchEvent(new Event("change", { bubbles: true }));
    });
  }

  function addRow(form, kind) {
    const body = form.querySelector(`table[data-rows="${kind}"] tbody`);
    const template = form.querySelector(`template[data-row-template="${kind}"]`);
    let next = 0;
    for (const field of body.querySelectorAll("[name]")) {
      const index = /^[a-z_]+-(\d+)-/.exec(field.name);
      if (index) next = Math.max(next, Number(index[1]) + 1);
    }
    const row = template.content.firstElementChild.cloneNode(true);
    for (const field of row.querySelectorAll("[name]")) field.name = field.name.replace("__i__", String(next));
    for (const button of row.querySelectorAll(".remove-row")) button.hidden = false;
    body.append(row);
    row.querySelector("input")?.focus();
  }

  // --- the parts that apply: regular or batch, TensorFlow's parameter servers, the switched settings ---------------

  function parts(form) {
    const apply = () => {
      const type = form.querySelector('input[name="type"]:checked')?.value || "regular";
      for (const part of form.querySelectorAll("[data-for-type]")) part.hidden = part.dataset.forType !== type;
      const tensorflow = form.querySelector('[name="mode"]').value === "tensorflow";
      document.getElementById("parameter-servers-field").hidden = !tensorflow;
      document.getElementById("parameter-servers").disabled = !tensorflow;
      for (const box of form.querySelectorAll("input[data-shows]")) {
        document.getElementById(box.dataset.shows).hidden = !box.checked;
      }
    };
    form.addEventListener("change", apply);
    apply();
  }

  // --- 4.5: flavors filtered by type and board model ---------------------------------------------------------------

  function flavorFilter(form) {
    const filter = document.getElementById("flavor-filter");
    const boards = document.getElementById("board-models");
    filter.hidden = false;
    const apply = () => {
      const kind = filter.querySelector('input[name="flavor_kind"]:checked')?.value || "all";
      if (boards) boards.hidden = kind !== "boards";
      const chosen = [...document.querySelectorAll(".board-filter:checked")].map((box) => box.value);
      for (const item of document.querySelectorAll("#flavor-list li.flavor")) {
        const board = item.dataset.board;
        let shown = kind === "all" || (kind === "cpu" ? !board : Boolean(board));
        if (kind === "boards" && chosen.length) shown = chosen.includes(board);
        // A chosen flavor stays in sight whatever the filter, so that nothing is sent unseen.
        item.hidden = !shown && !item.querySelector('input[name="flavors"]').checked;
      }
    };
    filter.addEventListener("change", apply);
    boards?.addEventListener("change", apply);
    apply();
  }

  function chosenFlavors(form) {
    return [...form.querySelectorAll('input[name="flavors"]:checked')].map((box) => box.value);
  }

  // --- 4.0: the cluster's resources for the chosen flavors ---------------------------------------------------------

  function resources(form) {
    const link = document.getElementById("show-resources");
    const panel = document.getElementById("resources-panel");
    const body = document.getElementById("resources-body");
    link.addEventListener("click", async (event) => {
      event.preventDefault();
      const flavors = chosenFlavors(form);
      panel.hidden = false;
      if (!flavors.length) {
        body.replaceChildren(element("p", say("Choose one or more flavors first."), "empty"));
        return;
      }
      body.replaceChildren(element("p", say("Loading…")));
      try {
        const answer = await window.trainyard.api("get-resources", { flavors });
        body.replaceChildren(resourcesTable(answer.nodes));
        if (!answer.nodes.length) body.append(element("p", say("No schedulable node for these flavors."), "empty"));
      } catch (error) {
        body.replaceChildren(element("p", error.message, "error"));
      }
    });
  }

  const gib = (mib) => (mib / 1024).toFixed(1).replace(/\.0$/, "");
  const amount = (value) => String(Number(value));

  function resourcesTable(nodes) {
    const table = document.getElementById("resources-template").content.firstElementChild.cloneNode(true);
    const rows = table.querySelector("tbody");
    for (const node of nodes) {
      const row = document.createElement("tr");
      row.dataset.node = node.name;
      const cell = (text, className) => row.appendChild(element("td", text, className));
      cell(node.name);
      const status = cell();
      const fits = Object.entries(node.status);
      for (const [flavor, fit] of fits) {
        const told = say(fit === "idle" ? "Idle" : "Tight");
        status.append(element("span", fits.length > 1 ? `${flavor}: ${told}` : told, "fit " + fit));
      }
      cell(`${node.os} ${node.kernel}`.trim());
      cell(`${gib(node.memory_mib_used)}/${gib(node.memory_mib_total)}`, "number");
      cell(`${amount(node.cpus_used)}/${amount(node.cpus_total)}`, "number");
      cell(`${node.accelerators_used}/${node.accelerators_total}` + (node.board ? " " + node.board : ""), "number");
      cell(node.driver_version || "");
      cell((node.flavors || []).join(", "));
      const usage = cell();
      for (const use of node.usage || []) {
        usage.append(element("span", `${use.physical}(${use.virtual}):${use.application}`, "usage"));
      }
      rows.append(row);
    }
    return table;
  }

  // --- the form read as a spec: errors beside their fields, the prediction, the YAML -------------------------------

  function slotOf(field) {
    const head = String(field).split(/[.[]/)[0];
    return document.getElementById("error-" + head) ? head : "";
  }

  function errorLine(error) {
    const line = element("p");
    line.append(element("code", error.field), ": " + error.message);
    if (error.hint) line.append(" ", element("span", `(${error.hint})`, "hint"));
    return line;
  }

  // Shows `errors` in the slots `wanted` says, and empties the others it says; the rest are left as they are.
  function showErrors(errors, wanted) {
    const bySlot = new Map();
    for (const error of errors) {
      const slot = slotOf(error.field);
      if (!bySlot.has(slot)) bySlot.set(slot, []);
      bySlot.get(slot).push(error);
    }
    for (const box of document.querySelectorAll(".field-error[data-error-for]")) {
      const slot = box.dataset.errorFor;
      if (!wanted(slot, box)) continue;
      const found = bySlot.get(slot) || [];
      box.replaceChildren(...found.map(errorLine));
      box.hidden = !found.length;
    }
  }

  function when(iso) {
    const lang = document.documentElement.lang || undefined;
    return new Date(iso).toLocaleString(lang, { dateStyle: "short", timeStyle: "short" });
  }

  function predictionShown(text, reason, startsNow) {
    const shown = document.getElementById("prediction");
    shown.dataset.startsNow = startsNow ? "true" : "false";
    shown.classList.toggle("starts-now", startsNow);
    document.getElementById("prediction-text").textContent = text;
    document.getElementById("prediction-reason").textContent = reason || "";
  }

  function describe(prediction) {
    if (prediction.starts_now) {
      const where = [prediction.flavor, [...new Set(prediction.nodes)].join(", ")].filter(Boolean).join(" · ");
      predictionShown(say("Starts now"), where, true);
      return;
    }
    if (prediction.position === null || prediction.position === undefined) {
      predictionShown(say("Cannot start: {reason}", { reason: prediction.reason }), "", false);
      return;
    }
    const text = prediction.estimated_start
      ? say("Queues: position {position}, about {time}", { position: prediction.position,
                                                           time: when(prediction.estimated_start) })
      : say("Queues: position {position}", { position: prediction.position });
    const ahead = prediction.jobs_ahead ? say("{count} jobs ahead", { count: prediction.jobs_ahead }) : "";
    predictionShown(text, [ahead, prediction.reason].filter(Boolean).join(" · "), false);
  }

  function checking(form) {
    const yamlView = document.getElementById("yaml-view");
    const yamlText = document.getElementById("spec-yaml");
    const yamlButton = document.getElementById("show-yaml");
    const touched = new Set();
    let timer = null;
    let sequence = 0;
    let yamlEdited = false;
    let lastYaml = null;

    const showYaml = () => {
      if (lastYaml !== null && !yamlEdited) yamlText.value = lastYaml;
    };

    async function check() {
      const mine = ++sequence;
      const sent = new FormData(form);
      sent.delete("spec_file");
      sent.delete("spec_yaml");
      sent.set("action", "check");
      let checked;
      try {
        const response = await fetch("/jobs/new", { method: "POST", body: sent, credentials: "same-origin" });
        if (!response.ok) throw new Error(String(response.status));
        checked = await response.json();
      } catch (error) {
        if (mine === sequence) predictionShown(say("The prediction is not available"), error.message, false);
        return;
      }
      if (mine !== sequence) return;
      lastYaml = checked.yaml;
      showYaml();
      // The form's own problems: beside the fields the person changed, and where an error shows now.
      showErrors(checked.errors, (slot, box) => touched.has(slot) || !box.hidden);
      if (!checked.valid) {
        predictionShown(say("The prediction is not available: fix the fields marked above."), "", false);
        return;
      }
      predictionShown(say("Predicting…"), "", false);
      try {
        const answer = await window.trainyard.api("predict-job", { spec: checked.spec });
        if (mine === sequence) describe(answer.prediction);
      } catch (error) {
        if (mine !== sequence) return;
        const problem = error.problem || {};
        // What only the scheduler knows (this cluster's flavors, its images) is shown wherever it belongs.
        if (problem.errors) showErrors(problem.errors, (slot) => problem.errors.some((e) => slotOf(e.field) === slot));
        predictionShown(say("The prediction is not available"), problem.errors ? "" : error.message, false);
      }
    }

    const changed = (event) => {
      if (event.target === yamlText || event.target.type === "file" || event.target.name === "flavor_kind") return;
      const slot = event.target.closest?.("[data-slot]")?.dataset.slot;
      if (slot) touched.add(slot);
      clearTimeout(timer);
      timer = setTimeout(check, CHECK_DELAY_MS);
    };
    form.addEventListener("input", changed);
    form.addEventListener("change", changed);
    yamlText.addEventListener("input", () => { yamlEdited = true; });

    // With the script the YAML shows and hides in place, kept in step with the form.
    yamlButton.addEventListener("click", (event) => {
      event.preventDefault();
      yamlView.hidden = !yamlView.hidden;
      yamlButton.textContent = say(yamlView.hidden ? "YAML" : "Hide YAML");
      if (!yamlView.hidden) {
        yamlEdited = false;
        showYaml();
      }
    });
    check();
  }

  document.addEventListener("DOMContentLoaded", () => {
    const form = document.getElementById("create-form");
    if (!form || !window.trainyard) return;
    texts = JSON.parse(document.getElementById("page-texts")?.textContent || "{}");
    rowEditors(form);
    parts(form);
    flavorFilter(form);
    resources(form);
    checking(form);
  });
})();
