"""Where a step's time goes: a timestamp per phase, printed in the Ray job's log.

Phases, in order: the job accepted by Ray's job manager, the driver's process started, the
capacity reserved, every host process started, JAX imported and wired on every host, the step
started on every host, the step done on every host, the capacity released. A host phase is
the latest host's time (the gang waits for its slowest member). Times are `time.time()` of the
machine that saw them (hosts of a real slice must have synchronized clocks, as NTP gives GCE VMs).

The log gets one readable summary line and one `[rayslice] phases: {json}` line with every
phase's (and every host's) epoch times, which benchmarks parse (`parse_phases`). Task logs show the
summary only: the follower keeps the JSON line out of them (it stays in the Ray job's log).

A host returns its phase times with its result, so a host that raised, was killed (a peer failed,
`step_timeout`, a suspension) or died would take them with it. Each host also publishes them in Ray's
KV once its body starts (`publish`); the driver reads those of the hosts that did not return
(`published`), so every attempt, whatever its ending, has its host phases and a true start-up.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from itertools import pairwise
from typing import Any

from rayslice.core.step import PHASES_MARKER

#: Phase name -> what the log line says.
PHASES = {
    "accepted": "job accepted by Ray",
    "driver_started": "driver process started",
    "reserved": "capacity reserved",
    "hosts_started": "every host process started",
    "jax_ready": "JAX imported and wired on every host",
    "step_started": "step started on every host",
    "step_done": "step done on every host",
    "released": "capacity released",
}
#: The prefix of the machine-readable line.
MARKER = PHASES_MARKER
#: What hosts report back with their results (each a `time.time()`).
HOST_PHASES = ("hosts_started", "jax_ready", "step_started", "step_done")
#: A host report's key for the spans its step reported through its context ({kind: [[start, end], ...]}).
SPANS_KEY = "spans"
#: Where hosts publish their phase times as their body starts (Ray's KV namespace), and how each key begins.
NAMESPACE = "rayslice-phases"
KEY_PREFIX = "phases:"


def attempt_key(submission_id: str, preemption_attempt: int, unique: str) -> str:
    """The prefix of one gang attempt's keys: a host's key is this prefix and its label."""
    return f"{KEY_PREFIX}{submission_id or 'adhoc'}:{preemption_attempt}:{unique}:"


def publish(prefix: str, label: str, times: dict[str, Any]) -> Publication:
    """In a thread (the body is not held up): this host's phase times so far, for the driver if it never returns."""
    return Publication(prefix + label, times)


class Publication:
    """One host's phase times on their way to Ray's KV, and their removal once the driver has the host's report.

    The driver forgets every host's key once the gang ended. A put still on its way then (a loaded GCS)
    would land after that and stay forever: a host that returns its report (`leave(reported=True)`)
    has the put's own thread delete the key once it landed.
    """

    def __init__(self, key: str, times: dict[str, Any]) -> None:
        self._key, self._lock = key, threading.Lock()
        self._landed = self._forget = False
        self._thread = threading.Thread(target=self._put, args=(json.dumps(times),), name="rayslice-phases",
                                        daemon=True)
        self._thread.start()

    def _put(self, value: str) -> None:
        try:
            from ray.experimental import internal_kv

            internal_kv._internal_kv_put(self._key, value, namespace=NAMESPACE)
        except Exception:  # a phase record must never fail the step
            pass
        with self._lock:
            self._landed, forget = True, self._forget
        if forget:
            _delete(self._key)

    def leave(self, within: float, *, reported: bool) -> None:
        """The host ends: with its report (the key is not needed: gone once it landed), or without it (wait for
        the put, up to `within`, before the driver reads it)."""
        if reported:
            with self._lock:
                self._forget = not self._landed  # landed already: the driver's forget, after this return, has it
            return
        self._thread.join(within)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


def published(prefix: str, labels: dict[int, str]) -> dict[int, dict[str, float]]:
    """The times the hosts `labels` (index -> label) published (none for a host that never started its body)."""
    from ray.experimental import internal_kv

    found = {}
    for index, label in labels.items():
        try:
            raw = internal_kv._internal_kv_get(prefix + label, namespace=NAMESPACE)
            if raw:
                # any writer may have put it (Ray's KV has no owner per key): finite numbers only, never NaN
                found[index] = {k: float(v) for k, v in json.loads(raw).items()
                                if isinstance(v, int | float) and math.isfinite(v)}
        except Exception:  # unreadable: that host's phases stay unknown
            continue
    return found


def forget(prefix: str, labels: list[str]) -> None:
    for label in labels:
        _delete(prefix + label)


def _delete(key: str) -> None:
    try:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(key, namespace=NAMESPACE)
    except Exception:
        pass


def ended_short(reports: list[dict[str, Any]], found: dict[int, dict[str, float]], ended: float) -> list[dict]:
    """The host reports of an attempt that ended short of success: each host's own, else what it published.

    A host whose body started and that returned no report (it raised, or was stopped) ran its body
    until the gang ended (`ended`): that is its `step_done`, so the attempt's body ends when the gang did.
    """
    out = []
    for index, report in enumerate(reports):
        report = dict(report) if report else dict(found.get(index, {}))
        if "step_started" in report and "step_done" not in report:
            report["step_done"] = ended
        out.append(report)
    return out


