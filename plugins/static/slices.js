// The Slices page's script: draws the fleet from <prefix>/api/capacity every few seconds.
// fleet() mirrors fleet() in slices_page.py (a test compares their output): change both together.
"use strict";

const esc = (v) => String(v).replace(/[&<>"']/g, (c) => ({
  "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#x27;"}[c]));
const amount = (v) => String(Math.round(v * 1e6) / 1e6);
const q = encodeURIComponent;
const USAGE_REFRESH_S = 30;

function duration(s) {
  if (s === null || s === undefined || s === "") return "unknown";
  const t = Math.floor(Number(s)), h = Math.floor(t / 3600), m = Math.floor((t % 3600) / 60), sec = t % 60;
  const two = (n) => String(n).padStart(2, "0");
  return h ? `${h}h ${two(m)}m` : m ? `${m}m ${two(sec)}s` : `${sec}s`;
}

function taskUrl(h, ctx) {
  if (!(h.dag_id && h.run_id && h.task_id)) return null;
  const url = `${ctx.airflowBase}/dags/${q(h.dag_id)}/runs/${q(h.run_id)}/tasks/${q(h.task_id)}`;
  return h.map_index >= 0 ? `${url}/mapped/${h.map_index}` : url;
}

function jobUrl(h, ctx) {
  const job = (h.job_status ? h.submission_id : "") || h.job_id;
  return job && ctx.dashboardUrl ? `${ctx.dashboardUrl}/#/jobs/${q(job)}` : null;
}

function who(h, ctx) {
  if (!h) return '<span class="muted">nobody</span>';
  const task = taskUrl(h, ctx);
  let name;
  if (task) {
    const index = h.map_index >= 0 ? `[${h.map_index}]` : "";
    name = `<a class="task" data-top href="${esc(task)}" title="Open the task instance in Airflow">` +
      `${esc(h.dag_id)} / <b>${esc(h.task_id)}${index}</b></a>`;
    name += ` <span class="run" title="run id">${esc(h.run_id)}</span>`;
  } else {
    name = `<span class="task">${esc(h.label || "unknown")}</span>`;
  }
  const job = jobUrl(h, ctx);
  if (job) {
    name += ` <a class="job" data-top data-new target="_blank" rel="noopener" href="${esc(job)}" title="Open the Ray job">` +
      `Ray ${esc((h.job_status || "job").toLowerCase())} &#8599;</a>`;
  }
  return name;
}

function held(x) {
  if (!x.since || x.held_s === null || x.held_s === undefined) return "";
  return ` <span class="since" data-held="${amount(x.held_s)}" title="held since ${esc(x.since)}">since ` +
    `${esc(x.since.slice(11, 19))} UTC &#183; <span class="held">${esc(duration(x.held_s))}</span></span>`;
}

const chips = (n) => '<i class="chip"></i>'.repeat(Math.max(1, n));

function sliceCard(s, ctx) {
  const hosts = s.hosts.map((h) =>
    `<div class="host ${esc(h.state)}" title="host ${h.worker_id} &#183; ${esc(h.state)} &#183; ` +
    `${h.chips} chips &#183; node ${esc(h.node_id.slice(0, 12))}"><div class="chips c${Math.max(1, h.chips)}">` +
    `${chips(h.chips)}</div><span>host ${h.worker_id}</span></div>`).join("");
  const perHost = s.hosts.length ? s.hosts[0].chips : 0;
  const holder = s.holder ? `<div class="holder">${who(s.holder, ctx)}${held(s)}</div>`
    : '<div class="holder muted">free for the next step</div>';
  return `<article class="card slice ${esc(s.state)}"><header><h3>${esc(s.name)}</h3>` +
    `<span class="pill ${esc(s.state)}">${esc(s.state)}</span></header>` +
    `<p class="meta">${esc(s.pod_type)} &#183; topology ${esc(s.topology)} &#183; ` +
    `${s.hosts.length} host${s.hosts.length !== 1 ? "s" : ""} &#215; ${perHost} chips</p>` +
    `<div class="hosts">${hosts}</div>${holder}</article>`;
}

function onGpus(gpus) {
  if (!gpus || !gpus.length) return "";
  return ' <span class="gpu-index" title="GPU index on this node (CUDA_VISIBLE_DEVICES)">' +
    `on GPU ${gpus.map(String).join(", ")}</span>`;
}

function gpuCard(n, ctx) {
  const total = n.total || 1;
  const segments = n.shares.map((sh, i) =>
    `<span class="share p${i % 6} ${esc(sh.state)}" style="width:${(100 * sh.amount / total).toFixed(4)}%" ` +
    `title="${esc(sh.holder.label)} &#183; ${amount(sh.amount)} GPU"></span>`).join("");
  const users = n.shares.map((sh, i) =>
    `<li><i class="swatch p${i % 6}"></i><span>${who(sh.holder, ctx)}${held(sh)}</span>` +
    `<b>${amount(sh.amount)} GPU${onGpus(sh.gpus)}</b></li>`)
    .join("");
  return `<article class="card gpu"><header><h3>GPU node <code>${esc(n.node_id.slice(0, 12))}</code></h3>` +
    `<span class="pill ${n.used ? "running" : "free"}">${amount(n.free)} free</span></header>` +
    `<p class="meta">${amount(n.used)} of ${amount(n.total)} GPUs in use</p>` +
    `<div class="bar" style="--gpus:${amount(n.total)}">${segments}</div>` +
    `<ul class="users">${users || "<li class=muted>no one is using it</li>"}</ul></article>`;
}

