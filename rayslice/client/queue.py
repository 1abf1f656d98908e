"""`rayslice queue`: the cluster's admission queue, read over the Jobs API (no `ray` on this side).

The queue lives in the cluster's broker actor, which only a Ray driver can ask; so a short Ray job
(`python -m rayslice.cluster.queue`, the launcher's own code) prints it as one marked JSON line.
"""

from __future__ import annotations

import json
import secrets
import shlex
import time
from typing import Any

from rayslice.client.jobs_client import RayJobsClient
from rayslice.client.submission import launcher_packages
from rayslice.core.exceptions import RayJobsError
from rayslice.core.queue import QueueSettings

#: The line the queue job prints its snapshot on.
MARKER = "::rayslice-queue::"
ENTRYPOINT = "python -m rayslice.cluster.queue"


def read_queue(client: RayJobsClient, *, installed: bool = False, timeout: float = 120.0,
               set_settings: QueueSettings | None = None) -> dict[str, Any]:
    """The queue's snapshot: `entries` (running first, then waiting in order) and `settings`.

    `set_settings`: the operator's new policy and quotas, set first. Only someone who may submit Ray jobs
    (the cluster's token) can; the broker keeps them in the GCS, so a new broker reads them too.
    """
    entrypoint = ENTRYPOINT
    if set_settings is not None:
        entrypoint += f" --set {shlex.quote(set_settings.model_dump_json())}"
    runtime_env: dict[str, Any] = {}
    if not installed:
        runtime_env["py_modules"] = [client.ensure_package(package) for package in launcher_packages()]
    sid = f"rayslice-queue-{secrets.token_hex(6)}"
    client.submit(entrypoint, submission_id=sid, runtime_env=runtime_env or None,
                  metadata={"rayslice-queue": "1"})
    deadline = time.monotonic() + timeout
    while not (job := client.get(sid)).status.is_terminal:
        if time.monotonic() > deadline:
            client.stop(sid)
            raise RayJobsError(f"the queue job {sid} did not finish within {timeout:g} s")
        time.sleep(0.2)
    log = client.logs(sid)
    for line in reversed(log.splitlines()):
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    raise RayJobsError(f"the queue job {sid} ended {job.status.value} without the queue: {log[-500:]}")


def step_of(entry: dict[str, Any]) -> str:
    """The submission id a broker entry belongs to (its id is `<submission id>/<ns>`); a step outside Airflow
    (`adhoc/...`) is only itself."""
    sid = str(entry.get("id", "")).split("/", 1)[0]
    return str(entry.get("id", "")) if sid in ("", "adhoc") else sid


def join_queues(queues: list[tuple[str, dict[str, Any] | None]],
                standing: dict[str, list[str]] | None = None) -> list[dict[str, Any]]:
    """The queue across a cluster set's members (in the set's order; None: a member that could not be read).

    One row per step, however many members list it: a step admitted on one member is `running` there
    (`runs_on`) and `stands_by` on every other member that still lists it waiting (its launcher there leaves
    within a second) or whose job of it runs out of the queue (`standing`, submission id -> members); a waiting
    step says on which members it waits and its rank there (`ranks`). Running steps first, then the waiting ones
    by arrival, as each member orders its own line."""
    rows: dict[str, dict[str, Any]] = {}
    for name, found in queues:
        waiting = 0
        for entry in (found or {}).get("entries", []):
            key = step_of(entry)
            row = rows.setdefault(key, {**entry, "runs_on": None, "waits_on": [], "ranks": {}, "stands_by": []})
            if entry.get("admitted"):
                if row["runs_on"] is None:
                    row.update({**entry, "runs_on": name, "waits_on": row["waits_on"], "ranks": row["ranks"],
                                "stands_by": row["stands_by"]})
                continue
            waiting += 1
            row["waits_on"].append(name)
            row["ranks"][name] = waiting
    for row in rows.values():
        if row["runs_on"] is not None:
            row["stands_by"] = [n for n, _ in queues if n != row["runs_on"] and (
                n in row["waits_on"] or n in (standing or {}).get(step_of(row), []))]
            row["waits_on"], row["ranks"] = [], {}
    running = sorted((r for r in rows.values() if r["runs_on"] is not None), key=lambda r: r.get("admitted_at") or 0)
    waiting_rows = sorted((r for r in rows.values() if r["runs_on"] is None),
                          key=lambda r: (-(r.get("priority") or 0), r.get("arrival") or 0))
    return running + waiting_rows


def standing_by(clients: dict[str, RayJobsClient], rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """For each step admitted on one member: the other members where its job (the same submission id) still runs,
    out of their queue (a standby holds no place). Best effort: a member that fails this says nothing."""
    from rayslice.core.exceptions import RaysliceError

    found: dict[str, list[str]] = {}
    for row in rows:
        sid = step_of(row)
        if row["runs_on"] is None or sid == row.get("id"):
            continue
        for name, client in clients.items():
            if name == row["runs_on"]:
                continue
            try:
                if not client.get(sid).status.is_terminal:
                    found.setdefault(sid, []).append(name)
            except RaysliceError:
                continue
    return found


def format_set_queue(rows: list[dict[str, Any]], now: float | None = None) -> str:
    """The queue across a set as a table: state, priority, team, waited, what, step, where."""
    now = time.time() if now is None else now
    lines = [f"{'state':<8}  {'priority':>8}  {'team':<12}  {'waited':>8}  {'waits for':<14}  {'step':<30}  where"]
    for row in rows:
        waited = (row.get("admitted_at") or now) - row["arrival"]
        if row["runs_on"] is not None:
            where = f"runs on {row['runs_on']}" + (f"; stands by on {', '.join(row['stands_by'])}"
                                                   if row["stands_by"] else "")
        else:
            where = "waits on " + ", ".join(f"{n} (rank {row['ranks'][n]})" for n in row["waits_on"])
        lines.append(f"{'running' if row['runs_on'] else 'waiting':<8}  {row['priority']:>8}  "
                     f"{row.get('team') or '-':<12}  {waited:>7.0f}s  {row['what']:<14}  {row['label']:<30}  {where}")
    if not rows:
        lines.append("(nobody waits)")
    return "\n".join(lines)
