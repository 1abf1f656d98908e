"""Suspension: what the launcher says and records when a preemption notice stopped a step's gang.

The gang ended as suspended (cluster/gang.py raises `SuspendedError`), its capacity is already
released, and `run_step` requeues it: at its original arrival and priority in the admission
queue (the same place a preemption retry keeps), on capacity other than the drained node's,
counting within `preemption_retries`, and with no Airflow retry (it is the same Ray job). The
step then resumes from its latest checkpoint: the checkpoint folder is described before the
next attempt. The suspension's moments go into the next attempt's timeline record, so the time
a step spent suspended is counted apart from its running time.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from rayslice.cluster import checkpoints
from rayslice.cluster.phases import Timeline
from rayslice.core.exceptions import SuspendedError
from rayslice.core.step import StepSpec


@dataclass(frozen=True)
class Suspension:
    """When the notice came, when the suspended attempt's capacity was free, and whether it was stopped."""

    noticed: float
    released: float
    stopped_at_deadline: bool
    node: str
    slice_name: str

    @classmethod
    def of(cls, error: SuspendedError, timeline: Timeline) -> Suspension:
        released = timeline.times.get("released", 0.0)
        return cls(noticed=timeline.detail.get("notice", released), released=released,
                   stopped_at_deadline=bool(getattr(error, "stopped_at_deadline", False)),
                   node=getattr(error, "node_id", ""), slice_name=getattr(error, "slice_name", ""))

    def record(self, resumed: float | None) -> dict:
        """The resumed attempt's `suspended` record (epoch seconds; `suspended_s` until the step started again)."""
        out = {"notice": round(self.noticed, 4), "released": round(self.released, 4),
               "stopped_at_deadline": self.stopped_at_deadline, "slice": self.slice_name}
        if resumed is not None:
            out["resumed"] = round(resumed, 4)
            out["suspended_s"] = round(resumed - self.released, 4)
        return out


def requeued(spec: StepSpec, error: SuspendedError, arrival: float, number: int, checkpoint_dir: str | None) -> str:
    """The task log's line: what happened, where the step stands in the queue, and where it resumes."""
    at = datetime.datetime.fromtimestamp(arrival, datetime.UTC).strftime("%H:%M:%S")
    where = "its latest checkpoint"
    if checkpoint_dir:
        steps = checkpoints.complete_steps(checkpoint_dir)
        where = (f"the checkpoint of step {steps[-1]} in {checkpoint_dir}" if steps
                 else f"the start: {checkpoint_dir} holds no complete checkpoint")
    avoiding = f" (not on {error.slice_name}, whose node is going)" if getattr(error, "slice_name", "") else ""
    return (f"{error}. Its capacity is released; it goes back into the queue at its original arrival "
            f"({at} UTC) and priority {spec.priority if spec.priority is not None else 0}, and resumes from {where}"
            f"{avoiding}: resumption {number} of {spec.preemption_retries} (preemption_retries), no Airflow retry")


def exhausted(spec: StepSpec) -> str:
    return (f"suspended, and its preemption_retries={spec.preemption_retries} are used up: the step fails as "
            "preempted (raise preemption_retries to let it resume)")


def marker_text(why: str, limit: int = 160) -> str:
    """Why a requeued step was suspended, as its queue marker's name carries it to the Slices page and `capacity`."""
    why = why.removeprefix("suspended by a preemption notice (").split("); ", 1)[0]
    return why if len(why) <= limit else why[: limit - 1] + "…"
