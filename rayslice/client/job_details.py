"""A Ray job as the Jobs API describes it: its status, and its details record.

Apart from the client that fetches them because most readers only read them: the submission's
follower, the Slices page's job records, `rayslice usage` and `rayslice reap` all judge jobs by these.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["JobDetails", "JobStatus"]


class JobStatus(StrEnum):
    """A Ray job's status, as the Jobs API reports it."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @property
    def is_terminal(self) -> bool:
        """True for STOPPED, SUCCEEDED and FAILED: the job will not change status again."""
        return self in (JobStatus.STOPPED, JobStatus.SUCCEEDED, JobStatus.FAILED)


class JobDetails(BaseModel):
    """One job, as ``GET /api/jobs/{id}`` describes it; unknown fields are kept, not rejected.

    ``start_time`` and ``end_time`` are Unix timestamps in milliseconds.
    """

    model_config = ConfigDict(extra="allow")

    status: JobStatus
    submission_id: str | None = None
    job_id: str | None = None
    type: str | None = None
    entrypoint: str | None = None
    message: str | None = None
    error_type: str | None = None
    start_time: int | None = None
    end_time: int | None = None
    metadata: dict[str, str] | None = None
    runtime_env: dict[str, Any] | None = None
    driver_exit_code: int | None = None

    @property
    def is_terminal(self) -> bool:
        return self.status.is_terminal