// Where a step waiting in the admission queue stands (as plugins/slices_page.py in_queue says it).
function ordinal(n) {
  const suffix = n % 100 >= 10 && n % 100 <= 20 ? "th" : ({1: "st", 2: "nd", 3: "rd"})[n % 10] || "th";
  return `${n}${suffix}`;
}

function inQueue(p) {
  if (p.kind !== "queue") return "";
  const place = p.place;
  return [place ? `${ordinal(place)} in line` : "", p.priority != null ? `priority ${p.priority}` : "",
          p.team ? `team ${p.team}` : "", p.suspended ? `suspended: ${p.suspended}` : ""].filter(Boolean).join(", ");
}

function waiting(pending, ctx) {
  if (!pending.length) return '<p class="muted">Nothing is waiting for capacity.</p>';
  const rows = pending.map((p) =>
    `<tr class="${p.starting ? "starting" : ""}"><td><b>${esc(p.request)}</b></td>` +
    `<td>${who(p.holder, ctx)}</td><td class="queue">${esc(inQueue(p))}</td>` +
    (p.starting ? '<td class="muted" title="capacity is free; its worker process is starting">starting</td></tr>'
      : `<td class="wait" data-waiting="${p.waiting_s ?? ""}">${esc(duration(p.waiting_s))}</td></tr>`)).join("");
  return '<table class="pending"><tr><th>asks for</th><th>for task</th><th>in the queue</th><th>waiting</th></tr>' +
    `${rows}</table>`;
}

function summary(d) {
  const chipsAll = d.slices.reduce((a, s) => a + s.chips, 0);
  const busy = d.slices.reduce((a, s) => a + s.hosts.filter((h) => h.state !== "free")
    .reduce((b, h) => b + h.chips, 0), 0);
  const freeSlices = d.slices.filter((s) => s.state === "free").length;
  const gpus = d.gpu_nodes.reduce((a, n) => a + n.total, 0);
  const used = d.gpu_nodes.reduce((a, n) => a + n.used, 0);
  const waits = d.pending.filter((p) => !p.starting).length;
  const tiles = [["TPU chips busy", `${busy} / ${chipsAll}`], ["slices free", `${freeSlices} / ${d.slices.length}`],
    ["GPUs in use", `${amount(used)} / ${amount(gpus)}`], ["waiting for capacity", String(waits)]];
  return tiles.map(([k, v]) => `<div class="tile"><b>${esc(v)}</b><span>${esc(k)}</span></div>`).join("");
}

// One cluster's summary, slices and GPU nodes (its waiting demand apart: a set shows it across members).
function cluster(d, ctx) {
  const slices = d.slices.map((s) => sliceCard(s, ctx)).join("") || '<p class="muted">No TPU slices.</p>';
  const gpus = d.gpu_nodes.map((n) => gpuCard(n, ctx)).join("") || '<p class="muted">No GPU nodes.</p>';
  const warnings = (d.warnings || []).map((w) => `<div class="warning">${esc(w)}</div>`).join("");
  return `${warnings}<section class="summary">${summary(d)}</section>` +
    `<h2>TPU slices</h2><section class="grid">${slices}</section>` +
    `<h2>GPU nodes</h2><section class="grid">${gpus}</section>`;
}

function fleet(d, ctx, error) {
  const banner = error ? `<div class="error">${esc(error)}</div>` : "";
  if (!d) return banner;
  if (d.members) return banner + setFleet(d, ctx);
  return `${banner}${cluster(d, ctx)}` +
    `<h2>Waiting for capacity</h2><section>${waiting(d.pending, ctx)}</section>`;
}

// A cluster set (as plugins/slices_page.py set_fleet draws it): each member under its name, then the queue
// across them, each step once.
function where(row) {
  if (row.runs_on !== null && row.runs_on !== undefined) {
    return `runs on ${row.runs_on}` + (row.stands_by.length ? `; stands by on ${row.stands_by.join(", ")}` : "");
  }
  return "waits on " + row.waits_on.map((n) => row.places[n] ? `${n} (${ordinal(row.places[n])} in line)` : n)
    .join(", ");
}

