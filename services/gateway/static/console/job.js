// The job page while it is open: the status badge follows the job (Server-Sent Events, else asking again), the
// nodes' resource use is sampled into charts, the logs are read as they are written (every node with rank
// prefixes, or one), and the run's metrics are charted. Everything a job or its logs wrote is set with textContent.
"use strict";
(function () {
  const LIVE = new Set(["queued", "running"]);
  const USAGE_SECONDS = 5;
  const METRICS_SECONDS = 10;
  const STATUS_SECONDS = 3;
  const LOG_POLL_SECONDS = 2;
  const RETRY_SECONDS = 5;
  const MOST_LOG_LINES = 5000; // kept in the page; older lines are dropped from the view
  const MOST_USAGE_POINTS = 720; // an hour at one sample every 5 s
  const LOG_PAGE_CHUNKS = 200;
  const CHART_HEIGHT = 200;
  const COLOURS = ["#2459d6", "#c0362c", "#1f7a3d", "#a76b00", "#7a3db8", "#0f8a8a", "#b8407a", "#5f6b7a"];

  const sleep = (seconds) => new Promise((resolve) => setTimeout(resolve, seconds * 1000));

  document.addEventListener("DOMContentLoaded", () => {
    const root = document.getElementById("job");
    if (!root) return;
    const ty = window.trainyard;
    const pageTexts = JSON.parse(document.getElementById("page-texts")?.textContent || "{}");
    const say = (key) => (pageTexts.text && pageTexts.text[key]) || key;
    const jobId = root.dataset.job;
    const query = "job_id=" + encodeURIComponent(jobId);
    const job = { status: document.getElementById("job-status")?.dataset.status || "", instances: null };
    const renderedStatus = job.status; // what the page's operations and sections were made for
    const charts = [];

    // --- status ---------------------------------------------------------------------------------------------

    function showStatus(view) {
      job.status = view.status;
      if (view.status !== renderedStatus) {
        // What the person may do now, and what the page shows, depend on the status: the page is made again.
        window.location.reload();
        return;
      }
      const badge = document.getElementById("job-status");
      if (badge) {
        badge.textContent = (pageTexts.status && pageTexts.status[view.status]) || view.status;
        badge.className = "status " + view.status;
        badge.dataset.status = view.status;
      }
      const reason = document.getElementById("job-reason");
      if (reason) {
        reason.textContent = view.reason || "";
        reason.hidden = !view.reason;
      }
      if (Array.isArray(view.instances) && view.instances.length) showInstances(view.instances);
      const queue = document.getElementById("queue");
      if (queue && view.status !== "queued") queue.hidden = true;
      root.dataset.live = LIVE.has(view.status) ? "yes" : "no";
    }

    function roleOf(instance) {
      const role = instance.master ? "master" : instance.role || "worker";
      return (pageTexts.role && pageTexts.role[role]) || role;
    }

    function showInstances(instances) {
      job.instances = instances;
      const body = document.querySelector("#instances tbody");
      if (body) {
        const rows = instances.map((instance) => {
          const row = ty.element("tr");
          row.dataset.rank = String(instance.rank);
          row.dataset.node = instance.node;
          const state = (pageTexts.state && pageTexts.state[instance.state]) || instance.state;
          const exit = instance.exit_code === null || instance.exit_code === undefined ? "" : instance.exit_code;
          row.append(ty.element("td", instance.rank, "number"), ty.element("td", instance.node),
            ty.element("td", roleOf(instance)), ty.element("td", state, "state"), ty.element("td", exit, "number"),
            ty.element("td", "", "number cpu"), ty.element("td", "", "number memory"),
            ty.element("td", "", "number accelerator"));
          return row;
        });
        body.replaceChildren(...rows);
        showSamples(lastSamples);
      }
      addRankOptions(document.getElementById("log-rank"), instances, (i) => String(i.rank),
        (i) => say("Rank") + " " + i.rank + " · " + i.node);
      const terminalNode = document.getElementById("terminal-node");
      if (terminalNode) {
        addRankOptions(terminalNode, instances, (i) => i.node, (i) => say("Rank") + " " + i.rank + " · " + i.node);
        const open = document.getElementById("open-terminal");
        if (open) open.disabled = false;
        const waiting = document.getElementById("terminal-wait");
        if (waiting) waiting.hidden = true;
      }
    }

    function addRankOptions(select, instances, valueOf, labelOf) {
      if (!select) return;
      const present = new Set(Array.from(select.options, (option) => option.value));
      for (const instance of instances) {
        const value = valueOf(instance);
        if (present.has(value)) continue;
        const option = ty.element("option", labelOf(instance));
        option.value = value;
        select.append(option);
        present.add(value);
      }
    }

    async function askStatusAgain() {
      while (LIVE.has(job.status)) {
        await sleep(STATUS_SECONDS);
        try {
          showStatus((await ty.api("get-job", { job_id: jobId })).job);
        } catch (error) {
          await sleep(RETRY_SECONDS);
        }
      }
    }

    function followStatus() {
      if (!LIVE.has(job.status)) return;
      if (!window.EventSource) {
        askStatusAgain();
        return;
      }
      const source = new EventSource("/api/v1/follow/status?" + query);
      source.addEventListener("status", (event) => {
        showStatus(JSON.parse(event.data));
        if (!LIVE.has(job.status)) source.close();
      });
      source.addEventListener("end", () => source.close());
      source.addEventListener("error", (event) => {
        if (event.data !== undefined) {
          source.close(); // the stream's own refusal (a problem): asking again would be refused the same way
        } else if (source.readyState === EventSource.CLOSED && LIVE.has(job.status)) {
          askStatusAgain(); // refused before it began, or no stream here. Otherwise it reconnects by itself.
        }
      });
    }

    // --- charts ---------------------------------------------------------------------------------------------

    // A uPlot chart in `container` whose series (after x) are `labels`; remade when they change.
    function chart(container, timeAxis) {
      let plot = null;
      let shownLabels = "";
      // uPlot stretches a lone x value over a thousand days: show 60 (seconds or steps) either side of it instead.
      function narrow(data) {
        if (data[0].length === 1) plot.setScale("x", { min: data[0][0] - 60, max: data[0][0] + 60 });
      }
      const made = {
        update(labels, data) {
          if (!window.uPlot || !container) return;
          const key = JSON.stringify(labels) + timeAxis();
          if (plot && key === shownLabels) {
            plot.setData(data);
            narrow(data);
            return;
          }
          if (plot) plot.destroy();
          shownLabels = key;
          plot = new window.uPlot({
            width: Math.max(280, container.clientWidth || 480),
            height: CHART_HEIGHT,
            scales: { x: { time: timeAxis() } },
            series: [{ label: timeAxis() ? say("Time") : say("Step") },
              ...labels.map((label, index) => ({ label, stroke: COLOURS[index % COLOURS.length], spanGaps: true }))],
          }, data, container);
          narrow(data);
        },
        resize() {
          if (plot) plot.setSize({ width: Math.max(280, container.clientWidth || 480), height: CHART_HEIGHT });
        },
      };
      charts.push(made);
      return made;
    }

    window.addEventListener("resize", () => charts.forEach((made) => made.resize()));

    // Rows of (x, value per key) aligned on the union of their x values, for uPlot.
    function aligned(keys, valuesByKey) {
      const xs = Array.from(new Set(keys.flatMap((key) => Array.from(valuesByKey.get(key).keys()))))
        .sort((a, b) => a - b);
      return [xs, ...keys.map((key) => xs.map((x) => {
        const value = valuesByKey.get(key).get(x);
        return value === undefined ? null : value;
      }))];
    }

    // --- resource use ---------------------------------------------------------------------------------------

    const usage = { times: [], byRank: new Map(), nodes: new Map(), seen: new Map() };
    const cpuChart = chart(document.getElementById("usage-cpu"), () => true);
    const memoryChart = chart(document.getElementById("usage-memory"), () => true);
    let lastSamples = [];

    function showSamples(samples) {
      for (const sample of samples) {
        const row = document.querySelector('#instances tbody tr[data-rank="' + Number(sample.rank) + '"]');
        if (!row) continue;
        row.querySelector(".cpu").textContent = Number(sample.cpu_percent).toFixed(0) + "%";
        row.querySelector(".memory").textContent = String(sample.memory_mib);
        const accelerator = sample.accelerator_percent;
        row.querySelector(".accelerator").textContent =
          accelerator === null || accelerator === undefined ? "" : Number(accelerator).toFixed(0) + "%";
      }
    }

    function addSamples(samples) {
      lastSamples = samples;
      showSamples(samples);
      const fresh = samples.filter((sample) => usage.seen.get(sample.rank) !== sample.sampled_at);
      if (!fresh.length) return;
      document.getElementById("usage-charts")?.removeAttribute("hidden");
      const at = Math.max(...fresh.map((sample) => Date.parse(sample.sampled_at) / 1000));
      for (const sample of fresh) {
        usage.seen.set(sample.rank, sample.sampled_at);
        usage.nodes.set(sample.rank, sample.node);
        if (!usage.byRank.has(sample.rank)) usage.byRank.set(sample.rank, { cpu: new Map(), memory: new Map() });
        const series = usage.byRank.get(sample.rank);
        series.cpu.set(at, sample.cpu_percent);
        series.memory.set(at, sample.memory_mib);
      }
      usage.times.push(at);
      while (usage.times.length > MOST_USAGE_POINTS) {
        const oldest = usage.times.shift();
        for (const series of usage.byRank.values()) {
          series.cpu.delete(oldest);
          series.memory.delete(oldest);
        }
      }
      const ranks = Array.from(usage.byRank.keys()).sort((a, b) => a - b);
      const labels = ranks.map((rank) => "[" + rank + "] " + usage.nodes.get(rank));
      cpuChart.update(labels, aligned(ranks, new Map(ranks.map((rank) => [rank, usage.byRank.get(rank).cpu]))));
      memoryChart.update(labels, aligned(ranks,
        new Map(ranks.map((rank) => [rank, usage.byRank.get(rank).memory]))));
    }

    async function sampleUsage() {
      for (;;) {
        if (job.status !== "queued") {
          try {
            addSamples((await ty.api("job-usage", { job_id: jobId })).samples);
          } catch (error) {
            // Samples are kept only while a job runs; the next round asks again.
          }
        }
        if (!LIVE.has(job.status)) return;
        await sleep(USAGE_SECONDS);
      }
    }

    // --- logs -----------------------------------------------------------------------------------------------

    const logs = document.getElementById("logs");
    const logsState = document.getElementById("logs-state");
    const rankSelect = document.getElementById("log-rank");
    let reading = 0; // which reading of the logs is current: a change of node starts another
    let seenChunks = new Set();
    let ansiStates = new Map();
    let lineCount = 0;

    function tellLogs(text) {
      if (logsState) logsState.textContent = text;
    }

    function addChunk(chunk, merged) {
      const key = chunk.seq >= 0 ? [chunk.task || 0, chunk.attempt, chunk.rank, chunk.seq].join(".")
        : [chunk.attempt, chunk.rank, chunk.node, chunk.lines.join("\n")].join("\u0000");
      if (seenChunks.has(key)) return;
      seenChunks.add(key);
      const atEnd = logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 4;
      if (!ansiStates.has(chunk.rank)) ansiStates.set(chunk.rank, window.trainyardAnsi.newState());
      const state = ansiStates.get(chunk.rank);
      const fragment = document.createDocumentFragment();
      for (const line of chunk.lines) {
        const shown = ty.element("span", null, "line");
        if (merged) shown.append(ty.element("span", "[" + chunk.rank + "] ", "rank"));
        shown.append(window.trainyardAnsi.render(line, state), document.createTextNode("\n"));
        fragment.append(shown);
        lineCount += 1;
      }
      logs.append(fragment);
      if (lineCount > MOST_LOG_LINES) {
        let notice = logs.querySelector(".log-notice");
        if (!notice) {
          notice = ty.element("span", say("Lines before these are not shown.") + "\n", "log-notice");
          logs.prepend(notice);
        }
        while (lineCount > MOST_LOG_LINES && notice.nextSibling) {
          notice.nextSibling.remove();
          lineCount -= 1;
        }
      }
      if (atEnd) logs.scrollTop = logs.scrollHeight;
      if (lineCount) tellLogs("");
    }

    function problemText(data) {
      try {
        const problem = JSON.parse(data);
        return problem.detail || problem.title || "";
      } catch (error) {
        return "";
      }
    }

    function logsEnded(current) {
      if (current !== reading) return;
      tellLogs(lineCount ? say("The log has ended.") : say("No log lines yet"));
    }

    async function readLogPages(current, rank, merged) {
      let after = 0;
      while (current === reading) {
        const request = { job_id: jobId, after, max_chunks: LOG_PAGE_CHUNKS };
        if (rank !== "") request.rank = Number(rank);
        let page;
        try {
          page = await ty.api("job-logs", request);
        } catch (error) {
          if (current === reading) tellLogs(say("Could not read:") + " " + error.message);
          await sleep(RETRY_SECONDS);
          continue;
        }
        if (current !== reading) return;
        page.chunks.forEach((chunk) => addChunk(chunk, merged));
        after = page.next_after;
        if (page.more) continue;
        if (page.ended || !LIVE.has(job.status)) {
          logsEnded(current);
          return;
        }
        if (!lineCount) tellLogs(say("No log lines yet"));
        await sleep(LOG_POLL_SECONDS);
      }
    }

    function followLogs(rank) {
      reading += 1;
      const current = reading;
      const merged = rank === "";
      seenChunks = new Set();
      ansiStates = new Map();
      lineCount = 0;
      logs.replaceChildren();
      tellLogs("");
      if (!window.EventSource) {
        readLogPages(current, rank, merged);
        return;
      }
      const source = new EventSource("/api/v1/follow/logs?" + query + (merged ? "" : "&rank=" + Number(rank)));
      source.addEventListener("log", (event) => {
        if (current !== reading) {
          source.close();
          return;
        }
        addChunk(JSON.parse(event.data), merged);
      });
      source.addEventListener("end", () => {
        source.close();
        logsEnded(current);
      });
      source.addEventListener("error", (event) => {
        if (current !== reading) {
          source.close();
        } else if (event.data !== undefined) {
          source.close(); // the stream's own refusal, as a problem
          tellLogs(say("Could not read:") + " " + problemText(event.data));
        } else if (source.readyState === EventSource.CLOSED) {
          readLogPages(current, rank, merged); // no stream here: read the pages instead
        } else {
          tellLogs(ty.text("reconnecting…"));
        }
      });
      rankSelect?.addEventListener("change", () => source.close(), { once: true });
    }

    // --- metrics --------------------------------------------------------------------------------------------

    const metricsBox = document.getElementById("metrics");
    const metrics = new Map(); // name -> {ranks, across, after, points, chart, box}

    function pointOf(raw) {
      // SeriesPoint travels as an array: rank, step, value, at, task, attempt, process, seq, node.
      if (Array.isArray(raw)) {
        return { rank: raw[0], step: raw[1], value: raw[2], at: raw[3], process: raw[6], seq: raw[7] };
      }
      return raw;
    }

    function metricFor(name) {
      if (metrics.has(name)) return metrics.get(name);
      const figure = ty.element("figure", null, "metric");
      const caption = ty.element("figcaption");
      caption.append(ty.element("span", name, "metric-name"));
      const toggle = ty.element("label", null, "across");
      toggle.hidden = true;
      const box = ty.element("input");
      box.type = "checkbox";
      toggle.append(box, document.createTextNode(" " + say("Across ranks")));
      caption.append(toggle);
      const area = ty.element("div", null, "chart");
      figure.append(caption, area);
      metricsBox.append(figure);
      const metric = { name, ranks: new Set(), across: false, after: 0, points: new Map(), toggle, byStep: true };
      metric.chart = chart(area, () => !metric.byStep);
      box.addEventListener("change", () => {
        metric.across = box.checked;
        metric.after = 0;
        metric.points = new Map();
        readSeries(metric);
      });
      metrics.set(name, metric);
      return metric;
    }

    function drawMetric(metric) {
      const points = Array.from(metric.points.values());
      metric.byStep = points.every((point) => point.step !== null && point.step !== undefined);
      const byRank = new Map();
      for (const point of points) {
        if (!byRank.has(point.rank)) byRank.set(point.rank, new Map());
        byRank.get(point.rank).set(metric.byStep ? point.step : Date.parse(point.at) / 1000, point.value);
      }
      const ranks = Array.from(byRank.keys()).sort((a, b) => a - b);
      if (!ranks.length) return;
      metric.chart.update(ranks.map((rank) => say("Rank") + " " + rank), aligned(ranks, byRank));
    }

    async function readSeries(metric) {
      const asked = metric.across;
      const first = Math.min(...metric.ranks);
      for (;;) {
        const request = { job_id: jobId, name: metric.name, after: metric.after };
        if (!asked) request.rank = first;
        const page = await ty.api("get-series", request);
        if (asked !== metric.across) return;
        for (const raw of page.points) {
          const point = pointOf(raw);
          // A point an agent published twice (after a restart) has the same process and line number.
          const key = point.process ? point.process + ":" + point.seq
            : [point.rank, point.step, point.at, point.value].join(":");
          metric.points.set(key, point);
        }
        metric.after = page.next_after;
        if (!page.more) break;
      }
      drawMetric(metric);
    }

    function noMetrics(text) {
      if (!metrics.size) metricsBox.replaceChildren(ty.element("p", text, "hint"));
    }

    async function readMetrics() {
      let run;
      try {
        run = await ty.api("get-run", { job_id: jobId });
      } catch (error) {
        noMetrics(say("Could not read:") + " " + error.message);
        return;
      }
      if (!run.series.length) {
        noMetrics(say("No metrics yet"));
        return;
      }
      if (!metrics.size) metricsBox.replaceChildren();
      for (const series of run.series) {
        const metric = metricFor(series.name);
        metric.ranks.add(series.rank);
        metric.toggle.hidden = metric.ranks.size < 2;
      }
      for (const metric of metrics.values()) {
        try {
          await readSeries(metric);
        } catch (error) {
          // This series' page is asked for again next round.
        }
      }
    }

    async function chartMetrics() {
      for (;;) {
        const wasLive = LIVE.has(job.status);
        if (job.status === "queued") noMetrics(say("No metrics yet")); // a run begins with the job's first process
        else await readMetrics();
        if (!wasLive) return; // one round after the job ended, for its last points
        await sleep(METRICS_SECONDS);
      }
    }

    // --- debug terminal -------------------------------------------------------------------------------------

    // The terminal's button and node select belong to terminal.js; this page only fills the select.

    if (rankSelect) rankSelect.addEventListener("change", () => followLogs(rankSelect.value));
    if (logs && window.trainyardAnsi) followLogs(rankSelect ? rankSelect.value : "");
    if (metricsBox) chartMetrics();
    sampleUsage();
    followStatus();
  });
})();