def process_start_time() -> float:
    """When this process started (wall clock), from /proc; now where /proc has no answer.

    Counted back from the time since boot (not /proc/stat's btime, which is rounded to the second).
    """
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


class Timeline:
    """The phase times of one step attempt (a preemption retry starts a new one)."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.detail: dict[str, float] = {}  # finer driver-side moments, in the JSON line only
        self.per_host: list[dict[str, float]] = []
        self.resumed_after = None  # a cluster.suspend.Suspension: this attempt resumes a suspended step
        # For the goodput figures (rayslice.core.goodput): chips held, how the attempt ended, reported spans.
        self.chips: float = 0.0
        self.outcome: str | None = None
        self.spans: dict[str, list[list[float]]] = {}

    def add_spans(self, spans: dict[str, list[list[float]]]) -> None:
        """Spans of a kind in `rayslice.core.goodput.SPAN_KINDS` (e.g. a preemption's lost work), epoch seconds."""
        for kind, found in spans.items():
            self.spans.setdefault(kind, []).extend([float(a), float(b)] for a, b in found)

    def record(self) -> dict:
        """This attempt's JSON record (the `[rayslice] phases: ` line, unrounded): what goodput reads."""
        record: dict = {phase: self.times[phase] for phase in PHASES if phase in self.times}
        if (queued := self.queue_wait()) is not None:
            record["queue_wait_s"] = queued
        if "notice" in self.detail and "released" in self.times:
            record["notice_to_released_s"] = self.times["released"] - self.detail["notice"]
        if self.resumed_after is not None:
            record["suspended"] = self.resumed_after.record(self.times.get("step_started"))
        if self.detail:
            record["detail"] = dict(self.detail)
        if self.per_host:
            record["hosts"] = [dict(host) for host in self.per_host]
        if self.chips:
            record["chips"] = self.chips
        if self.outcome:
            record["outcome"] = self.outcome
        if self.spans:
            record["spans"] = {kind: [list(span) for span in found] for kind, found in self.spans.items()}
        return record

    def note(self, moment: str, at: float | None = None) -> None:
        self.detail[moment] = time.time() if at is None else at

    def queue_wait(self) -> float | None:
        """Seconds from taking a place in the admission queue to being admitted (None: not queued)."""
        if "queued" in self.detail and "admitted" in self.detail:
            return self.detail["admitted"] - self.detail["queued"]
        return None

    def mark(self, phase: str, at: float | None = None) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        self.times[phase] = time.time() if at is None else at

    def hosts(self, reports: list[dict[str, float]]) -> None:
        """Each host phase at its latest host (a host that did not reach a phase leaves it unset)."""
        reports = [dict(report) for report in reports]
        for report in reports:  # the step's reported spans: kept apart from the phase times
            self.add_spans(report.pop(SPANS_KEY, None) or {})
        self.per_host = reports
        for phase in HOST_PHASES:
            values = [report[phase] for report in reports if phase in report]
            if values and len(values) == len(reports):
                self.times[phase] = max(values)

    def lines(self) -> list[str]:
        """One readable summary (each phase reached, seconds after the one before), then the JSON line."""
        known = [(phase, self.times[phase]) for phase in PHASES if phase in self.times]
        if not known:
            return []
        first = known[0][1]
        steps = [f"{PHASES[phase]} +{at - before:.2f} s" for (_, before), (phase, at) in pairwise(known)]
        queued = self.queue_wait()
        out = [f"[rayslice] timeline: {PHASES[known[0][0]]}, " + ", ".join(steps)
               + f" ({known[-1][1] - first:.2f} s in all"
               + (f", {queued:.2f} s of it in the admission queue" if queued is not None else "")
               + self._suspension_text() + ")"]
        out.append(MARKER + json.dumps(_rounded(self.record())))
        return out

    def _suspension_text(self) -> str:
        """Suspended time apart from running time: the notice's share of this attempt, the pause before it."""
        text = ""
        if "notice" in self.detail and "released" in self.times:
            text += (f"; suspended by a preemption notice: {self.times['released'] - self.detail['notice']:.2f} s "
                     "from the notice to the capacity released")
        if self.resumed_after is not None and "step_started" in self.times:
            text += (f"; resumed after {self.times['step_started'] - self.resumed_after.released:.2f} s suspended "
                     "(from the suspended attempt's release to this step start)")
        return text


def parse_phases(log: str) -> list[dict[str, float]]:
    """Every phases line of a job log (one per attempt), as {phase: epoch seconds} (plus "detail", "hosts")."""
    found = []
    for line in log.splitlines():
        at = line.find(MARKER)
        if at >= 0:
            found.append(json.loads(line[at + len(MARKER):]))
    return found


def job_accepted_time(submission_id: str) -> float | None:
    """When Ray's job manager accepted this job (its JobInfo start_time), or None outside a Ray job."""
    if not submission_id:
        return None
    try:
        from rayslice.cluster.ray_jobs import job_info

        info = job_info(submission_id)
        start = info.get("start_time") if info else None
        return float(start) / 1000 if start else None
    except Exception:  # a phase line must never fail the step
        return None


def _rounded(value: Any) -> Any:
    """`value` with every float rounded to 0.1 ms (the record's precision); flags and counts as they are."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return value
