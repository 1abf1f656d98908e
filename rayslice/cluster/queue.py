"""One admission queue per cluster: a detached, restartable Ray actor (the broker) and the launchers' places in it.

Ray serves waiting placement groups in no order, so a 2-slice request can wait forever behind a
stream of 1-slice ones. Every launcher therefore takes a place in the broker's queue before it
reserves, and reserves only once the broker admits it (`rayslice.core.queue.plan`: priority,
arrival, policy, team quotas). An admitted step counts against its capacity until it leaves the
queue (after its release), so the broker never admits a later request onto capacity the head of
the line was admitted to.

Nothing is stored beside Ray: every launcher heartbeats its whole entry (arrival time included)
from a thread. The broker forgets a launcher not heard from for a few beats (a launcher SIGKILLed
while it waits). A broker created afresh (Ray restarted it, or it was killed and the next launcher
made a new one) while launchers held places admits nothing for `RECOVERY_S` and is rebuilt by the
heartbeats, with every place kept: a GCS key (`BUSY_KEY`) says whether the queue held anyone.

The policy and quotas are the cluster operator's (docs/security.md): `RAYSLICE_QUEUE` in the head
node's environment, or the GCS key `SETTINGS_KEY` that `rayslice queue --set` writes; nothing a
step sends changes them.

Cost: a heartbeat is O(1) (its entry refreshed, its standing read from the last plan). The plan runs
at once after a change when the last one is `PLAN_S` old, else on a later call (arrivals batched),
and at least every `REPLAN_S`. Entries far back in their line beat every `SLOW_BEAT_S` or more
(`SLOW_BEATS_PER_S` in all) instead of `HEARTBEAT_S` (the broker says so in its answer), and a place
expires after three missed beats, counted on the broker's progress rather than its clock: the broker
sends itself a probe (a call stamped with its own monotonic clock) through its own queue, and a
place expires only once a probe sent after the place's deadline has come through, with no beat of
it before. A busy broker's backlog (a burst of leaves, thousands of beats) therefore never expires a
launcher whose beat waits in that backlog, and no one's clock (a launcher's set ahead, the head's
stepped by NTP) moves the deadline: only the broker's monotonic clock and its queue's order count.
"""

from __future__ import annotations

import bisect
import json
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic
import ray

from rayslice.cluster import autoscaler, host_env
from rayslice.core import queue as rules
from rayslice.core.accelerators import VISIBLE_DEVICES_ENV, AcceleratorRequest
from rayslice.core.exceptions import CapacityTimeoutError, UnsatisfiableRequestError
from rayslice.core.step import StepSpec

BROKER_NAME = "rayslice-broker-v1"
NAMESPACE = "rayslice"
#: How often a launcher near the front of its line (or running) reports its entry.
HEARTBEAT_S = 0.5
#: How often a launcher further back reports it (it cannot be admitted before the `FRONT` ahead of it):
#: at least this, longer in a long queue, so that slow beats come at most SLOW_BEATS_PER_S a second.
SLOW_BEAT_S = 5.0
SLOW_BEATS_PER_S = 200
MAX_BEAT_S = 60.0
#: Entries up to this rank in their line (and running ones) beat every HEARTBEAT_S.
FRONT = 16
#: A launcher not heard from for this long, or three of its beats, has lost its place.
EXPIRE_S = 3.0
#: A probe not back after this long is taken as lost, and another is sent.
PROBE_LOST_S = 30.0
#: An offer to grow that the step has not acted on after this long is taken back (and not made again as long).
GROW_OFFER_S = 600.0
#: A step between two attempts (`rejoining`) stops its line this long at most: its launcher ends the suspended
#: attempt's hosts (up to gang's wait plus HOSTS_END_S), drains their logs and lists its checkpoints first. A
#: launcher alive but stuck past it (a hung listing) no longer keeps everyone behind it waiting; it keeps its arrival.
REJOIN_S = 180.0
#: After a fresh start while launchers held places, the broker admits nothing this long (they re-register).
RECOVERY_S = 3.0
#: How long the broker reuses its reading of the cluster's capacity, and of its settings.
TOTALS_TTL_S = 2.0
#: Plans at most this often (changes in between are planned together), and at least every REPLAN_S (aging).
PLAN_S = 0.05
REPLAN_S = 1.0
#: GCS keys (namespace NAMESPACE): the operator's settings, and whether the queue holds anyone.
SETTINGS_KEY = "queue-settings"
BUSY_KEY = "queue-busy"
RESTARTS_KEY = "queue-restarts"
POD_TYPE_LABEL = "ray.io/tpu-pod-type"
SLICE_NAME_LABEL = "ray.io/tpu-slice-name"
WORKER_ID_LABEL = "ray.io/tpu-worker-id"


def _kv_get(key: str) -> bytes | None:
    from ray.experimental.internal_kv import _internal_kv_get

    return _internal_kv_get(key, namespace=NAMESPACE)


def _kv_put(key: str, value: bytes) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key, value, overwrite=True, namespace=NAMESPACE)


