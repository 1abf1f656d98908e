"""rayslice's Airflow metrics, through Airflow's own Stats: StatsD or OpenTelemetry, as `[metrics]` configures.

The cluster's side of a step (its phases, the queue, chips held) is in Ray's metrics
(`rayslice.cluster.metrics`); these say what Airflow saw: how many steps it submitted and from
where, how many waits it handed to the triggerer, and how long it waited for each step's end.
Tags are bounded (where, outcome); a plain StatsD, which drops tags, still gets the totals.
A metric never fails a task.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

#: Counter: steps submitted to Ray, tag `where` (worker | triggerer).
SUBMISSIONS = "rayslice.submissions"
#: Counter: steps whose wait went to the triggerer, tag `where` (the process that deferred or started it).
DEFERRALS = "rayslice.deferrals"
#: Timer: from submission (or the trigger taking the wait over) to the job's end, tags `where`, `outcome`.
WAIT = "rayslice.wait"


def _stats():  # imported late: a DAG file's parse never pays for Airflow's metrics set-up
    from airflow.sdk.observability import stats

    return stats


def submitted(where: str) -> None:
    with contextlib.suppress(Exception):
        _stats().incr(SUBMISSIONS, tags={"where": where})


def deferred(where: str) -> None:
    with contextlib.suppress(Exception):
        _stats().incr(DEFERRALS, tags={"where": where})


def waited(seconds: float, *, where: str, outcome: str) -> None:
    with contextlib.suppress(Exception):
        _stats().timing(WAIT, timedelta(seconds=max(seconds, 0.0)), tags={"where": where, "outcome": outcome})
