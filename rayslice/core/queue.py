"""The admission queue's rules: who may reserve next, in what order, and how to say where a step stands.

Pure: no ray here. The cluster side (`rayslice.cluster.queue`) keeps the waiting requests in
one named Ray actor per cluster and applies `plan` to them; the CLI prints `format_queue`.

Order: priority (higher first), then arrival (earlier first). Policies (Kueue's names):

- ``strict``: a request that cannot start holds back every later one that draws on the same
  capacity: its own kind, and, where an autoscaler adds capacity, every kind of its family (one
  TPU generation, or one accelerator resource), which share the cloud's quota. Slice types
  already there are separate: nobody passes it on capacity it could use, and nothing else waits.
- ``best-effort`` (default): a later request may start on capacity the waiting one cannot
  use (a ``v6e-4`` while a ``2 x v6e-16`` waits), never on capacity it could (a one-slice
  ``v6e-16`` waits behind the ``2 x v6e-16``). A request waiting longer than ``aging_s`` is
  served strictly.

Teams: a request of a team with a quota (chips per slice type, or accelerators such as GPUs)
that would exceed it borrows: it starts only when no request within its quota waits for the
same capacity. Nothing is ever preempted. A team is a path (``research/vision``): a step counts
against the quota of its team and of every team above it. Who sets what (docs/security.md):
the settings are the cluster operator's, never a step's; a step's team is its connection's
``team`` extra, which the step may only narrow (`team_for`).

TPU chips (``AcceleratorRequest(resource="TPU")``) are planned against slices: the launcher
picks the slice type they run on (`chip_slice_type`), they count as that share of one such slice
(a slice holding any chip step is a slice in use), and they wait in that type's line.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rayslice.core.accelerators import AcceleratorRequest, StepRequest, TpuSliceRequest
from rayslice.core.exceptions import InvalidRequestError

Policy = Literal["best-effort", "strict"]
#: Kueue's names: "never" (the default), or "lower-priority": a request that cannot be admitted may
#: suspend running steps of lower priority that declared themselves preemptible.
Preemption = Literal["never", "lower-priority"]
#: Environment variable on the cluster with the queue's settings as JSON, for steps whose connection sets none.
SETTINGS_ENV = "RAYSLICE_QUEUE"


class QueueSettings(BaseModel):
    """A cluster's queue policy, set by its operator only: ``RAYSLICE_QUEUE`` on the head, or `rayslice queue --set`.

    Unknown fields are ignored, so a broker older than the settings' writer keeps working (`checked`
    is what refuses a typo where a person writes them).
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    policy: Policy = "best-effort"
    aging_s: float | None = Field(600.0, gt=0, description="best-effort: after this long a waiting request is "
                                                           "served strictly (None: never)")
    quotas: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description="team -> {slice type (chips) or accelerator resource (count): quota}, e.g. "
                    "{'research': {'v6e-16': 32, 'GPU': 2}}")

    max_capacity: dict[str, float] = Field(
        default_factory=dict,
        description="where an autoscaler adds capacity: slice type (slices) or accelerator resource (count) -> the "
                    "most the cluster can ever hold, e.g. {'v6e-16': 4, 'GPU': 16}; for autoscalers that do not "
                    "report their node groups to Ray. Set: a request of a kind it omits, or larger than its "
                    "maximum, is refused at once")

    max_priority: dict[str, int] = Field(
        default_factory=dict,
        description="team (or '*': every step) -> the highest priority its steps get; a step asking more is "
                    "queued at that, e.g. {'*': 10, 'oncall': 100}")

    preemption: Preemption = Field("never", description="'lower-priority': a waiting request that cannot be "
                                   "admitted suspends running preemptible steps of lower priority (docs/preemption.md)")
    preemption_grace_s: float = Field(30.0, ge=10, le=3600, description="the notice a suspended step gets: how "
                                      "long it may take to checkpoint before it is stopped (the launcher stops a "
                                      "step 3 s before its deadline, so at least 10 s)")

    def priority_of(self, priority: int, team: str | None) -> int:
        """A step's priority as queued: capped by its team's (or a team above it's) `max_priority`, else '*'."""
        caps = [self.max_priority[t] for t in (teams_above(team) if team else []) if t in self.max_priority]
        cap = min(caps) if caps else self.max_priority.get("*")
        return priority if cap is None else min(priority, cap)

    @classmethod
    def checked(cls, data: str | dict[str, Any], where: str) -> QueueSettings:
        """Settings a person wrote (`RAYSLICE_QUEUE`, `rayslice queue --set`): unknown keys are a clear error."""
        import json

        try:
            raw = json.loads(data) if isinstance(data, str) else data
            if not isinstance(raw, dict):
                raise ValueError("not an object")
            unknown = sorted(set(raw) - set(cls.model_fields))
            if unknown:
                raise ValueError(f"unknown key(s) {', '.join(unknown)}")
            return cls.model_validate(raw)
        except ValueError as exc:
            raise InvalidRequestError(
                f"{where} must be a JSON object like {{\"policy\": \"best-effort\" (or \"strict\"), \"aging_s\": 600, "
                f"\"quotas\": {{\"research\": {{\"v6e-16\": 32, \"GPU\": 2}}}}}}: {exc}") from None


