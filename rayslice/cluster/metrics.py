"""rayslice's cluster metrics, as Ray metrics: Ray's Prometheus endpoint (and so Grafana) shows them.

A job driver lives for one step and ends with `os._exit`, usually before Ray's next metrics
report (every `RAY_metrics_report_interval_ms`, 10 s by default): what it recorded itself would
be lost. So one detached actor on the head, `rayslice-metrics-v1` (namespace `rayslice`), holds
them: each driver sends it every attempt's phase times and the step's outcome (bounded waits, and
never a failure of the step), and it reads the admission queue every `QUEUE_POLL_S` for the
queue's depth and the chips held. Ray prefixes each name with `ray_` on the Prometheus endpoint
(`ray_rayslice_steps_total`); docs/metrics.md lists them.

Tags stay bounded: a slice type or accelerator resource, an outcome, a phase, an error type
(unknown ones read "other"); never a run, task or job id.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import ray

from rayslice.cluster import host_env
from rayslice.core import goodput
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.exceptions import STEP_ERRORS
from rayslice.core.step import StepSpec

RECORDER_NAME = "rayslice-metrics-v1"
NAMESPACE = "rayslice"
#: How often the recorder reads the admission queue (queue depth, chips held).
QUEUE_POLL_S = 5.0
#: How long a driver waits, at its end, for the recorder to have its records.
DELIVERY_TIMEOUT_S = 2.0
#: Phase seconds: from 0.1 s (a warm start) to an hour (a scale-up from zero).
SECONDS_BOUNDARIES = [0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600]
OUTCOMES = ("succeeded", "failed", "stopped")
#: The error types a failure is counted by; any other reads "other".
ERROR_TYPES = frozenset(STEP_ERRORS) | {"LauncherError"}

#: Metric name -> (type, description, tag keys). The Grafana dashboard's test checks its queries against these.
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "rayslice_steps": ("counter", "Steps that ended, by slice type or accelerator and outcome",
                       ("kind", "outcome")),
    "rayslice_step_failures": ("counter", "Failed steps by error type", ("kind", "error")),
    "rayslice_phase_seconds": ("histogram", "Seconds from the phase before to this phase, per step attempt",
                               ("kind", "phase")),
    "rayslice_queue_wait_seconds": ("histogram", "Seconds a step attempt waited in the admission queue", ("kind",)),
    "rayslice_queue_depth": ("gauge", "Steps waiting in the admission queue", ("kind",)),
    "rayslice_chips_held": ("gauge", "TPU chips (or accelerators) held by admitted steps", ("kind",)),
    "rayslice_chip_seconds": ("counter", "Chip-seconds (accelerator-seconds) of ended steps by goodput category: "
                              "startup, productive, checkpointing, lost, teardown (held), waiting, suspended "
                              "(not held)", ("kind", "category")),
    "rayslice_goodput": ("gauge", "Productive over held chip-seconds of the steps ended since the recorder started",
                         ("kind",)),
}


def kind_of(spec: StepSpec) -> str:
    """The slice type ("v6e-16") or the accelerator resource ("GPU"): the only per-step tag."""
    return spec.request.pod_type if isinstance(spec.request, TpuSliceRequest) else spec.request.resource


def queue_gauges(entries: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, float]]:
    """From the broker's entries: steps waiting per kind, and chips (or accelerators) held per kind."""
    waiting: dict[str, float] = {}
    held: dict[str, float] = {}
    for entry in entries:
        if entry.get("admitted"):
            held[entry["kind"]] = held.get(entry["kind"], 0) + entry["chips"]
        else:
            waiting[entry["kind"]] = waiting.get(entry["kind"], 0) + 1
    return waiting, held


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class Recorder:
    """Holds rayslice's Ray metrics for the whole cluster (a restart starts its counters from zero)."""

    def __init__(self) -> None:
        from ray.util import metrics

        made = {"counter": metrics.Counter, "gauge": metrics.Gauge, "histogram": metrics.Histogram}
        self.metrics: dict[str, Any] = {}
        for name, (kind, description, tags) in METRICS.items():
            extra = {"boundaries": SECONDS_BOUNDARIES} if kind == "histogram" else {}
            self.metrics[name] = made[kind](name, description=description, tag_keys=tags, **extra)
        self.queue_kinds: set[str] = set()
        self.held: dict[str, list[float]] = {}
        threading.Thread(target=self._poll_queue, name="rayslice-metrics-queue", daemon=True).start()

    def attempt(self, kind: str, phase_seconds: dict[str, float], queue_wait: float | None) -> None:
        for phase, seconds in phase_seconds.items():
            self.metrics["rayslice_phase_seconds"].observe(max(seconds, 0.0), tags={"kind": kind, "phase": phase})
        if queue_wait is not None:
            self.metrics["rayslice_queue_wait_seconds"].observe(max(queue_wait, 0.0), tags={"kind": kind})

    def step(self, kind: str, outcome: str, error: str | None) -> None:
        self.metrics["rayslice_steps"].inc(tags={"kind": kind, "outcome": outcome})
        if error:
            self.metrics["rayslice_step_failures"].inc(tags={"kind": kind, "error": error})

    def goodput(self, kind: str, chip_s: dict[str, float]) -> None:
        """One ended step's chip-seconds per category (`rayslice.core.goodput`), and the kind's goodput so far."""
        held = self.held.setdefault(kind, [0.0, 0.0])  # productive, held
        for category, value in chip_s.items():
            if category in goodput.CATEGORIES and value > 0:
                self.metrics["rayslice_chip_seconds"].inc(value, tags={"kind": kind, "category": category})
        held[0] += max(chip_s.get("productive", 0.0), 0.0)
        held[1] += sum(max(chip_s.get(c, 0.0), 0.0) for c in goodput.HELD)
        if held[1] > 0:
            self.metrics["rayslice_goodput"].set(held[0] / held[1], tags={"kind": kind})

    def _poll_queue(self) -> None:
        from rayslice.cluster import queue

        stop = threading.Event()
        while not stop.wait(QUEUE_POLL_S):
            try:
                broker = ray.get_actor(queue.BROKER_NAME, namespace=queue.NAMESPACE)
                entries = ray.get(broker.snapshot.remote(), timeout=10)["entries"]
            except Exception:  # no broker yet, or it restarts: the gauges keep their last values
                continue
            self.set_queue(entries)

    def set_queue(self, entries: list[dict[str, Any]]) -> None:
        """Queue depth and chips held per kind; a kind seen before and now empty reads 0."""
        waiting, held = queue_gauges(entries)
        self.queue_kinds |= set(waiting) | set(held)
        for kind in self.queue_kinds:
            self.metrics["rayslice_queue_depth"].set(waiting.get(kind, 0), tags={"kind": kind})
            self.metrics["rayslice_chips_held"].set(held.get(kind, 0), tags={"kind": kind})


