// The dashboard's page: the view the path names (/, /jobs/ID, /hosts), drawn with DOM calls only
// (textContent, never HTML from data), fed by server-sent events. No inline script or style: the
// CSP is default-src 'self'.
(() => {
"use strict";

const { makeChart, fmtNum } = window.distrunCharts;
const main = document.getElementById("main");
const MAX_SHOWN_LINES = 2000;

function el(name, attrs, ...children) {
  const node = document.createElement(name);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "text") node.textContent = value;
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children) if (child !== null && child !== undefined) node.append(child);
  return node;
}

function table(label, columns) {
  const head = el("tr");
  for (const [name, numeric] of columns) head.append(el("th", { scope: "col", class: numeric ? "num" : null, text: name }));
  const body = el("tbody");
  return { element: el("table", { "aria-label": label }, el("thead", {}, head), body), body };
}

function cell(value, numeric, cls) {
  return el("td", { class: [numeric ? "num" : "", cls || ""].join(" ").trim() || null },
            value instanceof Node ? value : document.createTextNode(value === null || value === undefined ? "—" : String(value)));
}

// Writes only what changed: a page following a job is updated every second, and rewriting equal
// text still costs the browser a style, layout and paint pass.
function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

function setCell(td, value, numeric, cls) {
  setText(td, value === null || value === undefined ? "—" : String(value));
  const name = [numeric ? "num" : "", cls || ""].join(" ").trim();
  if (td.className !== name) td.className = name;
}

function when(seconds) {
  return seconds ? new Date(seconds * 1000).toLocaleString() : "—";
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  const s = Math.round(seconds);
  return s >= 3600 ? `${Math.floor(s / 3600)}h${String(Math.floor(s / 60) % 60).padStart(2, "0")}m`
       : s >= 60 ? `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s` : `${s}s`;
}

function stepOf(item) {
  return item.total_steps ? `${item.step}/${item.total_steps}` : String(item.step ?? "—");
}

function rankName(rank) {
  return rank === -1 ? "server" : rank === -2 ? "evaluator" : `rank ${rank}`;
}

async function post(url) {
  const answer = await fetch(url, { method: "POST", credentials: "same-origin" });
  const body = await answer.json().catch(() => ({}));
  if (!answer.ok) throw new Error(body.error || `${answer.status} ${answer.statusText}`);
  return body;
}

// -- the jobs page

function jobsView() {
  document.title = "jobs · distrun";
  const status = el("p", { class: "dim", role: "status", text: "connecting…" });
  const jobs = table("jobs", [["recipe"], ["job"], ["state"], ["step", true], ["loss", true], ["samples/s", true],
                              ["strategy"], ["layout"], ["replicas", true], ["hosts"], ["started"], ["wall", true], ["why"],
                              ["cluster"]]);
  main.replaceChildren(el("h1", { text: "Jobs" }), status, jobs.element);
  const source = new EventSource("/api/jobs/events");
  source.onmessage = (message) => {
    const data = JSON.parse(message.data);
    document.getElementById("where").textContent = data.cluster;
    const notes = [];
    if (data.error) notes.push(data.error);
    const failed = (data.clusters || []).filter((cluster) => cluster.error);
    for (const cluster of failed) notes.push(`${cluster.name}: ${cluster.error}`);
    if (data.unreachable && data.unreachable.length) notes.push(`not listed: ${data.unreachable.join("; ")}`);
    const counts = (data.clusters || []).filter((cluster) => !cluster.error)
      .map((cluster) => `${cluster.name}: ${cluster.jobs}`).join(", ");
    status.textContent = `${data.jobs.length} job(s), newest first${counts ? ` (${counts})` : ""}`
      + (notes.length ? ` · ${notes.join(" · ")}` : "");
    status.className = data.error || failed.length ? "error" : "dim";
    jobs.body.replaceChildren(...data.jobs.map((job) => el("tr", { "data-job": job.job },
      cell(el("a", { href: `/jobs/${encodeURIComponent(job.job)}`, text: job.recipe })),
      cell(job.job, false, "dim"),
      cell(job.attempts > 1 ? `${job.state} (attempt ${job.attempts})` : job.state, false, `state-${job.state}`),
      cell(stepOf(job), true), cell(fmtNum(job.loss), true), cell(fmtNum(job.samples_per_s), true),
      cell(job.strategy), cell(job.layout || "—"), cell(job.world_now ? `${job.world_now} of ${job.world_size}` : job.world_size, true),
      cell(`${job.hosts.length}: ${job.hosts.join(", ")}`), cell(when(job.started_at)), cell(duration(job.elapsed_s), true),
      cell(job.why || "", false, "why"), cell(job.cluster, false, "cluster"))));
  };
  source.onerror = () => { status.textContent = "reconnecting…"; };
}