#: What a team name may be: path parts of letters, digits, '.', '_', '-', joined by '/'.
TEAM_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$"


def team_for(platform: str | None, asked: str | None, task: str = "the step") -> str | None:
    """The team a step counts against: its connection's ``team`` extra (the platform's), narrowed by the step.

    A step may name its connection's team or a team under it (``research/vision`` under ``research``),
    never another one; on a connection without a team it may name none, since a name it chose itself
    would let it pick whose quota it uses.
    """
    if asked is None or asked == platform:
        return platform
    if platform is None:
        raise InvalidRequestError(
            f"team={asked!r} of {task}: teams are set by the platform, not by a step; this `ray` connection names "
            "no team (its `team` extra), so its steps count against none. Ask the cluster's operator for a "
            "connection with your team.")
    if not asked.startswith(platform + "/"):
        raise InvalidRequestError(
            f"team={asked!r} of {task}: its connection belongs to team {platform!r}; a step may only narrow that "
            f"(e.g. team={platform + '/vision'!r}), never name another team.")
    return asked


def teams_above(team: str) -> list[str]:
    """'a/b/c' -> ['a', 'a/b', 'a/b/c']: every team whose quota a step of `team` counts against."""
    parts = team.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def chip_slice_type(count: float, accelerator_type: str | None,
                    slice_types: dict[str, tuple[int, int]]) -> str | None:
    """The slice type a TPU-chip step runs on: the smallest whose hosts hold `count` chips.

    `slice_types`: pod type -> (chips per host, chips per slice), of the cluster's slices.
    `accelerator_type` ("TPU-V6E") narrows them to one generation. The smallest slice, so a chip
    step sits on a single-host slice before it takes a host of a multi-host one. None: none fits.
    """
    fitting = [(per_slice, pod_type) for pod_type, (per_host, per_slice) in slice_types.items()
               if per_host >= count and (accelerator_type is None
                                         or f"TPU-{pod_type.split('-')[0].upper()}" == accelerator_type.upper())]
    return min(fitting)[1] if fitting else None