def operator_settings() -> rules.QueueSettings:
    """The cluster operator's settings: `rayslice queue --set` (GCS), else `RAYSLICE_QUEUE` here, else defaults.

    Read leniently (unknown fields ignored): a newer CLI's settings must not stop an older broker.
    A value that cannot be read at all counts as unset, and says so once in the broker's log.
    """
    import os

    for source, read in (("rayslice queue --set", lambda: _kv_get(SETTINGS_KEY)),
                         (rules.SETTINGS_ENV, lambda: os.environ.get(rules.SETTINGS_ENV))):
        try:
            raw = read()
            if raw:
                return _settings_without_bad_fields(json.loads(raw), source)
        except Exception as exc:
            print(f"[rayslice] queue settings from {source} ignored: {exc}", flush=True)
    return rules.QueueSettings()


def _settings_without_bad_fields(values: dict[str, Any], source: str) -> rules.QueueSettings:
    """The settings, with only the fields that fail today's rules set back to their defaults.

    A value stored under an older, looser rule (a grace below today's minimum) must not take the
    quotas and the policy with it.
    """
    try:
        return rules.QueueSettings.model_validate(values)
    except pydantic.ValidationError as exc:
        bad = {str(error["loc"][0]) for error in exc.errors() if error.get("loc")}
        if not bad or not bad <= set(values):
            raise
        print(f"[rayslice] queue settings from {source}: {', '.join(sorted(bad))} ignored (not valid now: "
              f"{exc.errors()[0]['msg']}); the other settings hold", flush=True)
        return rules.QueueSettings.model_validate({k: v for k, v in values.items() if k not in bad})


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class Broker:
    """The queue: entries by id, each with when its launcher's place expires. Calls run one at a time."""

    def __init__(self) -> None:
        self.entries: dict[str, rules.Entry] = {}
        self.lines: rules.Lines = {}  # kind -> its waiting entries in rank order (kept sorted as they come and go)
        self.running: dict[str, rules.Entry] = {}  # the admitted entries
        self.expires: dict[str, float] = {}  # id -> (monotonic) time its place is lost unless heard from before
        self.settings = operator_settings()
        self.reasons: dict[str, str] = {}
        self.suspending: dict[str, str] = {}  # running id -> why a waiting request of higher priority suspends it
        self.told: set[str] = set()  # the suspending ids whose launchers heard it (no taking those back)
        self.growing: dict[str, Offer] = {}  # running elastic id -> its offer to grow (more slices free)
        self.told_grow: set[str] = set()  # the growing ids whose launchers heard the offer
        self.no_offer_until: dict[str, float] = {}  # id -> (monotonic) not offered again before: it let one lapse
        with warnings.catch_warnings():  # Ray's own property reads its deprecated `actor_id`: no warning for users
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        held = _kv_get(BUSY_KEY) == b"1"  # a broker before this one (killed, or lost with its node) had places
        self.hold_until = time.monotonic() + RECOVERY_S if restarted or held else 0.0
        self.restarts = int(_kv_get(RESTARTS_KEY) or 0) + (restarted or held)  # over every broker's life
        if restarted or held:
            _kv_put(RESTARTS_KEY, str(self.restarts).encode())
        self._busy = held
        now = time.monotonic()
        self._totals: tuple[float, Any] = (0.0, ({}, set(), {}))
        self._settings_read = now
        self._planned = self._swept = 0.0
        self._dirty = True
        self.plan_ms: list[float] = []  # the last plans' durations (`stats`)
        self.expired = 0  # places lost to silence (`stats`)
        self.lag = 0.0  # how long the last probe waited in the broker's queue (a busy broker's backlog; `stats`)
        self.caught_up = 0.0  # every call queued before this (monotonic) time has run: the sweep's clock
        self._probes: list[float] = []  # when the probes on their way through the queue were sent (`caught_up_to`)
        self._known_devices: dict[str, list[float]] = {}  # each node's devices, dead nodes too (`refusal`)
        self._intact: dict[str, float] = {}  # slice type -> its slices with every host alive (room to grow into)
        self.rejoining_since: dict[str, float] = {}  # id -> (monotonic) since when it is between attempts

    def heartbeat(self, entry: dict[str, Any], settings: dict[str, Any] | None = None,
                  beat_s: float = HEARTBEAT_S, sent: float | None = None, suspended: str | None = None,
                  **newer: Any) -> dict[str, Any]:
        """Register or refresh a place (a re-registration keeps the arrival it carries); where it stands now.

        `settings` (sent by launchers before issue 38) is ignored: the policy is the operator's. `beat_s`:
        how often this launcher beats now. `sent` (the caller's clock, sent by earlier launchers) is ignored:
        a clock set ahead made live places behind a backlog expire. `suspended`: why a broker told this
        running step to suspend, as its launcher heard it: a broker made anew (which forgot it) restores it
        when the place re-registers, so it neither tells a second step to suspend for the same request nor
        counts the capacity being freed as held. Arguments from newer launchers are ignored.
        """
        mine = self.entries.get(entry["id"])
        if mine is None:  # a new place, or one a restart lost
            mine = rules.Entry.from_json(entry)
            if not mine.admitted:  # one that can never run is told so now, not after its capacity_timeout
                totals, autoscaled, _ = self._capacity({(mine.family, mine.kind)})
                # Nodes down now count: a step waiting for its big node must not fail when it re-registers.
                why = rules.refusal(mine, totals, autoscaled, self._known_devices)
                if why:
                    return {"admitted": False, "refused": why, "beat_s": HEARTBEAT_S}
            self.entries[mine.id] = mine
            mine.priority = self.settings.priority_of(mine.priority, mine.team)  # the operator's cap, if any
            if mine.rejoining:  # kept across a repeated requeue (`requeue`): its line stops at it for REJOIN_S at most
                self.rejoining_since.setdefault(mine.id, time.monotonic())
            if mine.admitted:
                self.running[mine.id] = mine
                if suspended:  # heard before this broker's time: it is checkpointing now (no taking it back)
                    self.suspending[mine.id] = str(suspended)
                    self.told.add(mine.id)
            else:
                bisect.insort(self.lines.setdefault(mine.kind, []), (rules.rank_key(mine), mine))
            self._dirty = True
            if not self._busy:  # at once: a broker killed a moment from now must know places were held
                self._busy = True
                _kv_put(BUSY_KEY, b"1")
        self._expire_after(mine.id, float(beat_s))
        self._tick()
        if mine.id not in self.entries:  # its deadline is ahead, so this sweep cannot drop it; if one did, re-register
            return self.heartbeat(entry, beat_s=beat_s)
        state = self._standing(mine)
        self._expire_after(mine.id, max(float(beat_s), state["beat_s"]))
        return state

    def caught_up_to(self, at: float) -> None:
        """A probe the broker sent itself at `at` (its monotonic clock) has come through its queue: every call
        queued before it has run. Plans nothing and sends no probe (that waits for the next real call).
        Any other call of it (a stray one, one from a past life of the broker) changes nothing. A probe
        taken as lost (resent) still counts when it comes back: a backlog longer than PROBE_LOST_S must
        not stop expiry."""
        if at not in self._probes:
            return
        self._probes = [p for p in self._probes if p > at]
        self.caught_up = max(self.caught_up, min(at, time.monotonic()))
        self.lag = time.monotonic() - at

    def _send_probe(self, at: float) -> None:
        """Queue `caught_up_to(at)` behind every call already waiting (a call to itself: not waited for)."""
        ray.get_runtime_context().current_actor.caught_up_to.remote(at)

    def _expire_after(self, id: str, beat_s: float) -> None:
        """Three beats from now (at the slower of what the launcher said and what it is told): the place
        expires once a probe sent after that comes through with no beat of it in between (`_tick`)."""
        self.expires[id] = time.monotonic() + max(EXPIRE_S, 3 * min(beat_s, MAX_BEAT_S))

    def leave(self, id: str, sent: float | None = None, **newer: Any) -> None:
        self._drop(id)
        self.expires.pop(id, None)
        self._tick()

    def requeue(self, entry: dict[str, Any], beat_s: float = HEARTBEAT_S, **newer: Any) -> dict[str, Any]:
        """Put a place back in its line as `entry` says, in one call: a step's running entry back to waiting
        (its attempt ended to resume: suspended, stopped to grow, a host lost), or a waiting one's request
        changed (its next attempt asks for what it asks now). The arrival it carries keeps its place.

        One call, so no plan ever sees the step out of the queue: the capacity it released goes only to
        requests ranked ahead of it (leaving and registering again let a later, lower-ranked step take it
        in between). A place this broker does not know (made anew meanwhile) is registered.
        """
        since = self.rejoining_since.get(entry["id"])  # a requeue sent again (a lost reply) extends nothing
        self._drop(entry["id"])
        if since is not None and entry.get("rejoining"):
            self.rejoining_since[entry["id"]] = since
        return self.heartbeat(entry, beat_s=beat_s)

    def set_settings(self, settings: dict[str, Any]) -> dict[str, Any]:
        """The operator's new settings (`rayslice queue --set`): kept in the GCS, so a new broker reads them too."""
        checked = rules.QueueSettings.checked(settings, "the queue settings")
        _kv_put(SETTINGS_KEY, checked.model_dump_json().encode())
        self.settings, self._settings_read, self._dirty = checked, time.monotonic(), True
        self._tick()
        return self.settings.model_dump()

    def snapshot(self, sent: float | None = None, **newer: Any) -> dict[str, Any]:
        """Every entry, running ones first, then the waiting ones in order; and the settings."""
        self._tick(force=True)
        running = sorted(self.running.values(), key=lambda e: e.admitted_at or 0)
        return {"entries": [{**e.to_json(), "reason": self.suspending.get(e.id) or self.reasons.get(e.id, "")}
                            for e in [*running, *rules.order(list(self.entries.values()))]],
                "settings": self.settings.model_dump(), "restarts": self.restarts}

    def stats(self) -> dict[str, Any]:
        """For the benchmark: the queue's size, the last plans' durations (ms), places lost to silence."""
        return {"entries": len(self.entries), "plan_ms": list(self.plan_ms), "expired": self.expired, "lag": self.lag}

    def _drop(self, id: str) -> None:
        e = self.entries.pop(id, None)
        if e is None:
            return
        self._dirty = True
        self.suspending.pop(id, None)
        self.told.discard(id)
        self.growing.pop(id, None)
        self.told_grow.discard(id)
        self.no_offer_until.pop(id, None)
        self.rejoining_since.pop(id, None)
        if self.running.pop(id, None) is None:
            self._unline(e)

    def _unline(self, e: rules.Entry) -> None:
        line = self.lines.get(e.kind, [])
        i = bisect.bisect_left(line, (rules.rank_key(e),))
        if i < len(line) and line[i][1] is e:
            del line[i]
        if not line:
            self.lines.pop(e.kind, None)

    def _standing(self, mine: rules.Entry) -> dict[str, Any]:
        """Where an entry stands in its line (O(log n)), and how often its launcher should beat."""
        if mine.admitted:
            if mine.id in self.suspending:  # its launcher sends its step a preemption notice with this grace
                self.told.add(mine.id)
                return {"admitted": True, "beat_s": HEARTBEAT_S, "suspend": self.suspending[mine.id],
                        "grace_s": self.settings.preemption_grace_s, "amount": mine.amount}
            if mine.id in self.growing:  # an elastic step may checkpoint and resume on more slices
                self.told_grow.add(mine.id)
                return {"admitted": True, "beat_s": HEARTBEAT_S, "suspend": self.growing[mine.id].why, "grow": True,
                        "amount": mine.amount}
            return {"admitted": True, "beat_s": HEARTBEAT_S, "amount": mine.amount}
        line = self.lines[mine.kind]
        i = bisect.bisect_left(line, (rules.rank_key(mine),))
        ahead = line[i - 1][1] if i else None
        return {"admitted": False, "rank": i + 1, "what": mine.what,
                "reason": "the queue is being rebuilt after a restart" if time.monotonic() < self.hold_until
                else self.reasons.get(mine.id, ""),
                "ahead": None if ahead is None else {"label": rules.seen_by(ahead, mine), "priority": ahead.priority,
                                                     "waited": max(0.0, time.time() - ahead.arrival)},
                "beat_s": HEARTBEAT_S if i < FRONT else
                min(MAX_BEAT_S, max(SLOW_BEAT_S, len(self.entries) / SLOW_BEATS_PER_S))}

    def _tick(self, force: bool = False) -> None:
        """Expire silent places (every HEARTBEAT_S), and plan when something changed (batched: PLAN_S)."""
        now = time.monotonic()
        if now - self._swept >= HEARTBEAT_S:
            self._swept = now
            for id in [id for id, at in self.expires.items() if at < self.caught_up]:  # not `now`: see the module
                self._drop(id)
                self.expires.pop(id, None)
                self.expired += 1
            if not self._probes or now - self._probes[-1] > PROBE_LOST_S:  # none on its way, or it looks lost
                self._probes = [*self._probes[-99:], now]
                try:
                    self._send_probe(now)
                except Exception:  # the next sweep tries again: places only expire later meanwhile
                    self._probes.pop()
            if bool(self.entries) != self._busy:  # only on a change: empty <-> not
                self._busy = bool(self.entries)
                _kv_put(BUSY_KEY, b"1" if self._busy else b"0")
            if now - self._settings_read >= TOTALS_TTL_S:
                self._settings_read = now
                self.settings = operator_settings()
        if now < self.hold_until:
            return
        since = now - self._planned
        if force or since >= REPLAN_S or (self._dirty and since >= PLAN_S):
            self._plan()

    def _plan(self) -> None:
        kinds = {(line[0][1].family, kind) for kind, line in self.lines.items()}
        kinds |= {(e.family, e.kind) for e in self.running.values()}
        totals, autoscaled, devices = self._capacity(kinds)  # a GCS read every TOTALS_TTL_S, not timed
        started = time.perf_counter()
        # An elastic step is granted slices it can reserve: those with every host (as offers to grow count them).
        intact = {**totals, **{k: min(v, totals.get(k, v)) for k, v in self._intact.items()}}
        now = time.monotonic()
        lapsed = frozenset(id for id, since in self.rejoining_since.items() if now - since >= REJOIN_S)
        decided = rules.plan_lines(self.lines, list(self.running.values()), totals, self.settings,
                                   autoscaled=autoscaled, devices=devices, intact=intact, lapsed=lapsed)
        admitted_at = time.time()
        for id in decided.admit:
            e = self.entries[id]
            self._unline(e)
            e.admitted, e.admitted_at = True, admitted_at
            if id in decided.amounts:  # an elastic step: the slices it starts on
                granted(e, decided.amounts[id])
            self.running[id] = e
        self.reasons = decided.reasons
        # A suspension not yet heard is chosen again at every plan: one whose request left, or was admitted on
        # capacity freed otherwise, is taken back before its step hears it.
        self.suspending = {id: why for id, why in self.suspending.items() if id in self.told}
        if self.settings.preemption == "lower-priority":
            self._choose_suspensions(totals, devices, autoscaled, intact)
        self._offer_growth(totals, autoscaled)
        self._planned, self._dirty = time.monotonic(), False
        self.plan_ms = [*self.plan_ms[-999:], (time.perf_counter() - started) * 1000]

    def _choose_suspensions(self, totals: dict[str, float], devices: dict[str, list[float]],
                            autoscaled: set[str], intact: dict[str, float] | None = None) -> None:
        """`preemption: lower-priority`: the first request of each kind that waits for capacity may suspend
        preemptible steps.

        Only a request that waits for capacity (not for its team's quota, nor held back by another)
        does: in a line, that is the entry the plan says is "first in line", which may stand behind
        borrowers over their team's quota (set aside). The choice is `rules.victims`. The chosen
        steps' launchers hear it at their next beat. Kinds an autoscaler adds are never preempted (a
        request there waits for the autoscaler, and a running step may be one still waiting for its node).
        An elastic request counts only the slices with every host (`intact`), as its grant does: a free
        slice missing a host is no room for it.
        """
        running = list(self.running.values())
        for kind, line in self.lines.items():
            if kind in autoscaled:
                continue
            head = None
            for _, e in line:  # the plan's reasons: borrowers set aside first, then the one that waits for capacity
                why = self.reasons.get(e.id, "")
                if why.startswith("first in line"):
                    head = e
                if head is not None or not why:  # found, or the rest of the line stands behind it
                    break
            if head is None:
                continue
            total = totals.get(kind, 0)
            if head.elastic and intact is not None:
                total = min(total, intact.get(kind, total))
            for victim in rules.victims(head, running, total, frozenset(self.suspending), devices.get(kind)):
                self.suspending[victim.id] = (f"suspended for {rules.seen_by(head, victim)} (priority {head.priority}, "
                                              f"waiting for {head.what}; this step's priority is {victim.priority})")

    def _offer_growth(self, totals: dict[str, float], autoscaled: set[str]) -> None:
        """Elastic steps running on fewer slices than they asked for hear when more are free and nobody waits
        (`rules.growth`, over the slices with every host alive).

        An offer not yet heard is chosen afresh at every plan. One heard is taken back (its launcher
        tells the step, which carries on) once those slices went to someone else, or after `GROW_OFFER_S`
        unused (a step that ignores offers must not keep them from others): then that step is not
        offered more for as long again.
        """
        now = time.monotonic()
        intact = {**totals, **{k: min(v, totals.get(k, v)) for k, v in self._intact.items()}}
        waiting_out = {id for id, until in self.no_offer_until.items() if until > now}
        self.no_offer_until = {id: self.no_offer_until[id] for id in waiting_out}
        # Steps that may not be offered more hold what they hold, and claim nothing beyond it.
        held = [e if e.id not in waiting_out and e.id not in self.suspending else _not_growing(e)
                for e in self.running.values()]
        still = rules.growth(held, self.lines, intact, self.settings, autoscaled)
        kept: dict[str, Offer] = {}
        for id, offer in self.growing.items():
            if id not in self.told_grow:
                continue
            if still.get(id, 0) >= 1 and now - offer.at < GROW_OFFER_S:
                kept[id] = Offer(offer.why, min(offer.more, still[id]), offer.at)
            else:
                self.told_grow.discard(id)
                if now - offer.at >= GROW_OFFER_S:
                    self.no_offer_until[id] = now + GROW_OFFER_S
        self.growing = kept
        offers = rules.growth(held, self.lines, intact, self.settings, autoscaled,
                              offered={id: offer.more for id, offer in kept.items()})
        for id, more in offers.items():
            e = self.running[id]
            self.growing[id] = Offer(f"{more} more {e.kind} free and nobody waits for it: checkpoint and stop to "
                                     f"resume on {e.amount + more:g} slices", more, now)

    def _capacity(self, kinds: set[tuple[str, str]]) -> tuple[dict[str, float], set[str], dict[str, list[float]]]:
        """Slices per TPU slice type (their worker-0 hosts), each accelerator resource's total, which kinds an
        autoscaler adds, and each fixed accelerator's devices per node (counted device by device).

        A kind an autoscaler may add counts as the most it can hold: the operator's `max_capacity`, else
        the node groups' maxima the cluster reports to Ray (`get_cluster_config`), else unbounded (its
        placement groups are what asks the autoscaler for more; Ray orders those, as before the queue).
        """
        read, found = self._totals
        if time.monotonic() - read < TOTALS_TTL_S and all(kind in found[0] for _, kind in kinds):
            return found
        totals: dict[str, float] = {}
        devices: dict[str, list[float]] = {}
        known: dict[str, list[float]] = {}
        nodes = ray.nodes()
        self._intact = intact_slices_by_type(nodes)
        for node in nodes:
            for resource, amount in node["Resources"].items() if node.get("Resources") else ():
                if resource in VISIBLE_DEVICES_ENV:
                    known.setdefault(resource, []).append(amount)
            if not node["Alive"]:
                continue
            labels = node.get("Labels", {})
            if labels.get(POD_TYPE_LABEL) and labels.get(WORKER_ID_LABEL) == "0":
                totals[labels[POD_TYPE_LABEL]] = totals.get(labels[POD_TYPE_LABEL], 0) + 1
            for resource, amount in node["Resources"].items():
                if resource in VISIBLE_DEVICES_ENV:
                    totals[resource] = totals.get(resource, 0) + amount
                    devices.setdefault(resource, []).append(amount)
        autoscaled: set[str] = set()
        maxima = group_maxima()
        for family, kind in kinds | {(k, k) for k in devices}:
            resource = kind if family == kind else f"TPU-{kind}-head"
            try:
                may_add = autoscaler.may_add(resource)
            except Exception:  # cannot tell: count what is there
                may_add = False
            if may_add:
                autoscaled.add(kind)
                declared = self.settings.max_capacity
                most = declared.get(kind, 0) if declared else maxima.get(resource, float("inf"))
                totals[kind] = max(totals.get(kind, 0), most)
            totals.setdefault(kind, 0)
        found = (totals, autoscaled, {k: v for k, v in devices.items() if k not in autoscaled})
        self._known_devices = known
        self._totals = (time.monotonic(), found)
        return found