// -- a job's page

function jobView(jobId) {
  document.title = `${jobId} · distrun`;
  const title = el("h1", { text: jobId });
  const state = el("p", { role: "status", id: "job-state", text: "connecting…" });
  const stacksButton = el("button", { type: "button", text: "Stacks" });
  const cancelButton = el("button", { type: "button", class: "danger", text: "Cancel" });
  const facts = el("dl", { class: "summary" });
  const ranks = table("ranks", [["rank", true], ["host"], ["device"], ["step", true], ["loss", true], ["samples/s", true],
                                ["memory MB", true], ["peak MB", true], ["compute ms", true], ["wait", true],
                                ["GPU %", true], ["status"]]);
  const charts = [makeChart("loss", "loss"), makeChart("samples/s", "samples_per_s"), makeChart("lr", "lr")];
  const chartGrid = el("div", { class: "charts" }, ...charts.map((chart) => chart.element));
  const evalCharts = new Map();  // metric -> chart, made when an evaluation first names it
  let evals = [];
  const stacksOut = el("section", { class: "stacks", "aria-label": "stacks", hidden: true });
  const timeline = el("ol", { class: "timeline", "aria-label": "events" });
  const rankFilter = el("select", { "aria-label": "rank filter" }, el("option", { value: "", text: "all ranks" }));
  const textFilter = el("input", { type: "search", "aria-label": "text filter", placeholder: "filter lines" });
  const follow = el("input", { type: "checkbox", checked: true, id: "follow" });
  const logs = el("pre", { class: "logs", role: "log", "aria-label": "logs" });
  main.replaceChildren(
    title, state, el("div", { class: "actions" }, stacksButton, cancelButton), facts,
    el("h2", { text: "Ranks" }), ranks.element,
    el("h2", { text: "Charts" }), chartGrid,
    stacksOut,
    el("h2", { text: "Events" }), timeline,
    el("h2", { text: "Logs" }),
    el("div", { class: "logbar" }, rankFilter, textFilter, el("label", {}, follow, " follow")),
    logs);

  let points = [];
  let lines = [];
  const knownRanks = new Set();
  const rowNodes = new Map();  // rank -> { tr, cells }: the rank table's rows, updated in place
  const factNodes = new Map();  // name -> its <dd>
  let factNames = "";

  function shown(line) {
    if (rankFilter.value !== "" && String(line.rank) !== rankFilter.value) return false;
    const needle = textFilter.value.toLowerCase();
    return !needle || line.line.toLowerCase().includes(needle);
  }

  function lineNode(line) {
    const where = line.rank < 0 ? rankName(line.rank) : `${line.host ? line.host + " " : ""}rank ${line.rank}`;
    return el("div", { class: line.stream === "stderr" ? "err" : null },
              el("span", { class: "rank", text: `[${where}] ` }), document.createTextNode(line.line));
  }

  function redrawLogs() {
    logs.replaceChildren(...lines.filter(shown).slice(-MAX_SHOWN_LINES).map(lineNode));
    if (follow.checked) logs.scrollTop = logs.scrollHeight;
  }

  function addRank(rank) {
    if (knownRanks.has(rank)) return;
    knownRanks.add(rank);
    const options = [...knownRanks].sort((a, b) => a - b).map((r) => el("option", { value: String(r), text: rankName(r) }));
    const chosen = rankFilter.value;
    rankFilter.replaceChildren(el("option", { value: "", text: "all ranks" }), ...options);
    rankFilter.value = chosen;
  }

  function showHead(head) {
    setText(title, head.recipe ? `${head.recipe} · ${head.strategy}` : jobId);
    const named = `${head.recipe || jobId} · distrun`;
    if (document.title !== named) document.title = named;
    const ended = head.ended;
    const attempt = head.attempts > 1 ? ` (attempt ${head.attempts})` : "";
    setText(state, `${head.state}${attempt}${head.reason ? ": " + head.reason : ""}`);
    if (state.className !== `state-${head.state}`) state.className = `state-${head.state}`;
    cancelButton.disabled = ended;
    stacksButton.disabled = ended;
    if (head.cluster) setText(document.getElementById("where"), head.cluster);
    const items = [["cluster", head.cluster || "—"], ["job", jobId], ["step", stepOf(head)], ["loss", fmtNum(head.loss)],
                   ["samples/s", fmtNum(head.samples_per_s)], ["elapsed", duration(head.elapsed_s)],
                   ["hosts", (head.hosts || []).join(", ") || "—"]];
    for (const [name, value] of Object.entries(head.eval_metrics || {})) items.push([`eval ${name}`, fmtNum(value)]);
    if (head.straggler) items.push(["straggler", head.straggler.replace(/^straggler: /, "")]);  // the live view's line
    const names = items.map(([name]) => name).join("\n");
    if (names !== factNames) {  // a new eval metric: the list is made again, else only its values change
      factNames = names;
      factNodes.clear();
      facts.replaceChildren(...items.map(([name]) => {
        const value = el("dd");
        factNodes.set(name, value);
        return el("div", {}, el("dt", { text: name }), value);
      }));
    }
    for (const [name, value] of items) setText(factNodes.get(name), value);
  }

  function showRows(rows) {
    const now = new Set();
    rows.forEach((row, index) => {
      addRank(row.rank);
      now.add(row.rank);
      let known = rowNodes.get(row.rank);
      if (!known) {
        const cells = Array.from({ length: 12 }, () => el("td"));
        known = { tr: el("tr", { "data-rank": row.rank }, ...cells), cells };
        rowNodes.set(row.rank, known);
      }
      [[row.rank, true], [row.host], [row.device], [row.step, true], [fmtNum(row.loss), true],
       [fmtNum(row.samples_per_s), true], [row.mem_mb, true], [row.peak_mem_mb, true],
       [row.compute_ms === null ? "—" : fmtNum(row.compute_ms), true],
       [row.wait_pct === null || row.wait_pct === undefined ? "—" : `${row.wait_pct.toFixed(0)}%`, true],
       [row.gpu_util === null || row.gpu_util === undefined ? "—" : `${row.gpu_util.toFixed(0)}%`, true],
       [row.slow ? `${row.status}, slow ${row.slow.toFixed(2)}x` : row.status, false, row.slow ? "slow" : null]]
        .forEach(([value, numeric, cls], i) => setCell(known.cells[i], value, numeric, cls));
      if (ranks.body.children[index] !== known.tr) ranks.body.insertBefore(known.tr, ranks.body.children[index] || null);
    });
    for (const [rank, known] of rowNodes) {
      if (!now.has(rank)) {
        known.tr.remove();
        rowNodes.delete(rank);
      }
    }
  }

  // What the events brought since the page was last drawn. The page is drawn in an animation
  // frame: updates that arrive together are drawn once, and a hidden tab (no frames) draws
  // nothing until it is shown again, then draws the latest.
  const dirty = { charts: false, evals: false, rows: null, head: null, events: [], lines: [], reset: false };
  let frame = 0;

  function draw() {
    frame = 0;
    if (dirty.charts) charts.forEach((chart) => chart.draw(points));
    if (dirty.evals) {
      for (const name of new Set(evals.flatMap((point) => Object.keys(point).filter((key) => key !== "step")))) {
        if (!evalCharts.has(name)) {
          const chart = makeChart(`eval ${name}`, name);
          evalCharts.set(name, chart);
          chartGrid.append(chart.element);
        }
      }
      evalCharts.forEach((chart) => chart.draw(evals));
    }
    if (dirty.rows) showRows(dirty.rows);
    if (dirty.reset) timeline.replaceChildren();
    for (const event of dirty.events) {
      const at = new Date(event.time * 1000).toLocaleTimeString();
      timeline.append(el("li", { class: `event-${event.kind}` }, el("span", { class: "dim", text: `${at} ` }),
                         document.createTextNode(event.text)));
    }
    if (dirty.reset) redrawLogs();
    else if (dirty.lines.length) {
      for (const line of dirty.lines.filter(shown).slice(-MAX_SHOWN_LINES)) logs.append(lineNode(line));
      while (logs.childElementCount > MAX_SHOWN_LINES) logs.firstChild.remove();
      if (follow.checked) logs.scrollTop = logs.scrollHeight;
    }
    if (dirty.head) showHead(dirty.head);
    Object.assign(dirty, { charts: false, evals: false, rows: null, head: null, events: [], lines: [], reset: false });
  }

  const source = new EventSource(`/api/jobs/${encodeURIComponent(jobId)}/events`);
  source.onmessage = (message) => {
    const update = JSON.parse(message.data);
    if (update.reset) {
      points = [];
      lines = [];
      evals = [];
      Object.assign(dirty, { charts: true, evals: true, events: [], lines: [], reset: true });
    }
    points = points.concat(update.points);
    dirty.charts = dirty.charts || update.points.length > 0;
    if (update.rows) dirty.rows = update.rows;
    if (update.evals.length) {
      evals = evals.concat(update.evals);
      dirty.evals = true;
    }
    dirty.events.push(...update.events);
    if (update.lines.length) {
      lines = lines.concat(update.lines);
      update.lines.forEach((line) => addRank(line.rank));
      if (!dirty.reset) dirty.lines.push(...update.lines);
    }
    dirty.head = update.head;
    if (!frame) frame = requestAnimationFrame(draw);
    if (update.head.ended) source.close();  // a finished job's page stays as it is
  };
  source.onerror = () => { if (source.readyState !== EventSource.CLOSED) state.textContent = "reconnecting…"; };
  rankFilter.addEventListener("change", redrawLogs);
  textFilter.addEventListener("input", redrawLogs);

  stacksButton.addEventListener("click", async () => {
    stacksButton.disabled = true;
    stacksOut.hidden = false;
    stacksOut.replaceChildren(el("h2", { text: "Stacks" }), el("p", { class: "dim", text: "asking every rank…" }));
    try {
      const found = await post(`/api/jobs/${encodeURIComponent(jobId)}/stacks`);
      stacksOut.replaceChildren(el("h2", { text: "Stacks" }), ...found.stacks.map((stack) => el("article", {},
        el("h3", { text: `rank ${stack.rank} · ${stack.host} · pid ${stack.pid}` }),
        stack.error ? el("p", { class: "error", text: stack.error })
          : el("ol", {}, ...stack.frames.map((frame) => el("li", { class: frame.user ? "user" : null,
              text: `${frame.function} (${frame.file}:${frame.line})` }))))));
    } catch (error) {
      stacksOut.replaceChildren(el("h2", { text: "Stacks" }), el("p", { class: "error", text: String(error.message) }));
    } finally {
      stacksButton.disabled = false;
    }
  });

  cancelButton.addEventListener("click", async () => {
    if (!window.confirm(`Cancel ${jobId} on every host?`)) return;
    cancelButton.disabled = true;
    state.textContent = "cancelling…";
    try {
      await post(`/api/jobs/${encodeURIComponent(jobId)}/cancel`);
    } catch (error) {
      state.textContent = `cancel failed: ${error.message}`;
      cancelButton.disabled = false;
    }
  });
}