@dataclass
class Entry:
    """One step's place: what it waits for, its rank, and whether it was admitted."""

    id: str
    label: str  # dag.task (or the submission id outside Airflow)
    family: str  # "TPU-<generation>" ("TPU-v6e"), or the accelerator resource ("GPU")
    kind: str  # the slice type ("v6e-16"), or the accelerator resource
    amount: float  # slices, or accelerators
    chips: float  # what counts against a team's quota: chips, or accelerators
    what: str  # "2 x v6e-16"
    priority: int = 0
    team: str | None = None
    arrival: float = field(default_factory=time.time)
    admitted: bool = False
    admitted_at: float | None = None
    part: bool = False  # TPU chips on one host of a slice: `amount` is the share of the slice
    dag: str = ""  # deployment/dag: whose log may name this step (others read "a step of another DAG")
    preemptible: bool = False  # a higher-priority request may suspend it (policy `preemption: lower-priority`)
    # Elastic (`num_slices=(min, max)`): the fewest and most slices; `amount` is the most until admitted, then
    # what it was granted. `elastic_at`: from then on (epoch s) it starts on what is free rather than wait for all.
    min_amount: float = 0.0
    max_amount: float = 0.0
    elastic_at: float = 0.0
    grows: bool = True  # whether it may be offered more slices while it runs (not a command step)
    # Between two attempts of one step (suspended, stopped to grow, or retried after a lost host): it keeps its
    # place in line (its arrival) but is not admitted until its launcher rejoins with what the next attempt asks
    # for; meanwhile nobody it outranks passes it (`plan_lines`), so the capacity it released goes only to
    # requests ranked ahead of it.
    rejoining: bool = False

    @property
    def elastic(self) -> bool:
        return 0 < self.min_amount < self.max_amount

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Entry:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def entry_for(request: StepRequest, *, id: str, label: str, priority: int = 0, team: str | None = None,
              arrival: float | None = None, chips_on: tuple[str, int] | None = None,
              preemptible: bool = False, most_slices: int | None = None, least_slices: int | None = None) -> Entry:
    """The queue entry of a step's request.

    `chips_on`: for TPU chips, the slice type they will run on and its chips per slice
    (`chip_slice_type`): the entry then waits in that type's line, as that share of one slice.
    An elastic request: `most_slices`, it asks for at most this many now (the slices left after a
    loss; it may still grow to its max later); `least_slices`, at least this many (what it held
    before it stopped to grow), never more than it may ask for.
    """
    arrival = time.time() if arrival is None else arrival
    if isinstance(request, TpuSliceRequest):
        least = request.min_slices or request.num_slices
        most = request.num_slices if most_slices is None else max(min(most_slices, request.num_slices), least)
        chips = request.hosts_per_slice * most * request.chips_per_host
        entry = Entry(id=id, label=label, family=f"TPU-{request.version}", kind=request.pod_type,
                      amount=most, chips=chips, what=f"{most} x {request.pod_type}",
                      priority=priority, team=team, arrival=arrival, preemptible=preemptible)
        if request.min_slices is not None:
            entry.min_amount = min(max(least, least_slices or 0), most)
            entry.max_amount = request.num_slices
            entry.elastic_at = arrival + request.wait_for_all_s
            entry.what = f"{request.min_slices}-{request.num_slices} x {request.pod_type}"
        return entry
    assert isinstance(request, AcceleratorRequest)
    if request.resource == "TPU" and chips_on is not None:
        pod_type, per_slice = chips_on
        return Entry(id=id, label=label, family=f"TPU-{pod_type.split('-')[0]}", kind=pod_type,
                     amount=request.count / per_slice,
                     chips=request.count, what=f"{request.count:g} TPU chips of a {pod_type}", priority=priority,
                     team=team, arrival=arrival, part=True, preemptible=preemptible)
    return Entry(id=id, label=label, family=request.resource, kind=request.resource, amount=request.count,
                 chips=request.count, what=f"{request.count:g} {request.resource}", priority=priority, team=team,
                 arrival=arrival, preemptible=preemptible)


def rank_key(e: Entry) -> tuple[int, float, str]:
    """Where an entry stands: priority (higher first), then arrival, then id (unique: no ties)."""
    return (-e.priority, e.arrival, e.id)


def order(entries: list[Entry]) -> list[Entry]:
    """Waiting entries by rank: priority (higher first), then arrival."""
    return sorted((e for e in entries if not e.admitted), key=rank_key)


#: One line per kind: its waiting entries in rank order, each with its `rank_key`.
Lines = dict[str, list[tuple[tuple[int, float, str], Entry]]]


def lines_of(entries: list[Entry]) -> Lines:
    lines: Lines = {}
    for e in order(entries):
        lines.setdefault(e.kind, []).append((rank_key(e), e))
    return lines


