"""The step as it travels from the Airflow side to the cluster-side launcher, and its result back.

A `StepSpec` is JSON: the accelerator request, what to run (an import path, or a function
serialized by value), its keyword arguments, the limits, and who owns it. The launcher
prints its result as one marked line at the end of the Ray job's log; `parse_result`
finds it again. Pure pydantic: no ray, jax or airflow here.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import sys
import threading
import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rayslice.core import runtime_env as runtime_envs
from rayslice.core.accelerators import StepRequest
from rayslice.core.cluster_claim import ClusterSet
from rayslice.core.exceptions import FAILURE_FIELDS, InvalidRequestError, StepFailedError
from rayslice.core.queue import SETTINGS_ENV, TEAM_PATTERN
from rayslice.core.version import __version__

RESULT_MARKER = "::rayslice-result::"
ERROR_MARKER = "::rayslice-error::"
#: Each host's last line: the driver waits (briefly) until every host's output reached it before its own last line.
HOST_DONE_MARKER = "::rayslice-host-done::"
#: The launcher's machine-readable timing line (every host's phase times): kept in the Ray job's log, out of task logs.
PHASES_MARKER = "[rayslice] phases: "
#: The prefix of a step's goodput totals (`rayslice.core.goodput`), also kept out of task logs.
GOODPUT_RECORD_MARKER = "[rayslice] goodput-record: "
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


#: The Airflow Variable that names a deployment whose `ray` connection sets no `deployment` extra.
DEPLOYMENT_VARIABLE = "rayslice_deployment"


class Owner(TaskRef):
    """Who a reservation belongs to, so it can be traced back to its Airflow task (and reaped).

    `ti_id` is the Airflow task instance's id: Airflow 3 gives every try its own UUID, so it tells
    one try apart from a re-created run's try of the same number, or another Airflow's.
    `deployment` names the Airflow the task belongs to (the `ray` connection's `deployment` extra,
    else one generated per Airflow metadata DB): two Airflows sharing a cluster (staging and prod,
    with the same DAGs and run ids) never take each other's jobs for their own tries, and keep their
    checkpoints apart. Empty outside Airflow.
    """

    model_config = ConfigDict(frozen=True)

    deployment: str = ""
    ti_id: str = ""
    submission_id: str = ""


#: Where the cluster side comes from: uploaded with each job, or the copy in the cluster's image.
Launcher = Literal["shipped", "installed"]


def notice_signal_name(value: Any) -> str:
    """A command step's `notice_signal` as its canonical name ("SIGTERM", or "none"); a clear error otherwise."""
    import signal

    name = value.strip().upper() if isinstance(value, str) else ""
    if name == "NONE":
        return "none"
    if name and not name.startswith("SIG"):
        name = f"SIG{name}"
    if name in ("", "SIGKILL", "SIGSTOP") or not isinstance(getattr(signal, name, None), signal.Signals):
        raise InvalidRequestError(f"notice_signal {value!r} is not a signal a program can catch: give a name such "
                                  "as SIGTERM (the default), SIGINT or SIGUSR1, or 'none' (the notice file only)")
    return name


#: What a checkpoint root may be, as refusals name it.
CHECKPOINT_ROOT_FORMS = "a URL like 'gs://bucket/checkpoints', 's3://bucket/checkpoints' or 'file:///shared/checkpoints'"


def checkpoint_root_problem(root: str) -> str | None:
    """Why `root` cannot be a checkpoint root (None: it can), in words for the refusal.

    It must be a URL, and a `file://` one must name an absolute path: a relative one would resolve
    inside each host's per-step folder (cluster/step_folders.py), which is deleted after the
    step, so every checkpoint would vanish and every resume start fresh. Parsed without fsspec: it
    runs at DAG parse time.
    """
    if "://" not in root:
        return f"must be {CHECKPOINT_ROOT_FORMS}"
    target = root.rsplit("::", 1)[-1]  # a chained URL (`simplecache::gs://...`) stores where its last part says
    protocol, _, path = target.partition("://")
    if not re.fullmatch(r"[a-z][a-z0-9+.\-]*", protocol):
        return (f"must be {CHECKPOINT_ROOT_FORMS}; its protocol {protocol!r} is no lowercase name that fsspec knows "
                f"(no spaces; 'file', not 'FILE'): the hosts would read the whole root as a relative path")
    if protocol == "memory":
        return (f"must be {CHECKPOINT_ROOT_FORMS}; memory:// is each host process's own memory, gone when the "
                "process ends, so every resume would start fresh")
    if protocol in ("file", "local") and not path.startswith("/"):
        return (f"must be {CHECKPOINT_ROOT_FORMS}; a {protocol}:// root needs an absolute path (three slashes, "
                f"'{protocol}:///shared/checkpoints', on storage every host reaches): a relative one resolves inside "
                "each host's per-step folder, which is deleted after the step, so every resume would start fresh")
    return None