// -- the hosts page

function hostsView() {
  document.title = "hosts · distrun";
  const status = el("p", { class: "dim", role: "status", text: "asking every server…" });
  const hosts = table("hosts", [["host"], ["roles"], ["status"], ["version"], ["environment"], ["devices"], ["cpus", true], ["load", true],
                                ["memory free"], ["jobs", true], ["uptime", true], ["round trip ms", true], ["message"],
                                ["cluster"], ["GPUs"], ["use over time"]]);
  main.replaceChildren(el("h1", { text: "Hosts" }), status, hosts.element);
  const gib = (bytes) => (bytes / 2 ** 30).toFixed(1);
  // Each GPU's utilisation (a meter) and memory, as the host's server read them through NVML;
  // none: why (NVML not found, or found no device); an older server that does not say: a dash.
  function gpuPanel(host, s) {
    if (!s || (!s.gpus && !s.gpu_note)) return "—";
    const gpus = s.gpus || [];
    if (!gpus.length) return el("span", { class: "dim", text: `no GPU (${s.gpu_note})` });
    return el("ul", { class: "gpus", "aria-label": `GPUs of ${host}` }, ...gpus.map((gpu) => el("li", {},
      el("span", { text: `${gpu.index} ${gpu.name} ` }),
      el("meter", { min: 0, max: 100, value: gpu.util_pct, "aria-label": `GPU ${gpu.index} utilisation` }),
      el("span", { text: ` ${gpu.util_pct.toFixed(0)}% · ${gib(gpu.memory_used_bytes)} / ${gib(gpu.memory_total_bytes)} GiB` }))),
      s.gpu_note ? el("li", { class: "error", text: s.gpu_note }) : null);
  }
  // CPU, memory and GPU use over the dashboard's samples of this host (the dashboard keeps the
  // last hour, whether or not a page was open): small charts named "cpu % of HOST", ... A line
  // breaks where the host did not answer, or where no sample came for 90 s (3 of the sampler's
  // periods: its cluster did not answer at all).
  const clock = (seconds) => new Date(seconds * 1000).toLocaleTimeString();
  function useCharts(row) {
    const history = row.history || [];
    if (!history.length) return "—";
    const figures = [["cpu %", "cpu_pct"], ["memory %", "memory_pct"], ["GPU %", "gpu_util_pct"], ["GPU memory %", "gpu_memory_pct"]]
      .filter(([, key]) => history.some((sample) => sample[key] !== null))
      .map(([name, key]) => {
        const chart = makeChart(`${name} of ${row.host}`, key, { x: "time", xText: clock, range: [0, 100], small: true, gap: 90 });
        chart.draw(history);
        return chart.element;
      });
    return el("div", { class: "use" }, ...figures);
  }
  // The jobs running on a host, each a link to its page, as its server's status names them.
  function jobsOn(s) {
    if (!s) return null;
    const here = s.running_jobs || [];
    if (!here.length) return String(s.jobs_running);
    return el("span", { class: "jobs-here" }, `${s.jobs_running}: `, ...here.flatMap((job, i) => [
      i ? ", " : null, el("a", { href: `/jobs/${encodeURIComponent(job.job)}`, text: job.recipe })]));
  }
  async function refresh() {
    try {
      const answer = await fetch("/api/hosts", { credentials: "same-origin" });
      const report = await answer.json();
      if (!answer.ok) throw new Error(report.error || answer.statusText);
      document.getElementById("where").textContent = report.cluster;
      status.textContent = `${report.hosts.length} host(s), as \`distrun status\` sees them`;
      hosts.body.replaceChildren(...report.hosts.map((row) => {
        const s = row.server;
        return el("tr", {}, cell(row.host), cell(row.roles.join(", ")), cell(row.status, false, `state-${row.status}`),
          cell(s ? s.version : null), cell(s ? `${s.environment ? "env " + s.environment : "host python"} · Python ${s.python}` : null),
          cell(s ? (s.gpu_count ? `${s.gpu_count} GPU: ${s.gpu_names.join(", ")}` : "CPU") : null),
          cell(s ? s.cpu_count : null, true), cell(s ? s.load_1m.toFixed(2) : null, true),
          cell(s ? `${gib(s.memory_available_bytes)} / ${gib(s.memory_total_bytes)} GiB` : null),
          cell(jobsOn(s), true), cell(s ? duration(s.uptime_s) : null, true),
          cell(row.rtt_ms === null ? null : row.rtt_ms.toFixed(1), true), cell(row.message || "", false, "why"),
          cell(row.cluster), cell(gpuPanel(row.host, s), false, "gpus"), cell(useCharts(row), false, "use"));
      }));
    } catch (error) {
      status.textContent = String(error.message);
      status.className = "error";
    }
  }
  refresh();
  window.setInterval(refresh, 5000);
}

const path = window.location.pathname;
if (path.startsWith("/jobs/")) jobView(decodeURIComponent(path.slice("/jobs/".length)));
else if (path === "/hosts") hostsView();
else jobsView();
})();