def _not_growing(e: rules.Entry) -> rules.Entry:
    """`e` as one that may not grow now: it counts what it holds and is offered nothing."""
    from dataclasses import replace

    return replace(e, grows=False)


@dataclass(frozen=True)
class Offer:
    """An offer to grow: what the step is told, how many more slices, and when it was made (monotonic)."""

    why: str
    more: int
    at: float


def granted(e: rules.Entry, amount: float) -> None:
    """An elastic entry admitted on `amount` slices: it counts (and its team's quota counts) that many."""
    e.chips = e.chips * amount / e.amount
    e.amount = amount
    e.what = f"{amount:g} x {e.kind} (elastic {e.min_amount:g}-{e.max_amount:g})"


def intact_slices_by_type(nodes: list[dict]) -> dict[str, float]:
    """Slice type -> how many of its slices have every host alive (a slice's host count from its chips)."""
    from rayslice.core.accelerators import TpuSliceRequest

    alive: dict[tuple[str, str], int] = {}
    per_host: dict[str, float] = {}
    for node in nodes:
        labels = node.get("Labels", {})
        pod_type, name = labels.get(POD_TYPE_LABEL), labels.get(SLICE_NAME_LABEL)
        if not pod_type or not name:
            continue
        per_host[pod_type] = max(per_host.get(pod_type, 0), (node.get("Resources") or {}).get("TPU", 0))
        if node["Alive"]:
            alive[(pod_type, name)] = alive.get((pod_type, name), 0) + 1
    intact: dict[str, float] = {}
    for (pod_type, _), hosts in alive.items():
        try:
            needed = round(TpuSliceRequest(tpu=pod_type).chips_per_slice / per_host[pod_type])
        except Exception:  # a type or layout rayslice does not know: its slices count as they are
            needed = hosts
        intact[pod_type] = intact.get(pod_type, 0) + (hosts >= needed)
    return intact