#: A preemptible step is suspended and resumed: its resumption counts within `preemption_retries`.
PREEMPTIBLE_NEEDS_RETRIES = (
    "preemptible=True needs preemption_retries of at least 1: a step suspended for a higher-priority one resumes "
    "within its preemption_retries, and with none the suspension would fail the task")


class StepSpec(BaseModel):
    """Everything the launcher needs to run one step; the job's `spec.json`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    request: StepRequest
    callable: str | None = Field(None, description="'package.module:function' importable on the cluster")
    pickled: str | None = Field(None, description="base64 cloudpickle of the function, by value")
    command: list[str] | None = Field(None, description="argv run on every host (a string is split like a shell)")
    runtime_env: dict[str, Any] | None = Field(None, description="Ray's runtime_env for every host process")
    python: str = Field(default_factory=lambda: f"{sys.version_info[0]}.{sys.version_info[1]}")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    capacity_timeout: float = 600.0
    step_timeout: float | None = None
    hang_timeout: float | None = Field(
        300.0, gt=0, description="simulated cluster only: fail the step once every host has sat idle inside JAX "
        "(a collective no peer joins) this many seconds; None: never",
    )
    preemption_retries: int = Field(0, ge=0, description="whole-gang retries when a host's node is lost, or after "
                                                         "a preemption notice suspended the step")
    preemptible: bool = Field(False, description="a waiting step of higher priority may suspend this one, where "
                                                  "the cluster's queue policy says `preemption: lower-priority`")
    notice_signal: str = Field("SIGTERM", description="a command step: the signal its program gets on a preemption "
                                                       "notice (a name such as SIGTERM or SIGUSR1), or 'none'")
    checkpoint_root: str | None = Field(
        None, description="root URL of checkpoint folders (else the cluster's RAYSLICE_CHECKPOINT_ROOT)"
    )
    owner: Owner = Field(default_factory=Owner)
    priority: int | None = Field(None, description="rank in the cluster's admission queue (higher first); "
                                                   "Airflow's priority_weight by default")
    team: str | None = Field(None, min_length=1, max_length=64, pattern=TEAM_PATTERN,
                             description="the team whose quota the step counts against: its connection's `team` "
                                         "extra, or a team under it (`rayslice.core.queue.team_for`)")
    launcher: Launcher = Field(
        "shipped", description="ship rayslice's cluster side with the job, or use the copy installed on the cluster"
    )
    rayslice_version: str = Field(__version__,
                                  description="the submitter's rayslice; an installed launcher must match it")
    marker_tag: str = Field("", pattern=r"^[0-9a-f]*$",
                            description="a per-submission secret in the driver's result and error lines, so that "
                                        "marker lines from elsewhere (another job's log a step prints) never count")
    cluster_set: ClusterSet | None = Field(
        None, description="the step names several clusters: the set, and which of them this job's is "
                          "(rayslice.core.cluster_claim: one of them claims the step before any host starts)")

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        if isinstance(data, dict) and "queue" in data:
            data = dict(data)
            if data.pop("queue") is not None:
                raise InvalidRequestError(
                    "a step cannot set the cluster's queue policy or quotas (`queue=`): they are the cluster "
                    f"operator's, set on the head ({SETTINGS_ENV}) or with `rayslice queue --set`; drop the argument "
                    "(docs/security.md)")
        if isinstance(data, dict) and "entrypoint" in data:
            data = dict(data)
            value = data.pop("entrypoint")
            if value is not None:
                warn_entrypoint("StepSpec")
                if data.get("callable") is not None:
                    raise InvalidRequestError("give `callable` only (`entrypoint` is its old name), not both")
                data["callable"] = value
        return data

    @field_validator("command", mode="before")
    @classmethod
    def _split_command(cls, value: Any) -> Any:
        return split_command(value)

    @field_validator("notice_signal")
    @classmethod
    def _valid_notice_signal(cls, value: str) -> str:
        return notice_signal_name(value)

    @field_validator("checkpoint_root")
    @classmethod
    def _valid_checkpoint_root(cls, value: str | None) -> str | None:
        if value is not None and (problem := checkpoint_root_problem(value)):
            raise InvalidRequestError(f"checkpoint_root {problem}; got {value!r}")
        return value

    @field_validator("runtime_env", mode="before")
    @classmethod
    def _valid_runtime_env(cls, value: Any) -> Any:
        return runtime_envs.validate(value)

    @model_validator(mode="after")
    def _exactly_one_program(self) -> StepSpec:
        given = [name for name in ("callable", "pickled", "command") if getattr(self, name) is not None]
        if len(given) != 1:
            raise InvalidRequestError("a step needs exactly one of `callable` ('pkg.module:function'), a function, "
                                      f"or `command` (an argv list){'; got ' + ', '.join(given) if given else ''}")
        if self.callable is not None and ":" not in self.callable:
            raise InvalidRequestError(f"callable {self.callable!r} must look like 'package.module:function'")
        if self.preemptible and self.preemption_retries < 1:
            raise InvalidRequestError(PREEMPTIBLE_NEEDS_RETRIES)
        return self

    @property
    def entrypoint(self) -> str | None:
        """The old name of `callable`."""
        return self.callable

    @classmethod
    def for_function(cls, fn: Any, **fields: Any) -> StepSpec:
        """Serialize `fn` by value, with its DAG file's helpers and the local modules that file imports.

        A DAG file's own module, and every module loaded from the same folder tree (the DAGs folder's
        `helpers.py`, `include/utils.py`), travel by value: the cluster has none of them. Installed
        packages and rayslice itself are imported there instead.
        """
        return cls(pickled=pickle_function(fn), **fields)


#: cloudpickle's by-value registry is one process-wide set: a thread must not give a module back
#: while another pickles with it (steps shipped from parallel threads, or the triggerer's).
_BY_VALUE = threading.Lock()


def pickle_function(fn: Any) -> str:
    """`fn` by value (base64 of cloudpickle), with its DAG file's helpers and the local modules that file imports."""
    import cloudpickle

    with _BY_VALUE:
        # Modules the caller registered itself stay registered.
        modules = [m for m in _local_modules(sys.modules.get(getattr(fn, "__module__", ""), None))
                   if not cloudpickle.cloudpickle._is_registered_pickle_by_value(m)]
        for module in modules:
            cloudpickle.register_pickle_by_value(module)
        try:
            blob = cloudpickle.dumps(fn)
        except Exception as exc:
            raise InvalidRequestError(
                f"cannot ship {getattr(fn, '__qualname__', fn)!r} by value ({type(exc).__name__}: {exc}): pass the "
                "code it needs in runtime_env={'py_modules': [<folder>]} and use callable='package.module:function'"
            ) from None
        finally:
            for module in modules:
                cloudpickle.unregister_pickle_by_value(module)
    return base64.b64encode(blob).decode()


