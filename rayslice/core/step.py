"""The step as it travels from the Airflow side to the cluster-side launcher, and its result back.

A `StepSpec` is JSON: the accelerator request, what to run (an import path, or a function
serialized by value), its keyword arguments, the limits, and who owns it. The launcher
prints its result as one marked line at the end of the Ray job's log; `parse_result`
finds it again. Pure pydantic: no ray, jax or airflow here.
"""

from __future__ import annotations

import base64
import json
import sys
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rayslice.core.accelerators import StepRequest
from rayslice.core.exceptions import InvalidRequestError, StepFailedError

RESULT_MARKER = "::rayslice-result::"
ERROR_MARKER = "::rayslice-error::"
#: Each host's last line: the driver waits (briefly) until every host's output reached it before its own last line.
HOST_DONE_MARKER = "::rayslice-host-done::"
#: The job metadata key that holds a step's marker tag (see `StepSpec.marker_tag`).
MARKER_TAG_KEY = "marker_tag"
#: The most JSON a step may return: the result travels as one line of the job's log, and then as an XCom.
RESULT_LIMIT_BYTES = 1024 * 1024


class TaskRef(BaseModel):
    """Which Airflow task try a step belongs to: what every record of a step (owner, holder, usage bar) names."""

    dag_id: str = ""
    run_id: str = ""
    task_id: str = ""
    map_index: int = -1
    try_number: int = 0

    @staticmethod
    def fields_from(metadata: dict[str, Any]) -> dict[str, Any]:
        """These fields as a rayslice Ray job's metadata holds them (all strings), with the defaults for gaps."""

        def number(key: str, default: int) -> int:
            try:
                return int(metadata.get(key, default))
            except (TypeError, ValueError):
                return default

        return {"dag_id": metadata.get("dag_id", ""), "run_id": metadata.get("run_id", ""),
                "task_id": metadata.get("task_id", ""), "map_index": number("map_index", -1),
                "try_number": number("try_number", 0)}


class Owner(TaskRef):
    """Who a reservation belongs to, so it can be traced back to its Airflow task (and reaped).

    `ti_id` is the Airflow task instance's id: Airflow 3 gives every try its own UUID, so it tells
    one try apart from a re-created run's try of the same number, or another Airflow's.
    """

    model_config = ConfigDict(frozen=True)

    ti_id: str = ""
    submission_id: str = ""


#: Where the cluster side comes from: uploaded with each job, or the copy in the cluster's image.
Launcher = Literal["shipped", "installed"]


def _rayslice_version() -> str:
    from rayslice import __version__  # the package imports this module: read it at call time

    return __version__


class StepSpec(BaseModel):
    """Everything the launcher needs to run one step; the job's `spec.json`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    request: StepRequest
    entrypoint: str | None = Field(None, description="'package.module:function' importable on the cluster")
    pickled: str | None = Field(None, description="base64 cloudpickle of the function, by value")
    python: str = Field(default_factory=lambda: f"{sys.version_info[0]}.{sys.version_info[1]}")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    capacity_timeout: float = 600.0
    step_timeout: float | None = None
    hang_timeout: float | None = Field(
        300.0, gt=0, description="simulated cluster only: fail the step once every host has sat idle inside JAX "
        "(a collective no peer joins) this many seconds; None: never",
    )
    preemption_retries: int = Field(0, ge=0, description="whole-gang retries when a host's node is lost")
    checkpoint_root: str | None = Field(
        None, description="root URL of checkpoint folders (else the cluster's RAYSLICE_CHECKPOINT_ROOT)"
    )
    owner: Owner = Field(default_factory=Owner)
    launcher: Launcher = Field(
        "shipped", description="ship rayslice's cluster side with the job, or use the copy installed on the cluster"
    )
    rayslice_version: str = Field(default_factory=_rayslice_version,
                                  description="the submitter's rayslice; an installed launcher must match it")
    marker_tag: str = Field("", pattern=r"^[0-9a-f]*$",
                            description="a per-submission secret in the driver's result and error lines, so that "
                                        "marker lines from elsewhere (another job's log a step prints) never count")

    @model_validator(mode="after")
    def _exactly_one_callable(self) -> StepSpec:
        if (self.entrypoint is None) == (self.pickled is None):
            raise InvalidRequestError("a step needs exactly one of `entrypoint` ('pkg.module:function') or a function")
        if self.entrypoint is not None and ":" not in self.entrypoint:
            raise InvalidRequestError(f"entrypoint {self.entrypoint!r} must look like 'package.module:function'")
        return self

    @classmethod
    def for_function(cls, fn: Any, **fields: Any) -> StepSpec:
        """Serialize `fn` by value, with the module-level helpers of the file it was defined in."""
        import cloudpickle

        module = sys.modules.get(getattr(fn, "__module__", ""), None)
        by_value = module is not None and module.__name__ not in ("builtins",) and not _is_installed(module)
        if by_value:
            cloudpickle.register_pickle_by_value(module)
        try:
            blob = cloudpickle.dumps(fn)
        finally:
            if by_value:
                cloudpickle.unregister_pickle_by_value(module)
        return cls(pickled=base64.b64encode(blob).decode(), **fields)


def _is_installed(module: Any) -> bool:
    """Modules from site-packages are imported on the cluster; DAG files are shipped by value."""
    path = getattr(module, "__file__", "") or ""
    return "site-packages" in path or "dist-packages" in path


class ResultTooLargeError(ValueError):
    """The step's value is JSON, but more than the result line carries."""