def group_maxima() -> dict[str, float]:
    """resource -> the most of it the autoscaler's node groups can hold, as the cluster reports them to Ray
    (ReportClusterConfig); empty where nothing reports them (Ray 2.60's own autoscaler does not)."""
    config = ray._private.state.state.get_cluster_config()
    most: dict[str, float] = {}
    for group in config.node_group_configs if config else []:
        for resource, amount in group.resources.items():
            count = float("inf") if group.max_count < 0 else group.max_count
            most[resource] = most.get(resource, 0) + amount * count
    return most


def broker() -> Any:
    """The cluster's broker, started (detached, on the head node) by the first launcher that needs it."""
    try:
        return ray.get_actor(BROKER_NAME, namespace=NAMESPACE)
    except ValueError:
        pass
    head = next((n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]), None)
    options: dict[str, Any] = {"name": BROKER_NAME, "namespace": NAMESPACE, "lifetime": "detached",
                               "get_if_exists": True}
    if head:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # Hard: a 0-CPU actor elsewhere would keep that node from ever reading idle (no scale-down).
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(head, soft=False)
    options["runtime_env"] = host_env.service_runtime_env(head)  # a shipped launcher, unless the head has it
    return Broker.options(**options).remote()


def snapshot(timeout: float = 10.0) -> dict[str, Any]:
    """The queue as the broker holds it (`Broker.snapshot`)."""
    return ray.get(broker().snapshot.remote(), timeout=timeout)