def undefined_names(fn: Any) -> list[str]:
    """Global and closure names `fn`'s code uses that are not bound yet (a helper defined further down its file).

    Pickled now, such a function would miss them on the cluster; pickled later (on a worker), it would not.
    """
    import builtins

    from cloudpickle.cloudpickle import _extract_code_globals

    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    glob = getattr(fn, "__globals__", {})
    missing = sorted(n for n in _extract_code_globals(code) if n not in glob and not hasattr(builtins, n))
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or (), strict=False):
        try:
            cell.cell_contents  # noqa: B018
        except ValueError:
            missing.append(name)
    return missing


def _local_modules(module: Any) -> list[Any]:
    """`module` (a DAG file) and the modules loaded from its folder tree (not installed, not rayslice)."""
    if module is None or module.__name__ == "builtins" or _is_installed(module):
        return []
    file = getattr(module, "__file__", None)
    if not file:
        return [module]
    root = _import_root(os.path.abspath(file), module.__name__)
    found = {id(module): module}
    for name, other in list(sys.modules.items()):
        other_file = getattr(other, "__file__", None)
        if (other_file and name != "__main__" and name.split(".")[0] != "rayslice" and not _is_installed(other)
                and os.path.abspath(other_file).startswith(root + os.sep)
                and not os.path.abspath(other_file).startswith(sys.prefix + os.sep)):
            found.setdefault(id(other), other)
    return list(found.values())


