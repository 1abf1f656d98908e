"""Where a step's chip-time went: waiting, start-up, productive, checkpointing, lost, suspended.

Goodput is productive chip-time over chip-time held (Google's "ML goodput", the figure TPU
fleets are run by). The launcher's phase records (`rayslice.cluster.phases`, one JSON record per
attempt) hold every moment this needs; this module turns them into figures, on both sides: the
launcher prints them at the step's end, and `rayslice usage` and the Slices page compute them
from the same records read back from the job's log. Pure Python: no ray, jax or airflow.

Each attempt's held time, `chips x (released - reserved)`, is split with nothing left over:

- `startup`: reservation to the step started on every host (host processes, JAX imported and wired);
- `productive`: inside the step's body, less the two below;
- `checkpointing`: spans the step reported through its context (`get_step_context().checkpointing()`);
- `lost`: work done and then thrown away: from the last checkpoint to a preemption, done again
  after the resume;
- `teardown`: the body's end to the capacity's release.

Two more are counted in seconds, and in chip-seconds of the chips asked for, but not held:

- `waiting`: from the job's acceptance (a retried gang: from its new place in the queue) to the
  reservation: the admission queue, mostly;
- `suspended`: spans the step spent suspended, from its capacity given back on a preemption notice
  until it held capacity again (so not also counted as `waiting`).

Records (the JSON of a `[rayslice] phases: ` line; all keys but the phase times are optional):

- the phase times (`accepted` ... `released`, epoch seconds) and `detail` (`queued`, `admitted`,
  `gang_returned`, ...), as `Timeline` writes them;
- `chips`: chips (or accelerators) the attempt held;
- `outcome`: `succeeded`, `failed`, `stopped`, `preempted`, or `grew` (an elastic step stopped to grow);
- `spans`: {`checkpointing` | `lost` | `suspended`: [[start, end], ...]} (epoch seconds).

A `lost` span comes from whoever knows where the last checkpoint was (a preemption path that
records it). Without one, a `preempted` (or `failed`) attempt's work after its last reported
checkpoint (all of its body, if it reported none) is counted lost: a resume, or a retry, redoes
it. A record that holds only `spans` (e.g. `{"spans": {"suspended": [[t0, t1]]}, "chips": 16}`)
adds just those spans.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rayslice.core.step import GOODPUT_RECORD_MARKER

#: Held chip-time, split with nothing left over.
HELD = ("startup", "productive", "checkpointing", "lost", "teardown")
#: Counted, but not held.
NOT_HELD = ("waiting", "suspended")
CATEGORIES = HELD + NOT_HELD
#: The span kinds a record (or a step, through its context) may report.
SPAN_KINDS = ("checkpointing", "lost", "suspended")
#: Outcomes whose work after the last reported checkpoint is lost (a retry or a resume does it again).
LOSES_WORK = ("preempted", "failed")
#: The machine-readable line with a step's totals, at the end of its job log (kept out of task logs).
RECORD_MARKER = GOODPUT_RECORD_MARKER
#: A command step's processes append their reported spans here, one JSON object a line.
SPANS_FILE_ENV = "RAYSLICE_SPANS_FILE"


@dataclass
class Account:
    """Seconds and chip-seconds per category; `held_chip_s` is the chip-time held (the sum of HELD)."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    chip_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    held_chip_s: float = 0.0
    attempts: int = 0
    #: Each attempt's hold: [reserved, released, chips] (epoch seconds): what `rayslice usage` bills.
    held: list[list[float]] = field(default_factory=list)

    @property
    def goodput(self) -> float | None:
        """Productive chip-time over chip-time held (None: nothing held)."""
        return self.chip_s["productive"] / self.held_chip_s if self.held_chip_s > 0 else None

    def add(self, other: Account) -> Account:
        for name in CATEGORIES:
            self.seconds[name] += other.seconds.get(name, 0.0)
            self.chip_s[name] += other.chip_s.get(name, 0.0)
        self.held_chip_s += other.held_chip_s
        self.attempts += other.attempts
        self.held.extend(list(span) for span in other.held)
        return self

    def to_json(self) -> dict[str, Any]:
        return {"seconds": {k: round(v, 4) for k, v in self.seconds.items()},
                "chip_s": {k: round(v, 4) for k, v in self.chip_s.items()},
                "held_chip_s": round(self.held_chip_s, 4), "attempts": self.attempts,
                "goodput": None if self.goodput is None else round(self.goodput, 6),
                "held": [[round(a, 4), round(b, 4), c] for a, b, c in self.held]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Account:
        out = cls()
        for name in CATEGORIES:
            out.seconds[name] = float((data.get("seconds") or {}).get(name, 0.0))
            out.chip_s[name] = float((data.get("chip_s") or {}).get(name, 0.0))
        out.held_chip_s = float(data.get("held_chip_s", 0.0))
        out.attempts = int(data.get("attempts", 0))
        held = data.get("held")
        for span in held if isinstance(held, list) else []:  # a record of an older launcher has none
            if isinstance(span, list) and len(span) == 3 and all(isinstance(x, int | float) for x in span):
                out.held.append([float(x) for x in span])
        return out

    def summary(self) -> str:
        """The task log's line: goodput, then where the held chip-time went, then what was not held."""
        if self.held_chip_s <= 0:
            head = "no chip-time held"
        else:
            head = f"{self.goodput:.1%} of {self.held_chip_s / 3600:.4g} chip-h held"
        parts = [f"{name} {self.seconds[name]:.2f} s ({self.chip_s[name] / self.held_chip_s:.1%})"
                 for name in HELD if self.held_chip_s > 0 and self.seconds[name] > 0]
        waits = [f"{name} {self.seconds[name]:.2f} s" for name in NOT_HELD if self.seconds[name] > 0]
        attempts = f" over {self.attempts} attempts" if self.attempts > 1 else ""
        return (f"[rayslice] goodput: {head}{attempts}" + (": " + ", ".join(parts) if parts else "")
                + ("; not held: " + ", ".join(waits) if waits else ""))


def _merged(spans: Iterable[Iterable[float]], low: float, high: float) -> list[tuple[float, float]]:
    """Spans clipped to [low, high], overlaps joined (two hosts' checkpoints of one save count once)."""
    clipped = sorted((max(float(a), low), min(float(b), high)) for a, b in spans)
    out: list[tuple[float, float]] = []
    for a, b in clipped:
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _minus(spans: list[tuple[float, float]], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """`spans` with every part inside `cut` removed."""
    out = []
    for a, b in spans:
        pieces = [(a, b)]
        for c, d in cut:
            pieces = [p for x, y in pieces for p in ((x, min(y, c)), (max(x, d), y)) if p[1] > p[0]]
        out.extend(pieces)
    return out


def attempt_account(record: Mapping[str, Any]) -> Account:
    """One record's figures (see the module's docstring for what a record holds)."""
    out = Account()
    chips = float(record.get("chips") or 0)
    spans = record.get("spans") or {}
    detail = record.get("detail") or {}
    for a, b in _merged(spans.get("suspended") or [], float("-inf"), float("inf")):
        out.seconds["suspended"] += b - a
        out.chip_s["suspended"] += (b - a) * chips
    held_from = next((record[p] for p in ("reserved", "hosts_started", "step_started") if p in record), None)
    if held_from is None:
        return out  # nothing was held: a record of spans only, or an attempt that never got capacity
    out.attempts = 1
    asked = min((t for t in (record.get("accepted"), record.get("driver_started"), detail.get("queued"))
                 if t is not None), default=held_from)
    # Waiting for capacity again after a suspension is the suspension's time, not the queue's.
    suspended_meanwhile = _length(_merged(spans.get("suspended") or [], asked, held_from))
    out.seconds["waiting"] = max(0.0, held_from - asked - suspended_meanwhile)
    out.chip_s["waiting"] = out.seconds["waiting"] * chips
    held_to = next((record[p] for p in ("released",) if p in record),
                   detail.get("gang_returned", record.get("step_done", held_from)))
    held_to = max(held_to, held_from)
    # The body starts once it started on every host. An attempt whose hosts reported, but not all of them a start
    # (one failed or was stopped before its body), never started its body: start-up to its end. A record without
    # host reports (an older launcher's failed attempt): the body started when its hosts had started.
    if "step_started" in record:
        started = record["step_started"]
    elif record.get("hosts"):
        started = detail.get("gang_returned", held_to)
    else:
        started = detail.get("actors_started", held_to)
    started = min(max(started, held_from), held_to)
    body_end = record.get("step_done", detail.get("gang_returned", held_to))
    body_end = min(max(body_end, started), held_to)
    checkpointing = _merged(spans.get("checkpointing") or [], started, body_end)
    lost = _merged(spans.get("lost") or [], started, body_end)
    if not lost and record.get("outcome") in LOSES_WORK:  # redone after the resume: all since the last save
        last_save = max((b for _, b in checkpointing), default=started)
        lost = [(last_save, body_end)] if body_end > last_save else []
    checkpointing = _minus(checkpointing, lost)
    seconds = {
        "startup": started - held_from,
        "checkpointing": _length(checkpointing),
        "lost": _length(lost),
        "teardown": held_to - body_end,
    }
    seconds["productive"] = (body_end - started) - seconds["checkpointing"] - seconds["lost"]
    for name, value in seconds.items():
        out.seconds[name] = value
        out.chip_s[name] = value * chips
    out.held_chip_s = (held_to - held_from) * chips
    out.held = [[float(held_from), float(held_to), chips]]
    return out


def step_account(records: Iterable[Mapping[str, Any]]) -> Account:
    """A step's figures over all its records (attempts, and span-only records)."""
    total = Account()
    for record in records:
        total.add(attempt_account(record))
    return total


def record_line(account: Account) -> str:
    return RECORD_MARKER + json.dumps(account.to_json())


def parse_record(log: str) -> Account | None:
    """The last goodput record in a job log (or its last lines), or None.

    Only the driver's own line counts: one that starts with the marker. The job log holds the hosts'
    output too, each line behind Ray's `(label pid=…)` prefix, and a host's late line may follow the
    driver's record; lines are split at newlines only, so a carriage return cannot start a line either.
    """
    found = None
    for line in log.split("\n"):
        if line.startswith(RECORD_MARKER):
            try:
                found = Account.from_json(json.loads(line[len(RECORD_MARKER):]))
            except (ValueError, TypeError, AttributeError):
                continue
    return found


# What a running step reports about itself (its host process's side).
_lock = threading.Lock()
_reported: list[tuple[str, float, float]] = []


def report_span(kind: str, start: float, end: float) -> None:
    """Record a span of this step's time as `kind` ("checkpointing", ...), in epoch seconds.

    In a function step it stays in this process until the launcher collects it; in a command
    step's program it is appended to the file the launcher named (`RAYSLICE_SPANS_FILE`).
    """
    if kind not in SPAN_KINDS:
        raise ValueError(f"kind={kind!r} is not a span kind: use {', '.join(SPAN_KINDS)}")
    start, end = float(start), float(end)
    if not end >= start:
        raise ValueError(f"a span must end at or after its start: start={start}, end={end}")
    path = os.environ.get(SPANS_FILE_ENV)
    if path:
        with open(path, "a") as out:
            out.write(json.dumps([kind, start, end]) + "\n")
        return
    with _lock:
        _reported.append((kind, start, end))


@contextmanager
def span(kind: str) -> Iterator[None]:
    """Time the block as a span of `kind`; recorded also when the block raises."""
    start = time.time()
    try:
        yield
    finally:
        report_span(kind, start, time.time())


def collect(spans_file: str | None = None) -> dict[str, list[list[float]]]:
    """The spans reported in this process since the last collect (and in `spans_file`), by kind."""
    with _lock:
        taken = list(_reported)
        _reported.clear()
    if spans_file and os.path.exists(spans_file):
        with open(spans_file) as lines:
            for line in lines:
                try:
                    kind, start, end = json.loads(line)
                except (ValueError, TypeError):
                    continue  # a torn last line of a killed program
                if kind in SPAN_KINDS and isinstance(start, int | float) and isinstance(end, int | float):
                    taken.append((kind, float(start), float(end)))
    out: dict[str, list[list[float]]] = {}
    for kind, start, end in taken:
        out.setdefault(kind, []).append([round(start, 4), round(end, 4)])
    return out
