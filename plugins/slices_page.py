"""The Slices page's HTML, rendered on the server from the same JSON its script refreshes from.

`fleet()` draws the part that changes (summary, slices, GPU nodes, waiting demand);
`static/slices.js` redraws exactly this markup from `GET <prefix>/api/capacity`, so the
two must change together. Everything from Ray or Airflow is escaped; no external assets.
"""

from __future__ import annotations

import html
import json
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import quote

STATIC = Path(__file__).parent / "static"
REFRESH_S = 5
STATES = ("free", "reserved", "running")
_URI_SAFE = "!~*'()"  # what JavaScript's encodeURIComponent leaves alone
NEW_TAB = 'data-top data-new target="_blank" rel="noopener"'  # slices.js opens these from the parent page


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    total = int(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


def amount(value: float) -> str:
    """A number as JavaScript's String() writes it (0.25, 3, 2.5), rounded to 1e-6 like slices.js."""
    value = round(float(value), 6)
    return str(int(value)) if value.is_integer() else repr(value)


def task_url(holder: dict[str, Any], airflow_base: str) -> str | None:
    """The task instance in Airflow 3's UI: /dags/<dag>/runs/<run>/tasks/<task>[/mapped/<index>]."""
    if not (holder.get("dag_id") and holder.get("run_id") and holder.get("task_id")):
        return None
    parts = [quote(holder[k], safe=_URI_SAFE) for k in ("dag_id", "run_id", "task_id")]
    url = f"{airflow_base}/dags/{parts[0]}/runs/{parts[1]}/tasks/{parts[2]}"
    return f"{url}/mapped/{holder['map_index']}" if holder.get("map_index", -1) >= 0 else url


def job_url(holder: dict[str, Any], dashboard_url: str) -> str | None:
    job = holder.get("submission_id") if holder.get("job_status") else None
    job = job or holder.get("job_id")
    return f"{dashboard_url}/#/jobs/{quote(job, safe=_URI_SAFE)}" if job and dashboard_url else None


def who(holder: dict[str, Any] | None, ctx: dict[str, str]) -> str:
    """A holder as links: the Airflow task (dag / task, run) and its Ray job."""
    if not holder:
        return '<span class="muted">nobody</span>'
    task = task_url(holder, ctx["airflow_base"])
    if task:
        index = f"[{holder['map_index']}]" if holder.get("map_index", -1) >= 0 else ""
        name = (f'<a class="task" data-top href="{esc(task)}" title="Open the task instance in Airflow">'
                f'{esc(holder["dag_id"])} / <b>{esc(holder["task_id"])}{index}</b></a>')
        name += f' <span class="run" title="run id">{esc(holder["run_id"])}</span>'
    else:
        name = f'<span class="task">{esc(holder.get("label") or "unknown")}</span>'
    job = job_url(holder, ctx["dashboard_url"])
    if job:
        status = holder.get("job_status") or "job"
        name += (f' <a class="job" {NEW_TAB} href="{esc(job)}" title="Open the Ray job">'
                 f'Ray {esc(status.lower())} &#8599;</a>')
    return name


def _chips(count: int) -> str:
    return "".join('<i class="chip"></i>' for _ in range(max(1, count)))


def slice_card(s: dict[str, Any], ctx: dict[str, str]) -> str:
    hosts = "".join(
        f'<div class="host {esc(h["state"])}" title="host {h["worker_id"]} &#183; {esc(h["state"])} &#183; '
        f'{h["chips"]} chips &#183; node {esc(h["node_id"][:12])}"><div class="chips c{max(1, h["chips"])}">'
        f'{_chips(h["chips"])}</div><span>host {h["worker_id"]}</span></div>'
        for h in s["hosts"])
    per_host = s["hosts"][0]["chips"] if s["hosts"] else 0
    holder = (f'<div class="holder">{who(s["holder"], ctx)}</div>' if s["holder"]
              else '<div class="holder muted">free for the next step</div>')
    return (f'<article class="card slice {esc(s["state"])}"><header><h3>{esc(s["name"])}</h3>'
            f'<span class="pill {esc(s["state"])}">{esc(s["state"])}</span></header>'
            f'<p class="meta">{esc(s["pod_type"])} &#183; topology {esc(s["topology"])} &#183; '
            f'{len(s["hosts"])} host{"s" if len(s["hosts"]) != 1 else ""} &#215; {per_host} chips</p>'
            f'<div class="hosts">{hosts}</div>{holder}</article>')


def on_gpus(gpus: list[int] | None) -> str:
    """Which of the node's GPUs a share is on (Ray's index, its CUDA_VISIBLE_DEVICES); nothing while unknown."""
    if not gpus:
        return ""
    return (f' <span class="gpu-index" title="GPU index on this node (CUDA_VISIBLE_DEVICES)">'
            f'on GPU {", ".join(str(g) for g in gpus)}</span>')


def gpu_card(node: dict[str, Any], ctx: dict[str, str]) -> str:
    total = node["total"] or 1
    segments = "".join(
        f'<span class="share p{i % 6} {esc(sh["state"])}" style="width:{100 * sh["amount"] / total:.4f}%" '
        f'title="{esc(sh["holder"]["label"])} &#183; {amount(sh["amount"])} GPU"></span>'
        for i, sh in enumerate(node["shares"]))
    users = "".join(
        f'<li><i class="swatch p{i % 6}"></i><span>{who(sh["holder"], ctx)}</span>'
        f'<b>{amount(sh["amount"])} GPU{on_gpus(sh.get("gpus"))}</b></li>'
        for i, sh in enumerate(node["shares"]))
    return (f'<article class="card gpu"><header><h3>GPU node <code>{esc(node["node_id"][:12])}</code></h3>'
            f'<span class="pill {"running" if node["used"] else "free"}">{amount(node["free"])} free</span></header>'
            f'<p class="meta">{amount(node["used"])} of {amount(node["total"])} GPUs in use</p>'
            f'<div class="bar" style="--gpus:{amount(node["total"])}">{segments}</div>'
            f'<ul class="users">{users or "<li class=muted>no one is using it</li>"}</ul></article>')


def waiting(pending: list[dict[str, Any]], ctx: dict[str, str]) -> str:
    if not pending:
        return '<p class="muted">Nothing is waiting for capacity.</p>'
    rows = "".join(
        f'<tr class="{"starting" if p["starting"] else ""}"><td><b>{esc(p["request"])}</b></td>'
        f'<td>{who(p["holder"], ctx)}</td>'
        + ('<td class="muted" title="capacity is free; its worker process is starting">starting</td></tr>'
           if p["starting"] else
           f'<td class="wait" data-waiting="{amount(p["waiting_s"]) if p["waiting_s"] is not None else ""}">'
           f'{esc(duration(p["waiting_s"]))}</td></tr>')
        for p in pending)
    return f'<table class="pending"><tr><th>asks for</th><th>for task</th><th>waiting</th></tr>{rows}</table>'


def summary(data: dict[str, Any]) -> str:
    chips = sum(s["chips"] for s in data["slices"])
    busy = sum(h["chips"] for s in data["slices"] for h in s["hosts"] if h["state"] != "free")
    free_slices = sum(1 for s in data["slices"] if s["state"] == "free")
    gpus = sum(n["total"] for n in data["gpu_nodes"])
    used = sum(n["used"] for n in data["gpu_nodes"])
    waits = sum(not p["starting"] for p in data["pending"])
    tiles = [("TPU chips busy", f"{busy} / {chips}"), ("slices free", f"{free_slices} / {len(data['slices'])}"),
             ("GPUs in use", f"{amount(used)} / {amount(gpus)}"), ("waiting for capacity", str(waits))]
    return "".join(f'<div class="tile"><b>{esc(v)}</b><span>{esc(k)}</span></div>' for k, v in tiles)


def fleet(data: dict[str, Any] | None, ctx: dict[str, str], error: str | None = None) -> str:
    """The refreshed part of the page; `data` is the capacity JSON, None when none could be read."""
    banner = f'<div class="error">{esc(error)}</div>' if error else ""
    if data is None:
        return banner
    slices = "".join(slice_card(s, ctx) for s in data["slices"]) or '<p class="muted">No TPU slices.</p>'
    gpus = "".join(gpu_card(n, ctx) for n in data["gpu_nodes"]) or '<p class="muted">No GPU nodes.</p>'
    warnings = "".join(f'<div class="warning">{esc(w)}</div>' for w in data.get("warnings", []))
    return (f'{banner}{warnings}<section class="summary">{summary(data)}</section>'
            f'<h2>TPU slices</h2><section class="grid">{slices}</section>'
            f'<h2>GPU nodes</h2><section class="grid">{gpus}</section>'
            f'<h2>Waiting for capacity</h2><section>{waiting(data["pending"], ctx)}</section>')


@cache
def _asset(name: str) -> str:
    return (STATIC / name).read_text()


def page(data: dict[str, Any] | None, *, conn_id: str, api_url: str, airflow_base: str, dashboard_url: str,
         error: str | None = None) -> str:
    ctx = {"airflow_base": airflow_base, "dashboard_url": dashboard_url}
    config = json.dumps({"api": api_url, "connId": conn_id, "airflowBase": airflow_base,
                         "dashboardUrl": dashboard_url, "refreshS": REFRESH_S}).replace("</", "<\\/")
    legend = "".join(f'<span><i class="chip {s}"></i>{s}</span>' for s in STATES)
    dashboard = f'<a {NEW_TAB} href="{esc(dashboard_url)}/">Ray dashboard &#8599;</a> &#183; ' if dashboard_url else ""
    taken = esc(data["taken_at"]) if data else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>Slices &#183; rayslice</title><style>{_asset("slices.css")}</style></head>
<body><header class="top"><div><h1>Slices</h1><p class="meta">{dashboard}connection <code>{esc(conn_id)}</code>
&#183; <span id="updated" data-taken="{taken}">updated just now</span></p></div>
<div class="legend">{legend}</div></header>
<main id="fleet">{fleet(data, ctx, error)}</main>
<script id="config" type="application/json">{config}</script><script>{_asset("slices.js")}</script>
</body></html>"""
