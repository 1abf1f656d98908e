"""rayslice: run accelerator steps of Airflow pipelines on Ray, from TPU slices to GPU fractions.

The public API. Nothing here imports ray, jax or airflow.
"""

from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest, request_from_json, request_to_json
from rayslice.core.context import PreemptionNotice, StepContext, as_path, get_step_context
from rayslice.core.exceptions import (
    CapacityTimeoutError,
    CollectiveHangError,
    HostLostError,
    InvalidRequestError,
    PreemptedError,
    RanElsewhereError,
    RayAuthError,
    RayJobsError,
    RaysliceError,
    RayUnreachableError,
    StepFailedError,
    StepSuspended,
    StepTimeoutError,
    SubmissionConflictError,
    SuspendedError,
    UnsatisfiableRequestError,
)
from rayslice.core.queue import QueueSettings
from rayslice.core.step import Owner, StepSpec
from rayslice.core.version import __version__ as __version__


def __getattr__(name: str):
    """`rayslice.run` (blocking, over HTTP) loads the client side only when used: `import rayslice` stays light."""
    if name == "run":
        from rayslice.client.submission import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "AcceleratorRequest",
    "CapacityTimeoutError",
    "CollectiveHangError",
    "HostLostError",
    "InvalidRequestError",
    "Owner",
    "PreemptedError",
    "PreemptionNotice",
    "QueueSettings",
    "RanElsewhereError",
    "RayAuthError",
    "RayJobsError",
    "RayUnreachableError",
    "RaysliceError",
    "StepFailedError",
    "StepContext",
    "StepSpec",
    "StepSuspended",
    "StepTimeoutError",
    "SubmissionConflictError",
    "SuspendedError",
    "TpuSliceRequest",
    "UnsatisfiableRequestError",
    "as_path",
    "get_step_context",
    "request_from_json",
    "request_to_json",
    "run",
]