def _import_root(path: str, name: str) -> str:
    """The folder a module was imported from: the nearest `sys.path` entry above it (Airflow puts the DAGs
    folder there), else the folder that holds its top-level package."""
    entries = [os.path.abspath(p) for p in sys.path if p and "-packages" not in p]
    above = [p for p in entries if path.startswith(p.rstrip(os.sep) + os.sep) and p != os.sep]
    if above:
        return max(above, key=len).rstrip(os.sep)
    root = os.path.dirname(path)
    for _ in range(name.count(".")):
        root = os.path.dirname(root)
    return root


def split_command(value: Any) -> Any:
    """A command as argv: a string is split like a shell would (no shell runs it); an empty one is refused."""
    if isinstance(value, str):
        value = shlex.split(value)
    if value is not None and (not isinstance(value, list | tuple) or not value
                              or not all(isinstance(a, str | int | float) and not isinstance(a, bool) for a in value)):
        raise InvalidRequestError(f"command must be a non-empty argv list such as ['python', 'train.py'] "
                                  f"(or one string), got {value!r}")
    return None if value is None else [str(a) for a in value]


#: A Jinja expression inside a command string: kept whole, and rendered as (part of) one argument.
_JINJA_EXPRESSION = re.compile(r"\{\{.*?\}\}", re.DOTALL)


def split_templated_command(value: str) -> list[str]:
    """A templated command string as argv, split *before* rendering: each `{{ ... }}` stays inside its argument.

    Splitting after rendering would let a rendered value (a run conf's `x --evil`) add arguments.
    Jinja statements (`{% ... %}`) may span arguments, so they are refused: a list says where each goes.
    """
    if "{%" in value or "{#" in value:
        raise InvalidRequestError(f"command {value!r} has a Jinja statement or comment ({{% ... %}}, {{# ... #}}); a "
                                  "command string may hold only {{ ... }} values, each rendered inside one argument. "
                                  "Give a list instead, e.g. ['python', 'train.py', '--name', '{{ params.name }}']")
    expressions: list[str] = []

    def hold(match: re.Match[str]) -> str:
        expressions.append(match.group(0))
        return f"\0{len(expressions) - 1}\0"

    try:
        parts = shlex.split(_JINJA_EXPRESSION.sub(hold, value))
    except ValueError as exc:
        raise InvalidRequestError(f"command {value!r} cannot be split like a shell would: {exc}") from None
    argv = [re.sub(r"\0(\d+)\0", lambda m: expressions[int(m.group(1))], part) for part in parts]
    return split_command(argv)


def warn_entrypoint(where: str) -> None:
    """`entrypoint=` meant an import path here but a shell command in Ray Jobs: its new name is `callable=`."""
    warnings.warn(f"{where}(entrypoint=...) is deprecated and will be removed in the next release: use "
                  "callable='package.module:function' (or command=[...] for a program)", DeprecationWarning,
                  stacklevel=4)


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


def format_error(kind: str, message: str, tag: str = "", fields: dict[str, Any] | None = None) -> str:
    """The launcher's error line; `fields` are the failure's structured fields (`error_fields`)."""
    return error_marker(tag) + json.dumps({"type": kind, "message": message, **({"fields": fields} if fields else {})})


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


def parse_error(log: str, tag: str = "") -> dict[str, Any] | None:
    """The launcher's one-line error summary (type, message, structured fields), if its driver printed one."""
    text = _driver_line(log, error_marker(tag))
    if text is None:
        return None
    error = _loads(text, error_marker(tag))
    if not isinstance(error, dict) or not isinstance(error.get("type"), str) or "message" not in error:
        raise StepFailedError(f"the job's log has a {error_marker(tag)} line without a type and message: "
                              f"{text[:200]!r}")
    fields = error.get("fields")
    return {"type": error["type"], "message": str(error["message"]),
            "fields": {k: v for k, v in fields.items() if k in FAILURE_FIELDS} if isinstance(fields, dict) else {}}