class Devices:
    """An accelerator resource device by device (Ray's GPUs): a fraction fits on one device, a whole request on
    whole free devices of one node.

    Ray gives a 0.5 and a 0.75 GPU two devices, and a 1-GPU step waits for a device nobody holds any of,
    so counting the cluster's sum would admit steps Ray cannot place. Fractions are packed best-fit
    (the fullest device they fit on), as Ray's raylet packs them. A whole request more than any node
    has is refused when it asks (`refusal`), so it never holds up the steps behind it.
    """

    def __init__(self, per_node: list[float]) -> None:
        self.free = [[1.0] * int(n) for n in per_node]

    def place(self, amount: float, take: bool = True) -> bool:
        """Whether `amount` fits now; `take`: count it as held where it fits."""
        if amount < 1:
            fits = [(free, n, d) for n, node in enumerate(self.free) for d, free in enumerate(node)
                    if free >= amount - 1e-9]
            if not fits:
                return False
            _, n, d = min(fits)
            if take:
                self.free[n][d] -= amount
            return True
        whole = int(round(amount))
        nodes = [(sum(free >= 1 - 1e-9 for free in node), n) for n, node in enumerate(self.free)]
        nodes = [(count, n) for count, n in nodes if count >= whole]
        if not nodes:
            return False
        if take:
            node = self.free[min(nodes)[1]]
            for d in [d for d, free in enumerate(node) if free >= 1 - 1e-9][:whole]:
                node[d] = 0.0
        return True


def refusal(e: Entry, totals: dict[str, float], autoscaled: set[str],
            devices: dict[str, list[float]] | None = None) -> str | None:
    """Why `e` can never run where an autoscaler bounds its kind, or on fixed nodes none of which has as many
    devices as it asks for on one node (None: it may), for a clear error at once."""
    nodes = (devices or {}).get(e.kind)
    if nodes and e.kind not in autoscaled and not e.part and e.amount > max(nodes) + 1e-9:
        sizes = ", ".join(f"{n:g}" for n in sorted(nodes, reverse=True))
        return (f"{e.what} can never run on this cluster: a step's {e.kind} must be on one node, and its largest "
                f"{e.kind} node has {max(nodes):g} (nodes: {sizes}); ask for at most {max(nodes):g}, or add a bigger "
                "node")
    total = totals.get(e.kind, 0)
    least = e.min_amount if e.elastic else e.amount  # an elastic request runs on its least
    if e.kind not in autoscaled or math.isinf(total) or least <= total + 1e-9:
        return None
    if total <= 0:
        return (f"{e.what} can never run on this cluster: none of its autoscaler's node groups provides {e.kind} "
                "(the cluster's node groups, or its operator's max_capacity in the queue settings)")
    return (f"{e.what} can never run on this cluster: its autoscaler holds at most {total:g} {e.kind} "
            "(the cluster's node groups, or its operator's max_capacity in the queue settings)")


#: Why an entry between two attempts of its step waits (never "first in line...": it suspends nobody).
REJOINING = "resuming: between two attempts, it keeps its place until its launcher asks again"


@dataclass
class Plan:
    """What `plan` decided: who is admitted now, and why each other entry waits."""

    admit: list[str]
    reasons: dict[str, str]  # id -> why it still waits (absent: behind the line of its own kind)
    amounts: dict[str, float] = field(default_factory=dict)  # elastic entries admitted: how many slices each got


def plan(entries: list[Entry], totals: dict[str, float], settings: QueueSettings, now: float | None = None,
         autoscaled: set[str] | None = None, devices: dict[str, list[float]] | None = None,
         intact: dict[str, float] | None = None) -> Plan:
    """Who of the waiting entries may reserve now (`plan_lines` over `entries`' lines)."""
    return plan_lines(lines_of(entries), [e for e in entries if e.admitted], totals, settings, now,
                      autoscaled=autoscaled, devices=devices, intact=intact)


