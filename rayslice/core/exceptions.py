"""The one exception tree of rayslice.

Callers catch ``RaysliceError`` for anything of ours; the second bases let
generic handlers (``except ValueError`` / ``except TimeoutError``) keep working.
Messages are composed by whoever raises.

    RaysliceError(Exception)
     ├── InvalidRequestError(RaysliceError, ValueError)
     ├── CapacityTimeoutError(RaysliceError, TimeoutError)
     ├── UnsatisfiableRequestError(RaysliceError)
     ├── StepFailedError(RaysliceError)      slice_index, worker_id, host, cause, exit_code
     │    └── HostLostError(StepFailedError)
     │         └── PreemptedError(HostLostError)   the host's node died or was drained
     │              └── SuspendedError(PreemptedError)   a notice came: the gang stopped, released, requeued
     ├── StepSuspended(RaysliceError)        a step raises it after checkpointing on a preemption notice
     ├── StepTimeoutError(RaysliceError, TimeoutError)
     ├── SubmissionConflictError(RaysliceError)   a submission id already taken by another submitter
     └── RayJobsError(RaysliceError)         status_code
          ├── RayUnreachableError(RayJobsError)
          ├── RayAuthError(RayJobsError)
          └── JobNotFoundError(RayJobsError)

Attributes are keyword-only and kept out of ``args``, so the errors pickle
across Ray (``BaseException.__reduce__`` carries ``__dict__``).
"""

from __future__ import annotations


class RaysliceError(Exception):
    """Base of every error rayslice raises on purpose."""


class InvalidRequestError(RaysliceError, ValueError):
    """Raised at construction when an accelerator request or other input is invalid."""


class CapacityTimeoutError(RaysliceError, TimeoutError):
    """Raised when the requested capacity did not appear within ``capacity_timeout``."""


class UnsatisfiableRequestError(RaysliceError):
    """Raised before waiting when no node, present or autoscalable, could ever hold the request."""


class StepFailedError(RaysliceError):
    """Raised when the step's user code failed on some worker; says where."""

    def __init__(
        self,
        message: str,
        *,
        slice_index: int | None = None,
        worker_id: int | None = None,
        host: str | None = None,
        cause: str = "",
        exit_code: int | None = None,
    ) -> None:
        super().__init__(message)
        self.slice_index = slice_index
        self.worker_id = worker_id
        self.host = host
        self.cause = cause
        self.exit_code = exit_code  # a command step's exit code on that host


class HostLostError(StepFailedError):
    """Raised when a host process or node died under the step (preemption-like)."""


class PreemptedError(HostLostError):
    """Raised when a host's whole node died or was drained: preemption, retried as a whole gang."""


class SuspendedError(PreemptedError):
    """Raised when a preemption notice reached the step's capacity: the gang was stopped (it checkpointed and
    returned, or was stopped at the deadline), its capacity released, and the step goes back into the queue.

    A subclass of PreemptedError: it is retried as a whole gang and counts within `preemption_retries`.
    """


class StepSuspended(RaysliceError):
    """Raise it from a step function that saved a checkpoint because of a preemption notice.

    `get_step_context().preempted` says a notice came; the launcher then takes the step's end
    (this exception, or any other) as a suspension, not a failure, and resumes it elsewhere.
    """


class CollectiveHangError(StepFailedError):
    """Raised on the simulated cluster when every host process sat idle inside JAX for the step's hang_timeout."""


class StepTimeoutError(RaysliceError, TimeoutError):
    """Raised when a running step exceeded its execution timeout."""


class SubmissionConflictError(RaysliceError):
    """Raised when a submission id is already taken by a job that another try or caller submitted."""


class RanElsewhereError(RaysliceError):
    """A job of a step on several clusters ends with it when another cluster of the set ran the step.

    Not the step's outcome: the submitter takes the outcome of the job that held the claim
    (`rayslice.core.cluster_claim`) and reads this one only as "this cluster stood by".
    """


class RayJobsError(RaysliceError):
    """Raised when a call to the Ray Jobs REST API fails."""

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class RayUnreachableError(RayJobsError):
    """Raised when the Ray dashboard cannot be reached (connection refused, DNS, timeout)."""


class RayAuthError(RayJobsError):
    """Raised when the Ray Jobs API rejects our credentials (401/403)."""


class JobNotFoundError(RayJobsError):
    """Raised when the Ray Jobs API does not know the submission id (404)."""


#: The structured fields of a failure that travel with its message (job log -> trigger event -> Airflow).
FAILURE_FIELDS = ("slice_index", "worker_id", "host", "cause", "exit_code")


def error_fields(exc: BaseException) -> dict[str, object]:
    """Where and how a step failed (slice, worker, host, cause, exit code), for those a failure says; else {}."""
    return {name: value for name in FAILURE_FIELDS
            if (value := getattr(exc, name, None)) is not None and value != ""}


#: The errors a step's Ray job reports by name (the launcher's error line), raised again as such on the Airflow side.
STEP_ERRORS: dict[str, type[RaysliceError]] = {
    cls.__name__: cls
    for cls in (CapacityTimeoutError, CollectiveHangError, HostLostError, InvalidRequestError, PreemptedError,
                RanElsewhereError, StepFailedError, StepTimeoutError, SuspendedError, UnsatisfiableRequestError)
}
