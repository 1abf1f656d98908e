"""One admission queue per cluster: a detached, restartable Ray actor (the broker) and the launchers' places in it.

Ray serves waiting placement groups in no order, so a 2-slice request can wait forever behind a
stream of 1-slice ones. Every launcher therefore takes a place in the broker's queue before it
reserves, and reserves only once the broker admits it (`rayslice.core.queue.plan`: priority,
arrival, policy, team quotas). An admitted step counts against its capacity until it leaves the
queue (after its release), so the broker never admits a later request onto capacity the head of
the line was admitted to.

Nothing is stored beside Ray: every launcher heartbeats its whole entry (arrival time included)
every `HEARTBEAT_S` from a thread. The broker forgets a launcher not heard from for `EXPIRE_S`
(a launcher SIGKILLed while it waits); a restarted broker (Ray restarts it) starts empty,
admits nothing for `RECOVERY_S`, and is rebuilt by the heartbeats, with every place kept.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import ray

from rayslice.core import queue as rules
from rayslice.core.accelerators import VISIBLE_DEVICES_ENV
from rayslice.core.exceptions import CapacityTimeoutError
from rayslice.core.step import StepSpec

BROKER_NAME = "rayslice-broker-v1"
NAMESPACE = "rayslice"
#: How often a launcher reports its entry (waiting or running).
HEARTBEAT_S = 0.5
#: A launcher not heard from this long has lost its place.
EXPIRE_S = 3.0
#: After a restart, the broker admits nothing this long: every live launcher re-registers first.
RECOVERY_S = 3.0
#: How long the broker reuses its reading of the cluster's capacity.
TOTALS_TTL_S = 2.0
POD_TYPE_LABEL = "ray.io/tpu-pod-type"
WORKER_ID_LABEL = "ray.io/tpu-worker-id"


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class Broker:
    """The queue: entries by id, each with when its launcher was last heard from. Calls run one at a time."""

    def __init__(self) -> None:
        self.entries: dict[str, rules.Entry] = {}
        self.seen: dict[str, float] = {}
        self.settings = rules.QueueSettings()
        self.reasons: dict[str, str] = {}
        with warnings.catch_warnings():  # Ray's own property reads its deprecated `actor_id`: no warning for users
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.hold_until = time.monotonic() + RECOVERY_S if restarted else 0.0
        self.restarts = int(restarted)
        self._totals: tuple[float, dict[str, float]] = (0.0, {})

    def heartbeat(self, entry: dict[str, Any], settings: dict[str, Any] | None = None) -> dict[str, Any]:
        """Register or refresh a place (a re-registration keeps the arrival it carries); where it stands now."""
        mine = self.entries.get(entry["id"])
        if mine is None:  # a new place, or one a restart lost: the settings of the latest to register win
            mine = self.entries[entry["id"]] = rules.Entry.from_json(entry)
            if settings is not None:
                self.settings = rules.QueueSettings.model_validate(settings)
        self.seen[mine.id] = time.monotonic()
        self._step()
        return rules.standing(list(self.entries.values()), mine.id, self.reasons)

    def leave(self, id: str) -> None:
        self.entries.pop(id, None)
        self.seen.pop(id, None)
        self._step()

    def snapshot(self) -> dict[str, Any]:
        """Every entry, running ones first, then the waiting ones in order; and the settings."""
        self._step()
        entries = list(self.entries.values())
        running = sorted((e for e in entries if e.admitted), key=lambda e: e.admitted_at or 0)
        return {"entries": [{**e.to_json(), "reason": self.reasons.get(e.id, "")}
                            for e in [*running, *rules.order(entries)]],
                "settings": self.settings.model_dump(), "restarts": self.restarts}

    def _step(self) -> None:
        now = time.monotonic()
        for id, seen in list(self.seen.items()):
            if now - seen > EXPIRE_S:
                self.entries.pop(id, None)
                self.seen.pop(id, None)
        if now < self.hold_until:
            self.reasons = {e.id: "the queue is being rebuilt after a restart" for e in self.entries.values()}
            return
        kinds = {(e.family, e.kind) for e in self.entries.values()}
        decided = rules.plan(list(self.entries.values()), self._capacity(kinds), self.settings)
        for id in decided.admit:
            self.entries[id].admitted = True
            self.entries[id].admitted_at = time.time()
        self.reasons = decided.reasons

    def _capacity(self, kinds: set[tuple[str, str]]) -> dict[str, float]:
        """Slices per TPU slice type (their worker-0 hosts), and each accelerator resource's total.

        A kind an autoscaler may add is unbounded: its requests are admitted at once, since their
        placement groups are what asks the autoscaler for more (Ray orders those, as before the queue).
        """
        read, totals = self._totals
        if time.monotonic() - read < TOTALS_TTL_S and all(kind in totals for _, kind in kinds):
            return totals
        from rayslice.cluster.reservation import _autoscaler_may_add

        totals = {}
        for node in ray.nodes():
            if not node["Alive"]:
                continue
            labels = node.get("Labels", {})
            if labels.get(POD_TYPE_LABEL) and labels.get(WORKER_ID_LABEL) == "0":
                totals[labels[POD_TYPE_LABEL]] = totals.get(labels[POD_TYPE_LABEL], 0) + 1
            for resource, amount in node["Resources"].items():
                if resource in VISIBLE_DEVICES_ENV:
                    totals[resource] = totals.get(resource, 0) + amount
        for family, kind in kinds:
            try:
                if _autoscaler_may_add(kind if family == kind else f"TPU-{kind}-head"):
                    totals[kind] = float("inf")
            except Exception:  # cannot tell: count what is there
                pass
            totals.setdefault(kind, 0)
        self._totals = (time.monotonic(), totals)
        return totals


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
    return Broker.options(**options).remote()


def snapshot(timeout: float = 10.0) -> dict[str, Any]:
    """The queue as the broker holds it (`Broker.snapshot`)."""
    return ray.get(broker().snapshot.remote(), timeout=timeout)


class Place:
    """A launcher's place in the queue, from `wait` until `leave` (both ends of a step's capacity).

    A thread heartbeats the whole entry every `HEARTBEAT_S`, re-registering it (same arrival)
    with a broker that lost it; `wait` logs where the step stands whenever that changes.
    """

    def __init__(self, entry: rules.Entry, settings: rules.QueueSettings | None = None,
                 log: Any = None) -> None:
        self.entry = entry
        self.settings = None if settings is None else settings.model_dump()
        self.log = log or (lambda message: print(f"[rayslice] {message}", flush=True))
        self.state: dict[str, Any] = {}
        self.admitted = threading.Event()
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._broker: Any = None

    def _beat(self) -> None:
        try:
            if self._broker is None:
                self._broker = broker()
            state = ray.get(self._broker.heartbeat.remote(self.entry.to_json(), self.settings), timeout=5)
        except Exception:  # the broker restarts: its handle stays good, the next beat re-registers
            self._broker = None
            return
        if state.get("admitted") and not self.entry.admitted:
            self.entry.admitted, self.entry.admitted_at = True, time.time()
            self.admitted.set()
        self.state = state
        self._changed.set()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
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
        """Block until admitted (seconds waited), or leave the queue and raise CapacityTimeoutError."""
        started = time.monotonic()
        self.join()
        said = None
        while not self.admitted.is_set():
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


def place_for(spec: StepSpec, arrival: float | None = None) -> Place:
    """The queue place of a step: its request, priority, team, label (dag.task), and the queue's settings."""
    owner = spec.owner
    label = f"{owner.dag_id}.{owner.task_id}" if owner.dag_id else (owner.submission_id or "adhoc")
    if owner.map_index >= 0:
        label += f"[{owner.map_index}]"
    entry = rules.entry_for(spec.request, id=f"{owner.submission_id or 'adhoc'}/{time.time_ns()}", label=label,
                            priority=spec.priority or 0, team=spec.team, arrival=arrival)
    return Place(entry, settings_for(spec))


def settings_for(spec: StepSpec) -> rules.QueueSettings | None:
    """The step's queue settings (its connection's `queue` extra), else the cluster's `RAYSLICE_QUEUE`, else None."""
    import os

    if spec.queue is not None:
        return spec.queue
    raw = os.environ.get(rules.SETTINGS_ENV)
    return rules.QueueSettings.model_validate_json(raw) if raw else None


def main() -> None:
    """`python -m rayslice.cluster.queue`: print the queue as one marked JSON line (read by `rayslice queue`)."""
    import json

    ray.init(address="auto", logging_level="ERROR")
    print("::rayslice-queue::" + json.dumps(snapshot()), flush=True)


if __name__ == "__main__":
    main()
