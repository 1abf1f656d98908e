"""The "Ray job" button on a step's task: the job's page in the Ray dashboard.

The operator pushes the job's submission id to XCom (key ``ray_submission_id``) before it
waits, so the link works while the step runs, and after it failed or was killed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from airflow.sdk import BaseOperatorLink

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.types import TaskInstanceKey

__all__ = ["SUBMISSION_ID_KEY", "RayJobLink"]

SUBMISSION_ID_KEY = "ray_submission_id"
log = logging.getLogger(__name__)


class RayJobLink(BaseOperatorLink):
    """Links a task to ``<dashboard>/#/jobs/<submission id>``."""

    name = "Ray job"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        from airflow.sdk.execution_time.xcom import XCom  # the configured XCom backend

        sid = XCom.get_value(ti_key=ti_key, key=SUBMISSION_ID_KEY)
        if not sid:
            return ""
        from rayslice.hooks.ray import RayHook

        conn_id = getattr(operator, "ray_conn_id", RayHook.default_conn_name)
        try:
            return RayHook(conn_id).settings().job_url(str(sid))
        except Exception as exc:  # a link must never fail the task
            log.warning("no Ray job link for %s: %s", sid, exc)
            return ""