def plan_lines(lines: Lines, running: list[Entry], totals: dict[str, float], settings: QueueSettings,
               now: float | None = None, autoscaled: set[str] | None = None,
               devices: dict[str, list[float]] | None = None, intact: dict[str, float] | None = None) -> Plan:
    """Who of the waiting entries may reserve now, walking the lines in rank order as one queue.

    `totals`: the cluster's capacity per kind (slices of a type, accelerators of a resource); for a
    kind in `autoscaled` (default: those whose total is infinite) the most an autoscaler can make of
    it, or infinity where nothing says. A fixed kind the cluster holds too little of counts as
    fitting (Ray waits for hosts that come back). Slices held by chip steps count whole: their
    shares, rounded up (the launcher packs them onto as few as it can). `devices`: for accelerator
    kinds of fixed nodes, each node's device count: those are counted device by device (`Devices`).
    `intact`: slice type -> its slices with every host alive (default: `totals`). An elastic request is
    granted against these only: it starts on what it is granted, and a slice missing a host cannot be
    reserved (a fixed request waits for the hosts to come back instead). An entry `rejoining` (its
    step between two attempts) keeps its place and is admitted to nothing until its launcher rejoins:
    its line stops at it, as at any entry that waits.

    A line stops at its first entry that must wait (nobody of its kind passes it), so the walk costs
    what is admitted and what is first in line, not the queue's length: the lines' heads are merged
    in rank order (a heap), and a blocked line is dropped. Over-quota entries are set aside as they
    are met and borrow afterwards only what no line within quota waits for.
    """
    import heapq

    now = time.time() if now is None else now
    autoscaled = {k for k, v in totals.items() if math.isinf(v)} if autoscaled is None else autoscaled
    packs = {kind: Devices(nodes) for kind, nodes in (devices or {}).items() if kind not in autoscaled}
    used: dict[str, float] = {}  # kind -> whole slices / accelerators
    shared: dict[str, float] = {}  # kind -> shares of slices that chip steps hold
    team_used: dict[tuple[str, str], float] = {}  # (team, or a team above it; kind) -> chips

    def in_use(kind: str) -> float:
        return used.get(kind, 0) + math.ceil(shared.get(kind, 0) - 1e-9)

    def count(e: Entry, amount: float | None = None) -> None:
        amount = e.amount if amount is None else amount
        if e.kind in packs:
            packs[e.kind].place(amount)  # a running step Ray placed elsewhere (a node gone) counts in `used`
        pool = shared if e.part else used
        pool[e.kind] = pool.get(e.kind, 0) + amount
        for team in teams_above(e.team) if e.team else ():
            team_used[(team, e.kind)] = team_used.get((team, e.kind), 0) + e.chips * amount / e.amount

    for e in running:
        count(e)

    # (team, kind, chips) -> how far down its path the first team over its quota is: what a team uses only
    # grows during a plan, so an entry like one found over quota is over it too (a team's thousands of waiting
    # steps cost a lookup each), and only the teams above that one may have gone over since.
    found_over: dict[tuple[str | None, str, float], int] = {}

    def over_quota(e: Entry, amount: float | None = None) -> str | None:
        """The first team (the step's, or one above it, from the top) whose quota the entry would exceed, or None."""
        chips = e.chips if amount is None else e.chips * amount / e.amount
        if not e.team:
            return None
        key = (e.team, e.kind, chips)
        known = found_over.get(key)
        if known == 0:
            return e.team.split("/", 1)[0]
        path = teams_above(e.team)
        for depth, team in enumerate(path if known is None else path[:known + 1]):
            quota = settings.quotas.get(team)
            if quota is not None and team_used.get((team, e.kind), 0) + chips > quota.get(e.kind, 0) + 1e-9:
                found_over[key] = depth
                return team
        return None

    def least(e: Entry) -> float | None:
        """What an entry asks for at the least: an elastic entry's fewest slices (None: its amount)."""
        return e.min_amount if e.elastic else None

    def fits(e: Entry, amount: float | None = None) -> bool:
        amount = e.amount if amount is None else amount
        total = totals.get(e.kind, 0)
        if e.elastic and intact is not None and e.kind not in autoscaled:
            total = min(total, intact.get(e.kind, total))
        if e.kind in packs:
            return packs[e.kind].place(amount, take=False)
        if e.part:
            return total == math.inf or used.get(e.kind, 0) + math.ceil(shared.get(e.kind, 0) + amount - 1e-9) \
                <= total + 1e-9
        if e.kind in autoscaled:  # as many as its node groups can hold (`refusal`: never more than that)
            return in_use(e.kind) + amount <= total + 1e-9
        if e.elastic:  # on the slices there are: a lost slice is not waited for (below its least, it waits)
            return in_use(e.kind) + amount <= total + 1e-9
        return total < amount or in_use(e.kind) + amount <= total + 1e-9

    def elastic_grant(e: Entry, alone: bool) -> float | None:
        """How many slices an elastic entry at the head of its line starts on now, or None: it waits.

        It asks for its least (`min_amount`) and takes more only when nobody waits behind it: then all
        it may have at once, or, once `elastic_at` passed, as many as are free.
        """
        most = e.amount if alone else e.min_amount  # `amount`: the most it asks for now (a loss may lower it)
        n = int(most)
        while n >= e.min_amount and not (fits(e, n) and over_quota(e, n) is None):
            n -= 1
        if n < e.min_amount:
            return None
        return float(n) if not alone or n >= e.amount or now >= e.elastic_at else None

    def held_back(e: Entry) -> Entry | None:
        """The entry served strictly that `e` may not pass: one of its family, where both draw on one pool.

        Kinds an autoscaler adds share a pool (the cloud's quota of a TPU generation, or of a
        resource); slices already there do not: a v6e-4 never takes what a 2 x v6e-16 waits for.
        """
        blocker = blocked_families.get(e.family)
        if blocker is None or blocker.kind == e.kind:
            return blocker
        return blocker if e.kind in autoscaled and blocker.kind in autoscaled else None

    admit: list[str] = []
    reasons: dict[str, str] = {}
    amounts: dict[str, float] = {}
    blocked_kinds: dict[str, Entry] = {}  # kind -> the first entry that waits for it
    blocked_families: dict[str, Entry] = {}  # family -> the first entry served strictly that waits
    borrowers: list[Entry] = []  # and the team over its quota of each (two lists: no tuple per entry)
    over_teams: list[str] = []
    heads = [(line[0][0], kind, 0) for kind, line in lines.items() if line]
    heapq.heapify(heads)
    while heads:
        _, kind, i = heapq.heappop(heads)
        line = lines[kind]
        e = line[i][1]
        team = over_quota(e, least(e))
        if team is not None:
            # Set aside, with every entry over a quota right behind it: they change no count until the
            # borrowing below (kinds do not share counts), so the next entry within quota keeps its turn.
            borrowers.append(e)
            over_teams.append(team)
            i += 1
            while i < len(line):
                f = line[i][1]
                if not (f.team == e.team and f.chips == e.chips and not f.elastic and not e.elastic):  # like e
                    team = over_quota(f, least(f))
                    if team is None:
                        break
                    e = f
                borrowers.append(f)
                over_teams.append(team)
                i += 1
            if i < len(line):
                heapq.heappush(heads, (line[i][0], kind, i))
            continue
        granted = elastic_grant(e, alone=i + 1 == len(line)) if e.elastic else None
        blocker = held_back(e)
        if not e.rejoining and blocker is None and (granted is not None if e.elastic else fits(e)):
            admit.append(e.id)
            if granted is not None:
                amounts[e.id] = granted
            count(e, granted)
        else:  # it waits, and so does its whole line behind it
            if e.rejoining:
                reasons[e.id] = REJOINING
            elif blocker is None and e.elastic and fits(e, e.min_amount) and now < e.elastic_at:
                reasons[e.id] = (f"first in line; waiting up to {e.elastic_at - now:.0f} s more for all "
                                 f"{e.amount:g} {e.kind} ({in_use(e.kind):g} of {totals.get(e.kind, 0):g} in use) "
                                 f"before it starts on fewer")
            elif blocker is None:
                reasons[e.id] = f"first in line; {in_use(e.kind):g} of {totals.get(e.kind, 0):g} {e.kind} in use"
            else:
                reasons[e.id] = f"held back by {seen_by(blocker, e)} (waiting for {blocker.what}, served strictly)"
            blocked_kinds[kind] = e
            if settings.policy == "strict" or (settings.aging_s is not None and now - e.arrival >= settings.aging_s):
                blocked_families.setdefault(e.family, e)
            continue
        if i + 1 < len(line):
            heapq.heappush(heads, (line[i + 1][0], kind, i + 1))
    # Once a kind is blocked nothing more of it is admitted, so a team's use of it, and the reason, stay put.
    whys: dict[tuple[str, str], str] = {}
    for e, team in zip(borrowers, over_teams, strict=True):  # over quota: only on what nobody within quota waits for
        if e.kind in blocked_kinds:
            why = whys.get((team, e.kind))
            if why is None:
                quota = settings.quotas[team].get(e.kind, 0)
                why = whys[(team, e.kind)] = (
                    f"team {team} over its quota ({team_used.get((team, e.kind), 0):g} of {quota:g} {e.kind} "
                    "in use), borrowing only what nobody within quota waits for")
            reasons[e.id] = why
            continue
        smallest = least(e)  # a borrower takes no more than its least
        if e.rejoining or held_back(e) is not None or not fits(e, smallest):
            blocked_kinds[e.kind] = e
            quota = settings.quotas[team].get(e.kind, 0)
            reasons[e.id] = whys[(team, e.kind)] = (
                f"team {team} over its quota ({team_used.get((team, e.kind), 0):g} of {quota:g} {e.kind} in use), "
                "borrowing only what nobody within quota waits for")
            if e.rejoining:
                reasons[e.id] = REJOINING
            continue
        admit.append(e.id)
        if smallest is not None:
            amounts[e.id] = smallest
        count(e, smallest)
    return Plan(admit=admit, reasons=reasons, amounts=amounts)


