"""The admission queue's rules: who may reserve next, in what order, and how to say where a step stands.

Pure: no ray here. The cluster side (`rayslice.cluster.queue`) keeps the waiting requests in
one named Ray actor per cluster and applies `plan` to them; the CLI prints `format_queue`.

Order: priority (higher first), then arrival (earlier first). Policies (Kueue's names):

- ``strict``: a request that cannot start holds back every later one of its family (TPU
  slices of any type, or one accelerator resource): nobody passes it.
- ``best-effort`` (default): a later request may start on capacity the waiting one cannot
  use (a ``v6e-4`` while a ``2 x v6e-16`` waits), never on capacity it could (a one-slice
  ``v6e-16`` waits behind the ``2 x v6e-16``). A request waiting longer than ``aging_s`` is
  served strictly.

Teams: a request of a team with a quota (chips per slice type, or accelerators such as GPUs)
that would exceed it borrows: it starts only when no request within its quota waits for the
same capacity. Nothing is ever preempted.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rayslice.core.accelerators import AcceleratorRequest, StepRequest, TpuSliceRequest

Policy = Literal["best-effort", "strict"]
#: Environment variable on the cluster with the queue's settings as JSON, for steps whose connection sets none.
SETTINGS_ENV = "RAYSLICE_QUEUE"


class QueueSettings(BaseModel):
    """A cluster's queue policy: the `ray` connection's ``queue`` extra, or ``RAYSLICE_QUEUE`` on the cluster."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: Policy = "best-effort"
    aging_s: float | None = Field(600.0, gt=0, description="best-effort: after this long a waiting request is "
                                                           "served strictly (None: never)")
    quotas: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description="team -> {slice type (chips) or accelerator resource (count): quota}, e.g. "
                    "{'research': {'v6e-16': 32, 'GPU': 2}}")


@dataclass
class Entry:
    """One step's place: what it waits for, its rank, and whether it was admitted."""

    id: str
    label: str  # dag.task (or the submission id outside Airflow)
    family: str  # "TPU", or the accelerator resource ("GPU")
    kind: str  # the slice type ("v6e-16"), or the accelerator resource
    amount: float  # slices, or accelerators
    chips: float  # what counts against a team's quota: chips, or accelerators
    what: str  # "2 x v6e-16"
    priority: int = 0
    team: str | None = None
    arrival: float = field(default_factory=time.time)
    admitted: bool = False
    admitted_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Entry:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def entry_for(request: StepRequest, *, id: str, label: str, priority: int = 0, team: str | None = None,
              arrival: float | None = None) -> Entry:
    """The queue entry of a step's request."""
    if isinstance(request, TpuSliceRequest):
        chips = request.total_hosts * request.chips_per_host
        return Entry(id=id, label=label, family="TPU", kind=request.pod_type, amount=request.num_slices,
                     chips=chips, what=f"{request.num_slices} x {request.pod_type}", priority=priority, team=team,
                     arrival=time.time() if arrival is None else arrival)
    assert isinstance(request, AcceleratorRequest)
    return Entry(id=id, label=label, family=request.resource, kind=request.resource, amount=request.count,
                 chips=request.count, what=f"{request.count:g} {request.resource}", priority=priority, team=team,
                 arrival=time.time() if arrival is None else arrival)


def order(entries: list[Entry]) -> list[Entry]:
    """Waiting entries by rank: priority (higher first), then arrival."""
    return sorted((e for e in entries if not e.admitted), key=lambda e: (-e.priority, e.arrival, e.id))


@dataclass
class Plan:
    """What `plan` decided: who is admitted now, and why each other entry waits."""

    admit: list[str]
    reasons: dict[str, str]  # id -> why it still waits


