"""The Slices page's HTML, rendered on the server from the same JSON its script refreshes from.

`fleet()` draws the part that changes (summary, slices, GPU nodes, waiting demand);
`static/slices.js` redraws exactly this markup from `GET <prefix>/api/capacity`, so the
two must change together. `usage_section()` draws the timeline and the accelerator-hours
tables; the script refreshes it by fetching this same HTML (`GET <prefix>/usage`).
Everything from Ray or Airflow is escaped; no external assets.
"""

from __future__ import annotations

import hashlib
import html
import json
from datetime import UTC, datetime
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


def held(x: dict[str, Any]) -> str:
    """Since when a holder holds it (UTC) and for how long; the script keeps the duration ticking."""
    if not x.get("since") or x.get("held_s") is None:
        return ""
    return (f' <span class="since" data-held="{amount(x["held_s"])}" title="held since {esc(x["since"])}">since '
            f'{esc(x["since"][11:19])} UTC &#183; <span class="held">{esc(duration(x["held_s"]))}</span></span>')


def _chips(count: int) -> str:
    return "".join('<i class="chip"></i>' for _ in range(max(1, count)))


def slice_card(s: dict[str, Any], ctx: dict[str, str]) -> str:
    hosts = "".join(
        f'<div class="host {esc(h["state"])}" title="host {h["worker_id"]} &#183; {esc(h["state"])} &#183; '
        f'{h["chips"]} chips &#183; node {esc(h["node_id"][:12])}"><div class="chips c{max(1, h["chips"])}">'
        f'{_chips(h["chips"])}</div><span>host {h["worker_id"]}</span></div>'
        for h in s["hosts"])
    per_host = s["hosts"][0]["chips"] if s["hosts"] else 0
    holder = (f'<div class="holder">{who(s["holder"], ctx)}{held(s)}</div>' if s["holder"]
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
        f'<li><i class="swatch p{i % 6}"></i><span>{who(sh["holder"], ctx)}{held(sh)}</span>'
        f'<b>{amount(sh["amount"])} GPU{on_gpus(sh.get("gpus"))}</b></li>'
        for i, sh in enumerate(node["shares"]))
    return (f'<article class="card gpu"><header><h3>GPU node <code>{esc(node["node_id"][:12])}</code></h3>'
            f'<span class="pill {"running" if node["used"] else "free"}">{amount(node["free"])} free</span></header>'
            f'<p class="meta">{amount(node["used"])} of {amount(node["total"])} GPUs in use</p>'
            f'<div class="bar" style="--gpus:{amount(node["total"])}">{segments}</div>'
            f'<ul class="users">{users or "<li class=muted>no one is using it</li>"}</ul></article>')


def in_queue(p: dict[str, Any]) -> str:
    """Where a step waiting in the admission queue stands: "2nd in line, priority 5, team research"."""
    if p.get("kind") != "queue":
        return ""
    from rayslice.core.queue import ordinal

    place = p.get("place")
    parts = [f"{ordinal(place)} in line" if place else "",
             f"priority {p['priority']}" if p.get("priority") is not None else "",
             f"team {p['team']}" if p.get("team") else "",
             f"suspended: {p['suspended']}" if p.get("suspended") else ""]
    return ", ".join(part for part in parts if part)


def waiting(pending: list[dict[str, Any]], ctx: dict[str, str]) -> str:
    if not pending:
        return '<p class="muted">Nothing is waiting for capacity.</p>'
    rows = "".join(
        f'<tr class="{"starting" if p["starting"] else ""}"><td><b>{esc(p["request"])}</b></td>'
        f'<td>{who(p["holder"], ctx)}</td><td class="queue">{esc(in_queue(p))}</td>'
        + ('<td class="muted" title="capacity is free; its worker process is starting">starting</td></tr>'
           if p["starting"] else
           f'<td class="wait" data-waiting="{amount(p["waiting_s"]) if p["waiting_s"] is not None else ""}">'
           f'{esc(duration(p["waiting_s"]))}</td></tr>')
        for p in pending)
    return ('<table class="pending"><tr><th>asks for</th><th>for task</th><th>in the queue</th><th>waiting</th>'
            f'</tr>{rows}</table>')


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