class Withdrawn(Exception):
    """A waiting place left the queue because its step no longer needs it here (`Place.wait`'s `give_up`)."""


class Place:
    """A launcher's place in the queue, from `wait` until `leave` (both ends of a step's capacity).

    A thread heartbeats the whole entry as often as the broker asks (`HEARTBEAT_S`, or `SLOW_BEAT_S`
    far back in the line), re-registering it (same arrival) with a broker that lost it; `wait` logs
    where the step stands whenever that changes. A step whose attempt ended to resume keeps its place
    across attempts: `requeue` at its release, `rejoin` with the next attempt's request, never a leave
    in between (someone it outranks would take its capacity meanwhile).
    """

    def __init__(self, entry: rules.Entry, log: Any = None) -> None:
        self.entry = entry
        self.log = log or (lambda message: print(f"[rayslice] {message}", flush=True))
        self.state: dict[str, Any] = {}
        self.beat_s = HEARTBEAT_S
        self.admitted = threading.Event()
        self.refused: str | None = None  # the broker's word that the request can never run here
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._broker: Any = None
        self.suspend: tuple[str, float] | None = None  # (why, grace in seconds): the broker suspends this step
        self.grow: str | None = None  # an elastic step's offer to grow (more slices free)
        self._requeue = False  # the broker must be told the entry changed (`requeue`) before it is only refreshed
        self._lock = threading.Lock()  # a beat's entry and its answer belong together (no stale "admitted")
        # A step on several clusters: True once another cluster claimed it (asked while it waits and reserves).
        self.give_up: Callable[[], bool] | None = None

    def _beat(self) -> None:
        with self._lock:
            self._beat_locked()

    def _beat_locked(self) -> None:
        try:
            if self._broker is None:
                self._broker = broker()
            entry = self.entry.to_json()
            if self._requeue:
                state = self._requeue_at(self._broker, entry)
            else:
                beat = self._broker.heartbeat.remote(entry, beat_s=self.beat_s,
                                                     suspended=self.suspend[0] if self.suspend else None)
                state = ray.get(beat, timeout=5 + self.beat_s)
        except Exception:  # the broker restarts: its handle stays good, the next beat re-registers (or requeues)
            self._broker = None
            self.beat_s = HEARTBEAT_S
            return
        self._requeue = False
        if state.get("refused"):
            self.refused = state["refused"]
            self._stop.set()
            self._changed.set()
            return
        if state.get("admitted") and not self.entry.admitted:
            if self.entry.elastic and state.get("amount"):  # re-registered after a broker restart: what it holds
                granted(self.entry, float(state["amount"]))
            self.entry.admitted, self.entry.admitted_at = True, time.time()
            self.admitted.set()
        if state.get("suspend") and state.get("grow"):
            self.grow = self.grow or str(state["suspend"])
        elif state.get("admitted"):
            self.grow = None  # no offer now (taken back, or never made)
        if state.get("suspend") and not state.get("grow") and self.suspend is None:  # a higher-priority request
            self.suspend = (str(state["suspend"]), float(state.get("grace_s", 30.0)))
        self.beat_s = min(max(float(state.get("beat_s", HEARTBEAT_S)), HEARTBEAT_S), MAX_BEAT_S)
        self.state = state
        self._changed.set()

    def _requeue_at(self, handle: Any, entry: dict[str, Any]) -> dict[str, Any]:
        """`Broker.requeue`; a broker older than it (detached, from before an upgrade) gets a leave and a fresh
        registration instead (its place kept by its arrival, but not atomically)."""
        try:
            call = handle.requeue
        except AttributeError:
            ray.get(handle.leave.remote(entry["id"]), timeout=5)
            return ray.get(handle.heartbeat.remote(entry, beat_s=HEARTBEAT_S), timeout=5 + HEARTBEAT_S)
        return ray.get(call.remote(entry, beat_s=HEARTBEAT_S), timeout=5 + HEARTBEAT_S)

    def requeue(self) -> Place:
        """At an attempt's release, when the step will resume: back to waiting in its line at its arrival, in one
        broker call (`Broker.requeue`), still beating. It is admitted to nothing until `rejoin` says what the
        next attempt asks for; meanwhile only requests ranked ahead of it may take what it released."""
        with self._lock:
            self.entry.admitted, self.entry.admitted_at, self.entry.rejoining = False, None, True
            self.admitted.clear()
            self.suspend = self.grow = None
            self.state = {}
            self._requeue = True
            if not self._stop.is_set():
                self._beat_locked()  # now; if the broker cannot be reached, every beat tries again until it can
        return self

    def rejoin(self, entry: rules.Entry) -> Place:
        """The next attempt's request (`entry`, from `place_for`) in this place: same id, same arrival, in one
        broker call. A place that was given up meanwhile (refused) is taken afresh."""
        if self._stop.is_set():
            return Place(entry, self.log)
        entry.id, entry.arrival = self.entry.id, self.entry.arrival
        with self._lock:
            self.entry = entry
            self.admitted.clear()
            self._requeue = True
            self._beat_locked()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.beat_s):
            self._beat()

    @classmethod
    def unqueued(cls) -> Place:
        """A place outside the queue, admitted from the start (`reserve_slices(queued=False)`)."""
        place = cls(rules.Entry(id="", label="", family="", kind="", amount=0, chips=0, what="", admitted=True))
        place.admitted.set()
        place._stop.set()
        return place

    def join(self) -> Place:
        """Take the place (one heartbeat now, then every HEARTBEAT_S from a thread) without waiting."""
        if self._thread is None and not self._stop.is_set():
            self._beat()
            self._thread = threading.Thread(target=self._run, name="rayslice-queue", daemon=True)
            self._thread.start()
        return self

    def wait(self, timeout: float) -> float:
        """Block until admitted (seconds waited), or leave the queue and raise CapacityTimeoutError.

        `self.give_up` (asked between beats): True leaves the queue and raises `Withdrawn` (a step on several
        clusters that another cluster claimed meanwhile).
        """
        started = time.monotonic()
        self.join()
        said = None
        while not self.admitted.is_set():
            if self.give_up is not None and self.give_up():
                self.leave()
                raise Withdrawn(self.entry.what)
            if self.refused:
                raise UnsatisfiableRequestError(f"{self.refused}. Ask for a kind the cluster has, or ask its "
                                                "operator to raise the node group's maximum.")
            left = timeout - (time.monotonic() - started)
            if left <= 0:
                self.leave()
                raise CapacityTimeoutError(
                    f"no capacity for {self.entry.what} within capacity_timeout={timeout:g} s "
                    f"(still {rules.describe(self.state)[len('waiting for '):] if 'rank' in self.state else 'queued'}"
                    "); nothing was left reserved. Raise capacity_timeout, raise the step's priority, or add capacity.")
            self._changed.wait(min(0.2, left))  # short: a SIGTERM (ray job stop) gets in between
            self._changed.clear()
            if "rank" in self.state:
                key = (self.state["rank"], (self.state.get("ahead") or {}).get("label"), self.state.get("reason"))
                if key != said:
                    said = key
                    self.log(rules.describe(self.state))
        return time.monotonic() - started

    def leave(self) -> None:
        """Give the place up (at the step's end, its cancellation, or a timeout): at once; once."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=6)  # a beat in flight must not re-register the place after it left
        try:
            ray.get((self._broker or broker()).leave.remote(self.entry.id), timeout=5)
        except Exception:
            pass  # the broker forgets a silent launcher within EXPIRE_S anyway


def place_for(spec: StepSpec, arrival: float | None = None, nodes: list[dict] | None = None,
              preemptible: bool | None = None, most_slices: int | None = None,
              least_slices: int | None = None, grows: bool = True) -> Place:
    """The queue place of a step: its request (TPU chips: on which slice type), priority, team, label (dag.task).

    `preemptible`: whether a higher-priority step may suspend it now (default: as the step declares;
    the launcher says False once the step has no preemption retry left to resume with). `most_slices`:
    an elastic step asks for no more than this (the intact slices left after it lost one); `least_slices`:
    no fewer than this (the slices it had before it stopped to grow); `grows`: whether it may be offered
    more while it runs.
    """
    owner = spec.owner
    label = f"{owner.dag_id}.{owner.task_id}" if owner.dag_id else (owner.submission_id or "adhoc")
    if owner.map_index >= 0:
        label += f"[{owner.map_index}]"
    request = spec.request
    chips_on = None
    if isinstance(request, AcceleratorRequest) and request.resource == "TPU":
        chips_on = chip_slice(request, ray.nodes() if nodes is None else nodes)
    entry = rules.entry_for(request, id=f"{owner.submission_id or 'adhoc'}/{time.time_ns()}", label=label,
                            priority=spec.priority or 0, team=spec.team, arrival=arrival, chips_on=chips_on,
                            preemptible=spec.preemptible if preemptible is None else preemptible,
                            most_slices=most_slices, least_slices=least_slices)
    entry.dag = f"{owner.deployment}/{owner.dag_id}"
    entry.grows = grows and spec.command is None  # a command's exit after a notice reads as a stop for it
    return Place(entry)


def slice_types(nodes: list[dict]) -> dict[str, tuple[int, int]]:
    """pod type -> (chips per host, chips per slice) of the cluster's live slices."""
    per_slice: dict[tuple[str, str], list[float]] = {}
    for node in nodes:
        labels = node.get("Labels", {})
        if node["Alive"] and labels.get(POD_TYPE_LABEL) and labels.get(SLICE_NAME_LABEL):
            chips = node["Resources"].get("TPU", 0)
            per_slice.setdefault((labels[POD_TYPE_LABEL], labels[SLICE_NAME_LABEL]), []).append(chips)
    found: dict[str, tuple[int, int]] = {}
    for (pod_type, _), hosts in per_slice.items():
        found[pod_type] = max(found.get(pod_type, (0, 0)), (int(max(hosts)), int(sum(hosts))))
    return found