class Sender:
    """A driver's side: records go to the recorder as they come; `flush` waits (bounded) until it has them all."""

    def __init__(self) -> None:
        self._recorder: Any = None
        self._sent: list[Any] = []

    def start(self) -> None:
        """Find or start the recorder now, so it is up by the time the step ends."""
        if ray.is_initialized():
            with contextlib.suppress(Exception):
                self._recorder = self._recorder or recorder()

    def attempt(self, spec: StepSpec, times: dict[str, float], queue_wait: float | None) -> None:
        """One attempt's phases, each as seconds from the phase reached before it."""
        from rayslice.cluster.phases import PHASES

        reached = [(phase, times[phase]) for phase in PHASES if phase in times]
        seconds = {phase: at - before for (_, before), (phase, at) in zip(reached, reached[1:], strict=False)}
        self._send("attempt", kind_of(spec), seconds, queue_wait)

    def step(self, spec: StepSpec, outcome: str, error: str | None = None) -> None:
        if error is not None and error not in ERROR_TYPES:
            error = "other"
        self._send("step", kind_of(spec), outcome, error)

    def goodput(self, spec: StepSpec, account: goodput.Account) -> None:
        """The step's chip-seconds per goodput category."""
        self._send("goodput", kind_of(spec), dict(account.chip_s))

    def flush(self, timeout: float = DELIVERY_TIMEOUT_S) -> None:
        """Before the driver exits: its records must leave this process (a metric is never worth more)."""
        if self._sent:
            with contextlib.suppress(Exception):
                ray.wait(self._sent, num_returns=len(self._sent), timeout=timeout)
        self._sent.clear()

    def _send(self, method: str, *args: Any) -> None:
        if not ray.is_initialized():  # a unit test's driver: never start a Ray for a metric
            return
        try:
            self._recorder = self._recorder or recorder()
            self._sent.append(getattr(self._recorder, method).remote(*args))
        except Exception:  # no Ray here (a unit test), or Ray refused: metrics never fail a step
            pass


#: This driver's sender (one step per driver process).
sender = Sender()


def recorder() -> Any:
    """The cluster's recorder, started (detached, on the head node) by the first driver that needs it."""
    with contextlib.suppress(ValueError):
        return ray.get_actor(RECORDER_NAME, namespace=NAMESPACE)
    head = next((n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]), None)
    options: dict[str, Any] = {"name": RECORDER_NAME, "namespace": NAMESPACE, "lifetime": "detached",
                               "get_if_exists": True}
    if head:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # Hard: a 0-CPU actor elsewhere would keep that node from ever reading idle (no scale-down).
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(head, soft=False)
    options["runtime_env"] = host_env.service_runtime_env(head)  # a shipped launcher, unless the head has it
    return Recorder.options(**options).remote()