def cluster(data: dict[str, Any], ctx: dict[str, str]) -> str:
    """One cluster's summary, slices and GPU nodes (its waiting demand apart: a set shows it across members)."""
    slices = "".join(slice_card(s, ctx) for s in data["slices"]) or '<p class="muted">No TPU slices.</p>'
    gpus = "".join(gpu_card(n, ctx) for n in data["gpu_nodes"]) or '<p class="muted">No GPU nodes.</p>'
    warnings = "".join(f'<div class="warning">{esc(w)}</div>' for w in data.get("warnings", []))
    return (f'{warnings}<section class="summary">{summary(data)}</section>'
            f'<h2>TPU slices</h2><section class="grid">{slices}</section>'
            f'<h2>GPU nodes</h2><section class="grid">{gpus}</section>')


def fleet(data: dict[str, Any] | None, ctx: dict[str, str], error: str | None = None) -> str:
    """The refreshed part of the page; `data` is the capacity JSON, None when none could be read."""
    banner = f'<div class="error">{esc(error)}</div>' if error else ""
    if data is None:
        return banner
    if "members" in data:
        return banner + set_fleet(data, ctx)
    return (f'{banner}{cluster(data, ctx)}'
            f'<h2>Waiting for capacity</h2><section>{waiting(data["pending"], ctx)}</section>')


def where(row: dict[str, Any]) -> str:
    """Where a step of a set's queue is: "waits on a (1st in line), b" or "runs on b; stands by on a"."""
    from rayslice.core.queue import ordinal

    if row["runs_on"] is not None:
        return f"runs on {row['runs_on']}" + (f"; stands by on {', '.join(row['stands_by'])}"
                                              if row["stands_by"] else "")
    places = row["places"]
    return "waits on " + ", ".join(f"{n} ({ordinal(places[n])} in line)" if places.get(n) else n
                                   for n in row["waits_on"])


def across(data: dict[str, Any], ctx: dict[str, str]) -> str:
    """The queue across a set's members: each step once, where it waits (or runs, and stands by)."""
    if not data["queue"]:
        return '<p class="muted">Nothing is waiting for capacity on any cluster of the set.</p>'
    urls = {m["name"]: m["dashboard_url"] for m in data["members"]}
    rows = []
    for row in data["queue"]:
        p = row["demand"]
        home = row["runs_on"] or (row["waits_on"] or [""])[0]  # its job's link: where it runs, else waits first
        mine = {**ctx, "dashboard_url": urls.get(home, "")}
        info = in_queue({**p, "place": None})
        wait = ('<td class="muted">running</td>' if row["runs_on"] is not None else
                '<td class="muted" title="capacity is free; its worker process is starting">starting</td>'
                if p["starting"] else
                f'<td class="wait" data-waiting="{amount(p["waiting_s"]) if p["waiting_s"] is not None else ""}">'
                f'{esc(duration(p["waiting_s"]))}</td>')
        rows.append(f'<tr class="{"starting" if p["starting"] else ""}"><td><b>{esc(p["request"])}</b></td>'
                    f'<td>{who(p["holder"], mine)}</td><td class="where">{esc(where(row))}</td>'
                    f'<td class="queue">{esc(info)}</td>{wait}</tr>')
    return ('<table class="pending across"><tr><th>asks for</th><th>for task</th><th>clusters</th>'
            f'<th>in the queue</th><th>waiting</th></tr>{"".join(rows)}</table>')


def set_fleet(data: dict[str, Any], ctx: dict[str, str]) -> str:
    """A cluster set: each member under its name (or why it could not be read), then the queue across them."""
    parts = []
    for m in data["members"]:
        link = (f' <a class="dashboard" {NEW_TAB} href="{esc(m["dashboard_url"])}/">Ray dashboard &#8599;</a>'
                if m["dashboard_url"] else "")
        head = f'<h2 class="member">Cluster <code>{esc(m["name"])}</code>{link}</h2>'
        if m["snapshot"] is None:
            body = f'<div class="error">cluster {esc(m["name"])}: unreachable ({esc(m["error"])})</div>'
        else:
            body = cluster(m["snapshot"], {**ctx, "dashboard_url": m["dashboard_url"]})
        parts.append(f'<section class="member">{head}{body}</section>')
    return (f'{"".join(parts)}<h2>Waiting for capacity across the set</h2>'
            f'<section>{across(data, ctx)}</section>')


def error_box(message: str) -> str:
    return f'<div class="error">{esc(message)}</div>'


# --------------------------------------------------------------------------- usage over time

_TICKS_MIN = {1: 10, 3: 30, 6: 60, 12: 120, 24: 240, 72: 720}


