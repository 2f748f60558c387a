// The dashboard's page logic: poll the JSON routes every few seconds and redraw. Charts are uPlot.
"use strict";

const icefloe = (() => {
  const API = "/api/v2/databases/icefloe/schemas/icefloe/icefloe"; // the service answers any names here
  const POLL_MS = 2000;
  // Charted first, in this order; any other metric (client-reported ones) follows by name.
  const PREFERRED = ["loss", "reward", "grad_norm", "lr", "step_time_s", "tokens_per_s", "policy_version"];
  const NOT_CHARTED = new Set(["step", "time"]);
  const COLORS = ["#2563eb", "#16a34a", "#dc2626", "#9333ea", "#ea580c", "#0891b2", "#4d7c0f", "#be185d"];

  let csrfToken = null; // the session's, sent with every change the page makes (see /ui/api/session)

  async function getJson(url, options = {}) {
    const headers = { ...(options.headers || {}), ...(csrfToken ? { "X-CSRF-Token": csrfToken } : {}) };
    const response = await fetch(url, { credentials: "same-origin", ...options, headers });
    if (response.status === 401) {
      location.href = "/ui/login";
      throw new Error("signed out");
    }
    const body = await response.json();
    if (!response.ok) throw new Error(body.message || `${url}: HTTP ${response.status}`);
    return body;
  }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "class") node.className = value;
      else if (key.startsWith("data-")) node.setAttribute(key, value);
      else node[key] = value;
    }
    for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
    return node;
  }

  function num(value, digits = 4) {
    if (value === undefined || value === null) return "–";
    if (Math.abs(value) >= 1000) return value.toFixed(0);
    return Number(value.toPrecision(digits)).toString();
  }

  function tick(value) { // an axis label: short, and never "0" for a small nonzero value
    if (value === 0) return "0";
    const size = Math.abs(value);
    return size < 1e-3 || size >= 1e5 ? value.toExponential(1) : String(Number(value.toPrecision(3)));
  }

  function age(iso) {
    const seconds = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
    if (seconds < 90) return `${seconds.toFixed(0)} s`;
    if (seconds < 5400) return `${(seconds / 60).toFixed(0)} min`;
    if (seconds < 172800) return `${(seconds / 3600).toFixed(1)} h`;
    return `${(seconds / 86400).toFixed(1)} d`;
  }

  function fill(tbody, rows) { // an empty table says so in one muted row
    const columns = tbody.parentElement.querySelectorAll("th").length;
    tbody.replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { class: "muted", colSpan: columns }, "(none)"))]));
  }

  function status(text) {
    return el("span", { class: `status status-${text}` }, text);
  }

  function showError(error) {
    const box = document.getElementById("error");
    box.hidden = !error;
    box.textContent = error ? `Update failed: ${error.message}` : "";
  }

  // The header's "signed in as" and its logout button (hidden when the service has no auth).
  async function signedIn() {
    const session = await getJson("/ui/api/session");
    csrfToken = session.csrf_token;
    document.getElementById("who").textContent = session.tenant;
    const button = document.getElementById("logout");
    button.hidden = !csrfToken;
    button.onclick = async () => {
      await fetch("/ui/logout", { method: "POST", credentials: "same-origin", headers: { "X-CSRF-Token": csrfToken } });
      location.href = "/ui/login";
    };
  }

  function poll(update) {
    const tick = async () => {
      try {
        await update();
        showError(null);
      } catch (error) {
        showError(error);
      }
      setTimeout(tick, POLL_MS);
    };
    tick();
  }

  function summaryCells(job) {
    return [
      el("td", {}, job.model), el("td", {}, job.mode), el("td", { class: "num" }, job.step ?? "–"),
      el("td", { class: "num" }, num(job.loss)), el("td", { class: "num" }, num(job.reward)),
      el("td", { class: "num" }, num(job.tokens_per_s, 3)), el("td", {}, age(job.created_at)), el("td", {}, job.lease),
      el("td", {}, job.host),
    ];
  }

  // --- the jobs table ---------------------------------------------------------------------------
  function jobsPage() {
    signedIn().catch(showError);
    const tbody = document.querySelector("#jobs tbody");
    poll(async () => {
      const { jobs } = await getJson("/ui/api/jobs");
      document.getElementById("empty").hidden = jobs.length > 0;
      fill(tbody, jobs.map((job) => {
        const link = el("a", { href: `/ui/jobs/${encodeURIComponent(job.job_id)}` }, el("code", {}, job.job_id));
        return el("tr", { "data-job-id": job.job_id }, el("td", {}, link), el("td", {}, status(job.status)),
          ...summaryCells(job));
      }));
    });
  }

  // --- one job ----------------------------------------------------------------------------------
  function chartOrder(names) {
    const rest = names.filter((n) => !PREFERRED.includes(n)).sort();
    return PREFERRED.filter((n) => names.includes(n)).concat(rest);
  }

  function drawCharts(charts, points) {
    const box = document.getElementById("charts");
    const names = new Set();
    for (const point of points) for (const name of Object.keys(point)) if (!NOT_CHARTED.has(name)) names.add(name);
    document.getElementById("no-metrics").hidden = names.size > 0;
    // One x range for every chart, so step N sits at the same place in each (reward starts after a warm-up).
    const steps = points.map((point) => point.step);
    const range = [Math.min(...steps), Math.max(Math.max(...steps), Math.min(...steps) + 1)];
    chartOrder([...names]).forEach((name, index) => {
      const xs = [], ys = [];
      for (const point of points) if (point[name] !== undefined) { xs.push(point.step); ys.push(point[name]); }
      let chart = charts.get(name);
      if (!chart) {
        const node = el("div", { class: "chart", "data-metric": name });
        box.append(node);
        // Three per row (10 px gaps, 10 px of border and padding each), with room for a scrollbar yet to appear.
        const width = Math.max(320, Math.floor((box.clientWidth - 2 * 10 - 20) / 3) - 10);
        const options = {
          title: name, width, height: 190, legend: { show: false },
          scales: { x: { time: false, range: () => chart.range } }, cursor: { drag: { x: false, y: false } },
          axes: [
            { label: "step", labelSize: 20, incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000] },
            { size: 56, values: (_, splits) => splits.map(tick) },
          ],
          series: [{}, { label: name, stroke: COLORS[index % COLORS.length], width: 1.5 }],
        };
        chart = { node, range, count: -1 };
        chart.plot = new uPlot(options, [xs, ys], node);
        charts.set(name, chart);
      } else if (chart.count !== xs.length || chart.range.join() !== range.join()) {
        chart.range = range;
        chart.plot.setData([xs, ys]);
      }
      chart.count = xs.length;
      chart.node.setAttribute("data-points", String(xs.length));
      chart.node.setAttribute("data-steps", range.join("-"));
    });
  }

  function checkpointRow(jobId, checkpoint) {
    const files = el("td", {});
    const button = el("button", { type: "button" }, "download links");
    button.onclick = async () => {
      const path = `${API}/${encodeURIComponent(jobId)}/checkpoints/${encodeURIComponent(checkpoint.checkpoint_id)}:export`;
      const exported = await getJson(path, { method: "POST" });
      files.replaceChildren(...exported.files.map((f) =>
        el("div", {}, el("a", { href: f.url, download: f.filename }, f.filename), ` (${num(f.size_bytes / 1e6, 3)} MB)`)));
    };
    files.append(button);
    return el("tr", {}, el("td", {}, el("code", {}, checkpoint.checkpoint_id)), el("td", { class: "num" }, checkpoint.global_steps),
      el("td", { class: "num" }, num(checkpoint.avg_loss)), el("td", {}, checkpoint.checkpoint_type), files);
  }

  function jobPage(jobId) {
    signedIn().catch(showError);
    document.getElementById("job-id").textContent = jobId;
    document.title = `icefloe ${jobId}`;
    const charts = new Map();
    const table = (id) => document.querySelector(`#${id} tbody`);
    let shownCheckpoints = "";
    let points = [];
    // The series a page at a time, from the last point drawn on (a client may still report to its step).
    async function series() {
      let after = points.length ? points[points.length - 1].step - 1 : -1;
      let kept = points.filter((p) => p.step <= after);
      while (after !== null) {
        const page = await getJson(`${API}/${encodeURIComponent(jobId)}/metrics?after_step=${after}`);
        kept = kept.concat(page.points);
        after = page.next_after_step;
      }
      points = kept;
      return points;
    }
    poll(async () => {
      const [job, metrics] = await Promise.all([getJson(`/ui/api/jobs/${encodeURIComponent(jobId)}`), series()]);
      document.getElementById("status").replaceChildren(status(job.status));
      fill(table("summary"), [el("tr", { "data-job-id": job.job_id }, ...summaryCells(job), el("td", {}, job.reason))]);
      drawCharts(charts, metrics);
      fill(table("sub-jobs"), job.sub_jobs.map((s) => el("tr", {}, el("td", {}, el("code", {}, s.sub_job_id)),
        el("td", {}, s.job_type), el("td", {}, s.model_name), el("td", {}, s.engines), el("td", { class: "num" }, s.slots ?? "–"))));
      fill(table("queue"), job.queue.map((r) => el("tr", {}, el("td", {}, r.op), el("td", {}, r.sub_job_id),
        el("td", {}, r.status), el("td", {}, age(r.created_at)))));
      fill(table("failed"), job.failed.map((r) => el("tr", {}, el("td", {}, r.op), el("td", {}, age(r.updated_at) + " ago"),
        el("td", { class: "reason" }, r.error))));
      const checkpointIds = job.checkpoints.map((c) => c.checkpoint_id).join(",");
      if (checkpointIds !== shownCheckpoints) { // redrawn only when they change, so shown links stay
        shownCheckpoints = checkpointIds;
        fill(table("checkpoints"), job.checkpoints.map((c) => checkpointRow(jobId, c)));
      }
      const log = document.getElementById("log");
      const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
      log.textContent = job.log.map((e) => `${(e.ts || "").slice(11, 19)} ${(e.level || "").padEnd(7)} ${e.msg}`).join("\n");
      log.setAttribute("data-lines", String(job.log.length));
      if (atEnd) log.scrollTop = log.scrollHeight;
    });
  }

  return { jobsPage, jobPage };
})();
