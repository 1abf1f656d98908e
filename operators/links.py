"""The "Ray job" button on a step's task: the job's page in the Ray dashboard.

The operator pushes the job's submission id to XCom (key ``ray_submission_id``) before it
waits, so the link works while the step runs, and after it failed or was killed.

Airflow 3 computes the link in the worker and stores it with the task instance, where anyone who
may read the DAG sees it. So the link is not the dashboard's URL: it is the Slices plugin's
``/rayslice/job/<submission id>?conn_id=<connection>`` on this Airflow, which redirects to the
job's dashboard page only users allowed to read that connection (and refuses everyone else).

A step on a cluster set has a job of that id on every member; one of them runs it. The operator pushes
which one (key ``ray_cluster``: ``{"submission_id": ..., "cluster": <member connection id>}``) as soon as a
cluster claims the step, again after a failover, and last the cluster that ran it; the link then names that
member's connection. Before any cluster claimed it the link names the set, and the route picks the member
from the jobs' records (`rayslice.plugins.slices`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote, urlencode

from airflow.sdk import BaseOperatorLink

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.types import TaskInstanceKey

__all__ = ["CLUSTER_KEY", "SUBMISSION_ID_KEY", "RayJobLink", "job_link", "ran_on"]

SUBMISSION_ID_KEY = "ray_submission_id"
#: A step on a cluster set: the member connection that runs (ran) it, with the submission id it is for.
CLUSTER_KEY = "ray_cluster"


class RayJobLink(BaseOperatorLink):
    """Links a task to ``<airflow>/rayslice/job/<id>``: ``<dashboard>/#/jobs/<id>`` for connection readers."""

    name = "Ray job"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        from airflow.sdk.execution_time.xcom import XCom  # the configured XCom backend

        sid = XCom.get_value(ti_key=ti_key, key=SUBMISSION_ID_KEY)
        if not sid:
            return ""
        from rayslice.hooks.ray import RayHook

        # The operator that ran this try knows its member; else (a set's) the XCom it pushed. A step on one cluster
        # reads nothing more: this runs as every task on a worker ends.
        member = getattr(operator, "_ran_on", None) if getattr(operator, "_submission_id", None) == sid else None
        if member is None and getattr(operator, "_set", None) is not None:
            member = ran_on(XCom.get_value(ti_key=ti_key, key=CLUSTER_KEY), str(sid))
        return job_link(str(sid), member or getattr(operator, "ray_conn_id", RayHook.default_conn_name))


def ran_on(record: object, submission_id: str) -> str | None:
    """The member connection a `CLUSTER_KEY` record names for this submission id (None: none, or another try's)."""
    if isinstance(record, dict) and record.get("submission_id") == submission_id and record.get("cluster"):
        return str(record["cluster"])
    return None


def job_link(submission_id: str, conn_id: str) -> str:
    """``<airflow>/rayslice/job/<id>?conn_id=<conn>``: what the link, the trigger and task logs show, never
    the dashboard's own URL (the plugin's route checks that the reader may read the connection)."""
    from airflow.sdk import conf

    base = (conf.get("api", "base_url", fallback="") or "").rstrip("/")
    return f"{base}/rayslice/job/{quote(submission_id, safe='')}?{urlencode({'conn_id': conn_id})}"