def dag_color(dag_id: str) -> str:
    """A stable colour per DAG (the same on every page and every refresh)."""
    hue = int(hashlib.sha1(dag_id.encode()).hexdigest()[:4], 16) % 360
    return f"hsl({hue} 62% 47%)"


def hours_text(value: float) -> str:
    if not value:
        return "0"
    return "&lt;0.0001" if value < 0.0001 else f"{value:,.4f}" if value < 1 else f"{value:,.2f}"


def _ts(value: str | None) -> float | None:
    return datetime.fromisoformat(value).timestamp() if value else None


def _hm(value: float) -> str:
    return datetime.fromtimestamp(value, UTC).strftime("%H:%M")


def _hms(value: float) -> str:
    return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _step_name(bar: dict[str, Any]) -> str:
    """The step as the tooltip names it, escaped (its ids come from a Ray job's metadata)."""
    if bar["hidden"]:
        return "a task in a DAG you cannot read"
    index = f"[{bar['map_index']}]" if bar.get("map_index", -1) >= 0 else ""
    return esc(f"{bar['dag_id'] or 'ad-hoc'} / {bar['task_id'] or bar['submission_id']}{index}")


def _unit(bar: dict[str, Any]) -> tuple[str, str]:
    """What a bar's amount counts and its hours' unit: TPU chips, GPU (share), NPU, neuron_cores ..."""
    resource = bar.get("resource") or ("TPU" if bar["kind"] == "tpu" else "GPU")
    return ("chips", "chip-hours") if resource == "TPU" else (esc(resource), f"{esc(resource)}-hours")