def growth(running: list[Entry], lines: Lines, totals: dict[str, float], settings: QueueSettings,
           autoscaled: set[str] | None = None, offered: Mapping[str, int] | None = None) -> dict[str, int]:
    """Running elastic steps that may grow now: id -> how many more slices they may take.

    Only onto slices that are there and free (not what an autoscaler might add), of a kind nobody
    waits for, within the team's quota; the earliest admitted first. The step hears the offer as a
    notice, and may checkpoint and resume on more (`rayslice.cluster.queue`). `totals`: the slices
    there are, whole (a slice missing hosts is no room to grow into). `offered`: steps already told,
    and how many more each was offered: not offered again, and those slices count as taken.
    """
    offered = offered or {}
    autoscaled = {k for k, v in totals.items() if math.isinf(v)} if autoscaled is None else autoscaled
    whole: dict[str, float] = {}
    shares: dict[str, float] = {}
    team_used: dict[tuple[str, str], float] = {}
    for e in running:
        pool = shares if e.part else whole
        taken = e.amount + offered.get(e.id, 0)
        pool[e.kind] = pool.get(e.kind, 0) + taken
        for team in teams_above(e.team) if e.team else ():
            team_used[(team, e.kind)] = team_used.get((team, e.kind), 0) + e.chips * taken / e.amount
    free = {kind: totals.get(kind, 0) - whole.get(kind, 0) - math.ceil(shares.get(kind, 0) - 1e-9)
            for kind in {e.kind for e in running}}
    grow: dict[str, int] = {}
    for e in sorted(running, key=lambda e: (e.admitted_at or e.arrival, e.id)):
        if not e.elastic or not e.grows or e.id in offered or e.amount >= e.max_amount or e.kind in autoscaled \
                or lines.get(e.kind):
            continue
        more = int(min(e.max_amount - e.amount, free[e.kind] + 1e-9))
        per_slice = e.chips / e.amount
        for team in teams_above(e.team) if e.team else ():
            quota = settings.quotas.get(team)
            if quota is not None:
                room = quota.get(e.kind, 0) - team_used.get((team, e.kind), 0)
                more = min(more, int((room + 1e-9) // per_slice))
        if more >= 1:
            grow[e.id] = more
            free[e.kind] -= more
            for team in teams_above(e.team) if e.team else ():
                team_used[(team, e.kind)] = team_used.get((team, e.kind), 0) + more * per_slice
    return grow


def victims(waiting: Entry, running: list[Entry], total: float, suspending: frozenset[str] = frozenset(),
            devices: list[float] | None = None) -> list[Entry]:
    """Which running steps to suspend so that `waiting` fits (policy `preemption: lower-priority`); [] for none.

    Candidates: running whole-slice or accelerator steps of the same kind, declared preemptible, of
    lower priority than `waiting`, not already being suspended. They are taken lowest priority first,
    then the youngest (latest admitted) first, until the request fits; then each taken one that is not
    needed after all is given back (newest taken first), so no more steps are suspended than the
    request needs. If all candidates together would not make room, nothing is suspended. Capacity
    already being freed (`suspending`) counts as free. `devices` (each node's device count, for an
    accelerator of fixed nodes): the request must fit on one node's devices, as `plan_lines` admits
    it, with the running steps packed as it packs them (`Devices`, in `running`'s order, as given to it);
    else what the kind holds cluster-wide counts.
    """
    if waiting.part or math.isinf(total):
        return []
    need = waiting.min_amount if waiting.elastic else waiting.amount  # an elastic request asks for its least
    held = [e for e in running if e.kind == waiting.kind]  # in the order `plan_lines` packs them (admission order)

    def room(gone: set[str]) -> bool:
        staying = [e for e in held if e.id not in gone]
        if devices is not None:
            pack = Devices(devices)
            for e in staying:
                pack.place(e.amount)
            return pack.place(need, take=False)
        free = total - sum(e.amount for e in staying if not e.part) \
            - math.ceil(sum(e.amount for e in staying if e.part) - 1e-9)
        return free + 1e-9 >= need

    gone = set(suspending)
    if room(gone):
        return []
    candidates = sorted((e for e in held if e.preemptible and not e.part and e.priority < waiting.priority
                         and e.id not in suspending), key=lambda e: (e.priority, -(e.admitted_at or e.arrival), e.id))
    chosen: list[Entry] = []
    for e in candidates:
        chosen.append(e)
        if room(gone | {c.id for c in chosen}):
            break
    else:
        return []
    for e in reversed(chosen[:-1]):  # the last one taken made it fit; an earlier one may be unneeded now
        if room(gone | {c.id for c in chosen if c is not e}):
            chosen.remove(e)
    return chosen


def seen_by(other: Entry, reader: Entry) -> str:
    """`other`'s label as `reader`'s task log may show it: only within one DAG (a log's readers may not read others)."""
    return other.label if other.dag == reader.dag else "a step of another DAG"


def ranks(entries: list[Entry]) -> dict[str, tuple[int, Entry | None]]:
    """Every waiting entry's place in its line (the waiting entries of its kind): rank from 1, and the one ahead."""
    found: dict[str, tuple[int, Entry | None]] = {}
    for line in lines_of(entries).values():
        for i, (_, e) in enumerate(line):
            found[e.id] = (i + 1, line[i - 1][1] if i else None)
    return found


def standing(entries: list[Entry], id: str, reasons: dict[str, str], now: float | None = None) -> dict[str, Any]:
    """Where a waiting entry stands in its line (the waiting entries of its kind): rank, the one ahead, why."""
    now = time.time() if now is None else now
    mine = next((e for e in entries if e.id == id), None)
    if mine is None or mine.admitted:
        return {"admitted": mine is not None}
    rank, ahead = ranks(entries)[id]
    return {"admitted": False, "rank": rank, "what": mine.what, "reason": reasons.get(id, ""),
            "ahead": None if ahead is None else {"label": seen_by(ahead, mine), "priority": ahead.priority,
                                                 "waited": max(0.0, now - ahead.arrival)}}


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


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