def result_marker(tag: str = "") -> str:
    """The start of the driver's result line: `::rayslice-result::` then, for a tagged step, `<tag>::`."""
    return f"{RESULT_MARKER}{tag}::" if tag else RESULT_MARKER


def error_marker(tag: str = "") -> str:
    return f"{ERROR_MARKER}{tag}::" if tag else ERROR_MARKER


def format_result(value: Any, tag: str = "") -> str:
    """The marked result line; TypeError for a value that is not JSON, ResultTooLargeError past the limit."""
    text = json.dumps(value, allow_nan=True)
    if len(text.encode()) > RESULT_LIMIT_BYTES:
        raise ResultTooLargeError(
            f"the step's result is {len(text.encode()) / 1024 / 1024:.1f} MiB of JSON, over the "
            f"{RESULT_LIMIT_BYTES // 1024 // 1024} MiB a step may return (it travels as one log line and an XCom): "
            "write large outputs (models, arrays, tables) to storage, e.g. rayslice.get_step_context().checkpoint_dir, "
            "and return their path"
        )
    return result_marker(tag) + text


def format_error(kind: str, message: str, tag: str = "") -> str:
    return error_marker(tag) + json.dumps({"type": kind, "message": message})


def _driver_line(log: str, marker: str) -> str | None:
    """What follows `marker` on the last line that starts with it, or None.

    Only the launcher's driver prints lines that start with a marker: Ray prefixes every line a
    host prints with `(slice/hostN pid=...)`, so a marker a step prints (another job's log, an
    echoed input) is not at a line's start; where a "\\r" still puts it there (Ray splits host
    output at "\\r" too), the tag, which the step's text does not hold, tells it apart.
    """
    for line in reversed(log.split("\n")):
        if line.startswith(marker):
            return line[len(marker):].rstrip("\r")
    return None


def _loads(text: str, marker: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise StepFailedError(
            f"the job's log has a {marker} line that is not JSON ({exc}): {text[:200]!r}; the launcher prints only "
            "JSON there, so something else wrote it at the start of a line of the driver's output"
        ) from None


def parse_result(log: str, tag: str = "") -> tuple[bool, Any]:
    """(found, value) from the driver's last result line; StepFailedError for one that is not JSON."""
    text = _driver_line(log, result_marker(tag))
    if text is None:
        return False, None
    return True, _loads(text, result_marker(tag))


def parse_error(log: str, tag: str = "") -> dict[str, str] | None:
    """The launcher's one-line error summary (type and message), if its driver printed one."""
    text = _driver_line(log, error_marker(tag))
    if text is None:
        return None
    error = _loads(text, error_marker(tag))
    if not isinstance(error, dict) or not isinstance(error.get("type"), str) or "message" not in error:
        raise StepFailedError(f"the job's log has a {error_marker(tag)} line without a type and message: "
                              f"{text[:200]!r}")
    return {"type": error["type"], "message": str(error["message"])}