def chip_slice(request: AcceleratorRequest, nodes: list[dict]) -> tuple[str, int] | None:
    """The slice type TPU chips run on here, and its chips per slice (None: no labelled slice fits them)."""
    types = slice_types(nodes)
    pod_type = rules.chip_slice_type(request.count, request.accelerator_type, types)
    return None if pod_type is None else (pod_type, types[pod_type][1])


def chip_label_selector(pod_type: str, chips: float, nodes: list[dict],
                        available: dict[str, dict[str, float]]) -> dict[str, str]:
    """Where TPU chips of an admitted step go: one slice of its type, the one chip steps already use most.

    The queue counted the step as a share of one slice; packing chip steps onto the slices they
    already use keeps the rest whole for slice steps (Ray alone would spread them over every slice).
    """
    free: dict[str, float] = {}  # slice -> chips free on it
    fits: set[str] = set()  # slices with a host that has `chips` free
    for node in nodes:
        labels = node.get("Labels", {})
        if not node["Alive"] or labels.get(POD_TYPE_LABEL) != pod_type or not labels.get(SLICE_NAME_LABEL):
            continue
        name, here = labels[SLICE_NAME_LABEL], available.get(node["NodeID"], {}).get("TPU", 0)
        free[name] = free.get(name, 0) + here
        if here >= chips:
            fits.add(name)
    selector = {POD_TYPE_LABEL: pod_type}
    if fits:
        selector[SLICE_NAME_LABEL] = min(fits, key=lambda name: (free[name], name))
    return selector


def main(argv: list[str] | None = None) -> None:
    """`python -m rayslice.cluster.queue [--set JSON]`: print the queue as one marked JSON line (`rayslice queue`).

    `--set`: the operator's new settings first (`rayslice queue --set`, which needs the cluster's token).
    """
    import json
    import sys

    argv = sys.argv[1:] if argv is None else argv
    ray.init(address="auto", logging_level="ERROR")
    if argv[:1] == ["--set"]:
        settings = rules.QueueSettings.checked(argv[1], "rayslice queue --set")  # a clear error before the broker
        ray.get(broker().set_settings.remote(settings.model_dump()), timeout=30)
    print("::rayslice-queue::" + json.dumps(snapshot()), flush=True)


if __name__ == "__main__":
    main()