def timeline(data: dict[str, Any], ctx: dict[str, str]) -> str:
    """One lane per slice and GPU node; a bar per step that held it, coloured by DAG, linked to its details."""
    since, until = _ts(data["since"]), _ts(data["until"])
    assert since is not None and until is not None
    span = max(1.0, until - since)
    step_min = _TICKS_MIN.get(int(data["hours"]), 60)
    first = (int(since) // (step_min * 60) + 1) * step_min * 60
    ticks = "".join(f'<span class="tick" style="left:{100 * (t - since) / span:.3f}%">{_hm(t)}</span>'
                    for t in range(first, int(until) + 1, step_min * 60))
    rows, details = [], []
    bars_by_lane: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for i, bar in enumerate(data["bars"]):
        bars_by_lane.setdefault(bar["lane"], []).append((i, bar))
    for lane in data["lanes"]:
        cells = []
        for i, bar in bars_by_lane.get(lane["key"], []):
            start, end = _ts(bar["start"]) or since, _ts(bar["end"]) or until
            left = max(0.0, start - since) / span * 100
            width = max(0.4, (min(end, until) - max(start, since)) / span * 100)
            unit, hours_unit = _unit(bar)
            color = "" if bar["hidden"] else f' style="--dag:{dag_color(bar["dag_id"])}"'
            tip = (f'{_step_name(bar)} &#183; {_hm(start)}&#8211;{"now" if not bar["end"] else _hm(end)} UTC &#183; '
                   f'{amount(bar["amount"])} {unit} &#183; {hours_text(bar["hours"])} {hours_unit}')
            cells.append(f'<a class="step{" hidden" if bar["hidden"] else ""}{"" if bar["end"] else " open"}" '
                         f'href="#step-{i}" data-step="{i}" style="left:{left:.3f}%;width:{width:.3f}%"'
                         f'><i{color}></i><span class="tip">{tip}</span></a>')
            details.append(_step_detail(i, bar, lane, ctx))
        title = f'{esc(lane["title"])}<small>{esc(lane["detail"])}</small>'
        rows.append(f'<div class="lane {esc(lane["kind"])}"><span class="lane-name">{title}</span>'
                    f'<div class="track">{"".join(cells)}</div></div>')
    legend = "".join(f'<span><i style="background:{dag_color(d)}"></i>{esc(d)}</span>'
                     for d in sorted({b["dag_id"] for b in data["bars"] if not b["hidden"] and b["dag_id"]}))
    if any(b["hidden"] for b in data["bars"]):
        legend += '<span><i class="hidden"></i>DAGs you cannot read</span>'
    empty = ("" if data["bars"] else
             f'<p class="muted">No step held a slice or a GPU in the last {amount(data["hours"])} h.</p>')
    return (f'<div class="timeline"><div class="lane axis"><span class="lane-name">UTC</span>'
            f'<div class="track">{ticks}</div></div>{"".join(rows)}</div>'
            f'<div class="dag-legend">{legend}</div>{empty}<div class="steps">{"".join(details)}</div>')


def _step_detail(i: int, bar: dict[str, Any], lane: dict[str, Any], ctx: dict[str, str]) -> str:
    start, end = _ts(bar["start"]), _ts(bar["end"])
    unit, hours_unit = _unit(bar)
    name = (f'<span class="task">{_step_name(bar)}</span>' if bar["hidden"] else who(bar, ctx))
    waited = f' &#183; waited {esc(duration(bar["waited_s"]))} before it started' if bar.get("waited_s") else ""
    until = _hms(end) if end else "now (still holding it)"
    return (f'<div class="step-detail" id="step-{i}"><a class="close" href="#usage" title="Close">&#215;</a>'
            f'<div>{name}</div><p class="meta">{esc(lane["title"])} &#183; {esc(bar.get("request") or "")} '
            f'&#183; {amount(bar["amount"])} {unit} &#183; {_hms(start or 0)} &#8594; {until} UTC'
            f'{waited} &#183; <b>{hours_text(bar["hours"])} {hours_unit}</b> in this window</p></div>')


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    """The accelerator-hours columns: TPU chip-hours and GPU-hours always, then every other kind billed."""
    from rayslice.client.usage import ACCELERATORS

    return [r for r in ACCELERATORS if r in ("TPU", "GPU") or any(row["hours"].get(r) for row in rows)]


#: Chip-time held, by goodput category (rayslice.core.goodput.HELD), and what is counted but not held.
_HELD = ("startup", "productive", "checkpointing", "lost", "teardown")
_NOT_HELD = ("waiting", "suspended")


def _summed_goodput(rows: list[dict[str, Any]]) -> dict[str, Any]:
    chip_h = {name: sum((r.get("chip_h") or {}).get(name, 0.0) for r in rows) for name in _HELD + _NOT_HELD}
    held = sum(chip_h[name] for name in _HELD)
    measured = sum(r.get("measured", 0) for r in rows)
    return {"measured": measured, "steps": sum(r["steps"] for r in rows),
            "chip_h": chip_h if measured else {}, "goodput": chip_h["productive"] / held if held > 0 else None}


def goodput_cell(r: dict[str, Any]) -> str:
    """Goodput, with where the chip-hours went as its tooltip; "-" where no step of the row has figures."""
    if r.get("goodput") is None:
        return '<td class="num muted" title="no ended step with goodput figures">-</td>'
    chip_h = r.get("chip_h") or {}
    went = "; ".join(f"{name} {chip_h.get(name, 0.0):.4g} chip-h" for name in _HELD + _NOT_HELD
                     if chip_h.get(name))
    of = "" if r.get("measured") == r.get("steps") else f" ({r.get('measured')} of {r.get('steps')} steps)"
    return f'<td class="num goodput" title="{esc(went)}">{r["goodput"]:.1%}{esc(of)}</td>'


def usage_tables(data: dict[str, Any]) -> str:
    columns = _columns(data["by_dag"])
    # A cluster set's usage: where each row's attempts held capacity (`UsageRow.clusters`).
    on_set = any(r.get("clusters") for r in data["by_dag"] + data["by_task"])

    def hours(r: dict[str, Any]) -> str:
        return "".join(f'<td class="num">{hours_text(r["hours"].get(c, 0))}</td>' for c in columns)

    def clusters(r: dict[str, Any]) -> str:
        if not on_set:
            return ""
        return f'<td>{esc(", ".join(f"{n} ({k})" for n, k in (r.get("clusters") or {}).items()))}</td>'

    def row(r: dict[str, Any], with_task: bool) -> str:
        dag = ('<span class="muted">DAGs you cannot read</span>' if r["hidden"] else
               f'<i class="swatch" style="background:{dag_color(r["dag_id"])}"></i>{esc(r["dag_id"])}')
        task = f'<td>{esc(r["task_id"] or "")}</td>' if with_task else ""
        return (f'<tr><td>{dag}</td>{task}<td class="num">{r["steps"]}</td>{clusters(r)}{hours(r)}'
                f'{goodput_cell(r)}</tr>')

    def table(rows: list[dict[str, Any]], with_task: bool, css: str) -> str:
        head = "<th>task</th>" if with_task else ""
        head_after = ('<th title="attempts that held capacity, per cluster of the set">clusters (attempts)</th>'
                      if on_set else "")
        sums = {"hours": {c: sum(r["hours"].get(c, 0) for r in rows) for c in columns},
                **_summed_goodput(rows)}
        total = (f'<tr class="total"><td>total</td>{"<td></td>" if with_task else ""}'
                 f'<td class="num">{sum(r["steps"] for r in rows)}</td>{"<td></td>" if on_set else ""}'
                 f'{hours(sums)}{goodput_cell(sums)}</tr>')
        units = "".join(f'<th class="num">{"TPU chip" if c == "TPU" else esc(c)}-hours</th>' for c in columns)
        units += ('<th class="num" title="productive chip-time over chip-time held, of the ended steps whose job '
                  'log has the figures (docs/goodput.md)">goodput</th>')
        return (f'<table class="usage {css}"><tr><th>DAG</th>{head}<th class="num">steps</th>{head_after}{units}</tr>'
                f'{"".join(row(r, with_task) for r in rows)}{total if rows else ""}</table>')

    return (f'<div class="tables"><div><h3>By DAG</h3>{table(data["by_dag"], False, "by-dag")}</div>'
            f'<div><h3>By task</h3>{table(data["by_task"], True, "by-task")}</div></div>')


def usage_section(data: dict[str, Any], ctx: dict[str, str]) -> str:
    """The timeline and the tables over the window, as the page's `#usage` holds them."""
    oldest = (f"the oldest step Ray still lists started {_hms(_ts(data['oldest']) or 0)} UTC"
              if data.get("oldest") else "Ray lists no step yet")
    return (f'{timeline(data, ctx)}'
            f'<p class="meta">{_hms(_ts(data["since"]) or 0)} &#8594; {_hms(_ts(data["until"]) or 0)} UTC; '
            f'{oldest}. Accelerator-hours: chips (or GPU, NPU ... share) &#215; hours each step\'s host processes ran '
            f'inside this window; time spent waiting for capacity is not counted.</p>{usage_tables(data)}')


@cache
def _asset(name: str) -> str:
    return (STATIC / name).read_text()


def window_form(conn_id: str, hours: float, default_conn_id: str = "ray_default") -> str:
    """The window picker: a plain GET form (works without JavaScript; the script submits it on change)."""
    options = "".join(f'<option value="{h}"{" selected" if h == hours else ""}>last {h} h</option>'
                      for h in (1, 3, 6, 12, 24, 72))
    keep = f'<input type="hidden" name="conn_id" value="{esc(conn_id)}">' if conn_id != default_conn_id else ""
    return (f'<form class="window" method="get" action="">{keep}<label>Window <select name="hours">{options}'
            f'</select></label> <button type="submit">Show</button></form>')


def page(data: dict[str, Any] | None, *, conn_id: str, api_url: str, airflow_base: str, dashboard_url: str,
         error: str | None = None, usage_html: str = "", hours: float = 6, usage_url: str = "") -> str:
    ctx = {"airflow_base": airflow_base, "dashboard_url": dashboard_url}
    config = json.dumps({"api": api_url, "connId": conn_id, "airflowBase": airflow_base,
                         "dashboardUrl": dashboard_url, "refreshS": REFRESH_S, "usage": usage_url,
                         "hours": hours})
    config = config.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")  # inert in <script>
    legend = "".join(f'<span><i class="chip {s}"></i>{s}</span>' for s in STATES)
    dashboard = f'<a {NEW_TAB} href="{esc(dashboard_url)}/">Ray dashboard &#8599;</a> &#183; ' if dashboard_url else ""
    taken = esc(data["taken_at"]) if data else ""
    usage = (f'<header class="usage-head"><h2>Usage over time</h2>{window_form(conn_id, hours)}</header>\n'
             f'<section id="usage">{usage_html}</section>') if usage_html else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>Slices &#183; rayslice</title><style>{_asset("slices.css")}</style></head>
<body><header class="top"><div><h1>Slices</h1><p class="meta">{dashboard}connection <code>{esc(conn_id)}</code>
&#183; <span id="updated" data-taken="{taken}">updated just now</span></p></div>
<div class="legend">{legend}</div></header>
<main id="fleet">{fleet(data, ctx, error)}</main>
{usage}
<script id="config" type="application/json">{config}</script><script>{_asset("slices.js")}</script>
</body></html>"""