def plan(entries: list[Entry], totals: dict[str, float], settings: QueueSettings, now: float | None = None) -> Plan:
    """Who of the waiting entries may reserve now.

    `totals`: the cluster's capacity per kind (slices of a type, accelerators of a resource). A kind
    the cluster holds too little of (an autoscaler adds it on demand) counts as fitting.
    """
    now = time.time() if now is None else now
    used: dict[str, float] = {}
    team_used: dict[tuple[str, str], float] = {}
    for e in entries:
        if e.admitted:
            used[e.kind] = used.get(e.kind, 0) + e.amount
            if e.team:
                team_used[(e.team, e.kind)] = team_used.get((e.team, e.kind), 0) + e.chips

    def quota_left(e: Entry) -> float | None:
        quota = settings.quotas.get(e.team) if e.team else None
        if quota is None:
            return None
        return quota.get(e.kind, 0) - team_used.get((e.team, e.kind), 0)

    def fits(e: Entry) -> bool:
        total = totals.get(e.kind, 0)
        return total < e.amount or used.get(e.kind, 0) + e.amount <= total + 1e-9

    def take(e: Entry) -> None:
        admit.append(e.id)
        used[e.kind] = used.get(e.kind, 0) + e.amount
        if e.team:
            team_used[(e.team, e.kind)] = team_used.get((e.team, e.kind), 0) + e.chips

    admit: list[str] = []
    reasons: dict[str, str] = {}
    blocked_kinds: dict[str, Entry] = {}  # kind -> the first entry that waits for it
    blocked_families: dict[str, Entry] = {}  # family -> the first entry served strictly that waits
    borrowers: list[Entry] = []
    for e in order(entries):
        left = quota_left(e)
        if left is not None and e.chips > left + 1e-9:
            borrowers.append(e)
            continue
        strictly = settings.policy == "strict" or (settings.aging_s is not None and now - e.arrival >= settings.aging_s)
        blocker = blocked_kinds.get(e.kind) or blocked_families.get(e.family)
        if blocker is None and fits(e):
            take(e)
            continue
        if blocker is None:
            reasons[e.id] = f"first in line; {used.get(e.kind, 0):g} of {totals.get(e.kind, 0):g} {e.kind} in use"
        elif blocker.kind != e.kind:
            reasons[e.id] = f"held back by {blocker.label} (waiting for {blocker.what}, served strictly)"
        else:
            reasons[e.id] = ""  # behind the line of its own kind
        blocked_kinds.setdefault(e.kind, e)
        if strictly:
            blocked_families.setdefault(e.family, e)
    for e in borrowers:  # over quota: only on capacity that nobody within quota waits for
        quota = settings.quotas[e.team].get(e.kind, 0)  # type: ignore[index]
        why = f"team {e.team} over its quota ({team_used.get((e.team, e.kind), 0):g} of {quota:g} {e.kind} in use)"
        if e.kind in blocked_kinds or e.family in blocked_families or not fits(e):
            reasons[e.id] = why + ", borrowing only what nobody within quota waits for"
            blocked_kinds.setdefault(e.kind, e)
            continue
        take(e)
    return Plan(admit=admit, reasons=reasons)


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def standing(entries: list[Entry], id: str, reasons: dict[str, str], now: float | None = None) -> dict[str, Any]:
    """Where a waiting entry stands in its line (the waiting entries of its kind): rank, the one ahead, why."""
    now = time.time() if now is None else now
    mine = next((e for e in entries if e.id == id), None)
    if mine is None or mine.admitted:
        return {"admitted": mine is not None}
    line = [e for e in order(entries) if e.kind == mine.kind]
    rank = next(i for i, e in enumerate(line) if e.id == id)
    ahead = line[rank - 1] if rank else None
    return {"admitted": False, "rank": rank + 1, "what": mine.what, "reason": reasons.get(id, ""),
            "ahead": None if ahead is None else {"label": ahead.label, "priority": ahead.priority,
                                                 "waited": max(0.0, now - ahead.arrival)}}


def describe(state: dict[str, Any]) -> str:
    """'waiting for 2 x v6e-16: 2nd in line behind dag.task (priority 5, waiting 40 s)'."""
    ahead = state.get("ahead")
    where = f"{ordinal(state['rank'])} in line"
    if ahead:
        where += f" behind {ahead['label']} (priority {ahead['priority']}, waiting {ahead['waited']:.0f} s)"
    reason = state.get("reason", "")
    if reason.startswith("first in line; "):
        where += f" ({reason.removeprefix('first in line; ')})"
    elif reason:
        where += f"; {reason}"
    return f"waiting for {state['what']}: {where}"


def format_queue(rows: list[dict[str, Any]], now: float | None = None) -> str:
    """The queue as a table, in order: rank, state, priority, team, waited, what, step."""
    now = time.time() if now is None else now
    lines = [f"{'rank':>4}  {'state':<8}  {'priority':>8}  {'team':<12}  {'waited':>8}  {'waits for':<14}  step"]
    for i, row in enumerate(rows, 1):
        waited = (row.get("admitted_at") or now) - row["arrival"]
        lines.append(f"{i:>4}  {'running' if row['admitted'] else 'waiting':<8}  {row['priority']:>8}  "
                     f"{row.get('team') or '-':<12}  {waited:>7.0f}s  {row['what']:<14}  {row['label']}")
    if not rows:
        lines.append("(nobody waits)")
    return "\n".join(lines)