function across(d, ctx) {
  if (!d.queue.length) return '<p class="muted">Nothing is waiting for capacity on any cluster of the set.</p>';
  const urls = Object.fromEntries(d.members.map((m) => [m.name, m.dashboard_url]));
  const rows = d.queue.map((row) => {
    const p = row.demand;
    const running = row.runs_on !== null && row.runs_on !== undefined;
    const home = running ? row.runs_on : (row.waits_on[0] || "");
    const mine = {...ctx, dashboardUrl: urls[home] || ""};
    const wait = running ? '<td class="muted">running</td>'
      : p.starting ? '<td class="muted" title="capacity is free; its worker process is starting">starting</td>'
        : `<td class="wait" data-waiting="${p.waiting_s ?? ""}">${esc(duration(p.waiting_s))}</td>`;
    return `<tr class="${p.starting ? "starting" : ""}"><td><b>${esc(p.request)}</b></td>` +
      `<td>${who(p.holder, mine)}</td><td class="where">${esc(where(row))}</td>` +
      `<td class="queue">${esc(inQueue({...p, place: null}))}</td>${wait}</tr>`;
  }).join("");
  return '<table class="pending across"><tr><th>asks for</th><th>for task</th><th>clusters</th>' +
    `<th>in the queue</th><th>waiting</th></tr>${rows}</table>`;
}

function setFleet(d, ctx) {
  const parts = d.members.map((m) => {
    const link = m.dashboard_url ? ` <a class="dashboard" data-top data-new target="_blank" rel="noopener" ` +
      `href="${esc(m.dashboard_url)}/">Ray dashboard &#8599;</a>` : "";
    const head = `<h2 class="member">Cluster <code>${esc(m.name)}</code>${link}</h2>`;
    const body = m.snapshot === null || m.snapshot === undefined
      ? `<div class="error">cluster ${esc(m.name)}: unreachable (${esc(m.error)})</div>`
      : cluster(m.snapshot, {...ctx, dashboardUrl: m.dashboard_url});
    return `<section class="member">${head}${body}</section>`;
  }).join("");
  return `${parts}<h2>Waiting for capacity across the set</h2><section>${across(d, ctx)}</section>`;
}

function start() {
  const cfg = JSON.parse(document.getElementById("config").textContent);
  const ctx = {airflowBase: cfg.airflowBase, dashboardUrl: cfg.dashboardUrl};
  const fleetEl = document.getElementById("fleet");
  const updatedEl = document.getElementById("updated");
  let fetchedAt = Date.now();
  let last = null;

  function tick() {
    const age = Math.round((Date.now() - fetchedAt) / 1000);
    updatedEl.textContent = age < 2 ? "updated just now" : `updated ${duration(age)} ago`;
    document.querySelectorAll("td.wait[data-waiting]").forEach((td) => {
      if (td.dataset.waiting !== "") td.textContent = duration(Number(td.dataset.waiting) + age);
    });
    document.querySelectorAll("span.since[data-held] .held").forEach((el) => {
      el.textContent = duration(Number(el.parentElement.dataset.held) + age);
    });
  }

  // The usage section is drawn on the server only; refreshing it means fetching that HTML again.
  const usageEl = document.getElementById("usage");
  async function refreshUsage() {
    if (!usageEl || !cfg.usage || document.hidden) return;
    try {
      const resp = await fetch(`${cfg.usage}?hours=${q(cfg.hours)}&conn_id=${q(cfg.connId)}`,
        {credentials: "same-origin"});
      if (resp.ok) usageEl.innerHTML = await resp.text();
    } catch (err) { /* keep the last drawing; the next refresh tries again */ }
  }
  const windowSelect = document.querySelector("form.window select");
  if (windowSelect) windowSelect.addEventListener("change", () => windowSelect.form.submit());

  async function refresh() {
    if (document.hidden) return;
    try {
      const resp = await fetch(`${cfg.api}?conn_id=${q(cfg.connId)}`, {credentials: "same-origin"});
      const body = await resp.json().catch(() => ({}));
      if (!resp.ok) throw new Error(body.detail || `HTTP ${resp.status}`);
      last = body;
      fetchedAt = Date.now();
      fleetEl.innerHTML = fleet(last, ctx, null);
    } catch (err) {
      fleetEl.innerHTML = fleet(last, ctx, `Could not refresh: ${err.message}. Showing the last reading.`);
    }
    tick();
  }

  // The UI shows this page in a sandboxed iframe (no top navigation, no popups): open links
  // through an anchor in the parent document, which the sandbox does not restrict.
  document.addEventListener("click", (event) => {
    const link = event.target.closest("a[data-top]");
    if (!link || window.top === window || event.button !== 0 || event.metaKey || event.ctrlKey) return;
    try {
      const doc = window.top.document;
      const a = doc.createElement("a");
      a.href = link.href;
      if (link.hasAttribute("data-new")) { a.target = "_blank"; a.rel = "noopener"; }
      doc.body.appendChild(a);
      a.click();
      a.remove();
      event.preventDefault();
    } catch (err) { /* not same-origin: let the browser follow the link */ }
  });

  setInterval(tick, 1000);
  if (!cfg.api) return;  // a refused page (another connection, not allowed): nothing to refresh
  setInterval(refresh, cfg.refreshS * 1000);
  setInterval(refreshUsage, USAGE_REFRESH_S * 1000);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(); });
}

if (typeof document !== "undefined") start();
if (typeof module !== "undefined") module.exports = {fleet, duration};
