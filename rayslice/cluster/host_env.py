"""What reaches each host process of a step: the user's runtime env, merged with what rayslice needs.

Two levels, as Ray has them. The job's own runtime env (the spec, the shipped launcher) is the
driver's alone: a job driver takes it off what its workers inherit (`leave_job_env`), so a host
process on a node whose Python has this very launcher installed (the node's `rayslice.io/launcher`
label, `rayslice.core.launcher`) starts without Ray's `setup_worker` step, and one elsewhere gets
the shipped launcher's `py_modules` on its actor. The label vouches only for the node's own Python, and
only for what was installed when it was set: a step with a runtime env of its own keeps the launcher,
and a host started without it checks the label's claim before it loads the step (`check_installed`).

The user's `runtime_env` goes on every host actor, with the launcher's `py_modules` kept in front
of the user's (Ray replaces a key it finds in both, and merges the actor's env over the job's key
by key). Inside the host, the variables an
environment needs (`environments.Environment.env`) are set over the user's `env_vars`: `XLA_FLAGS`
is joined (the user's flags first, so rayslice's device count wins), every other variable rayslice
sets replaces the user's, and the host that is process 0 says so in the task log.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from rayslice.core import launcher
from rayslice.core.step import StepSpec

#: Variables that hold flag lists: joined, not replaced.
JOINED = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")


#: The shipped launcher's `py_modules` once `leave_job_env` took the job's env off this driver's
#: workers ([] for an installed launcher); None while nothing was taken off (a direct caller's driver).
_shipped: list[str] | None = None


def leave_job_env() -> None:
    """Take the job's runtime env off what this job driver's workers inherit, keeping the launcher's URIs.

    The hosts need none of it (`spec.json` and `RAY_DEDUP_LOGS` are this driver's), and Ray starts
    a worker that has no runtime env without its `setup_worker` step: a second Python start and
    `ray` import per host process. Before `ray.init`, which reads the job's config from here.
    """
    global _shipped
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    injected = os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR)
    if injected:
        config = json.loads(injected)
        _shipped = list((config.pop("runtime_env", None) or {}).get("py_modules") or [])
        os.environ[RAY_JOB_CONFIG_JSON_ENV_VAR] = json.dumps(config)


@cache
def running_digest() -> str:
    """The digest of the launcher this driver runs (the shipped copy, or the installed one)."""
    import cloudpickle

    import rayslice

    return launcher.digest(Path(rayslice.__file__).parent, Path(cloudpickle.__file__).parent)


def launcher_modules(node_ids: Iterable[str], spec: StepSpec | None = None) -> list[str]:
    """The launcher `py_modules` a process on these nodes needs: none where each has this very copy installed.

    The label vouches for the node's own Python only: a step with a runtime env of its own (another
    Python, an image, its own `py_modules` or `PYTHONPATH`) keeps the launcher in front, as it must, and
    loses nothing by it (Ray's `setup_worker` step runs for any runtime env).
    """
    import ray

    if _shipped is None:  # the caller's own driver: its workers inherit its env, as they always did
        return list((ray.get_runtime_context().runtime_env or {}).get("py_modules") or [])
    if not _shipped:
        return []
    if spec is not None and _user_env(spec):
        return list(_shipped)
    wanted = set(node_ids)
    labels = [n.get("Labels") or {} for n in ray.nodes() if n["NodeID"] in wanted and n["Alive"]]
    if wanted and len(labels) == len(wanted) and all(lb.get(launcher.LABEL) == running_digest() for lb in labels):
        return []
    return list(_shipped)


def installed_digest(launcher_py_modules: list[str]) -> str | None:
    """The launcher digest hosts started without `launcher_py_modules` must find installed (None: not left out).

    A label is a claim made once, at the node's start; the files can change under it (an editable
    install edited, a label copied from another image). The host checks the claim (`check_installed`).
    """
    return running_digest() if _shipped and not launcher_py_modules else None


class LauncherMismatchError(RuntimeError):
    """A node's installed launcher is not the copy its `rayslice.io/launcher` label names."""


def check_installed(expected: str | None) -> None:
    """In a host process: fail, in words that say what to fix, if this node's launcher is not `expected`."""
    if expected is None or running_digest() == expected:
        return
    import socket

    raise LauncherMismatchError(
        f"node {socket.gethostname()}'s installed rayslice/cloudpickle (launcher digest {running_digest()}, in "
        f"{sys.executable}) is not the launcher "
        f"this step was sent with ({expected}), though the node's {launcher.LABEL} label says it is: the files "
        "changed after the label was set (an editable install edited, or a label copied from another image), or "
        "the label came from another Python than the one the node's workers run. "
        "Set the label from the node's own install when it starts (`rayslice launcher-label`; `rayslice local "
        "down` and `up` for a local cluster), or start the node without it: its steps then get the shipped copy"
    )


def _user_env(spec: StepSpec) -> dict[str, Any]:
    return {k: v for k, v in (spec.runtime_env or {}).items() if k != "excludes"}


def service_runtime_env(node_id: str | None) -> dict[str, Any] | None:
    """The runtime env of a cluster service a job driver starts (the broker, the recorder) on this node."""
    if not _shipped:  # it inherits the caller's env, or an installed launcher needs none
        return None
    modules = launcher_modules([node_id] if node_id else [])
    return {"py_modules": modules} if modules else None


def actor_runtime_env(spec: StepSpec, launcher_py_modules: list[str]) -> dict[str, Any] | None:
    """The runtime env of the step's host actors: the user's, with the launcher's `py_modules` in front."""
    env = _user_env(spec)
    if launcher_py_modules:  # a shipped launcher: the host processes import rayslice from it
        env["py_modules"] = launcher_py_modules + [m for m in env.get("py_modules") or []
                                                   if m not in launcher_py_modules]
    return env or None


def merged(current: Mapping[str, str], ours: Mapping[str, str],
           user: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The variables to set over `current` (`ours` win), and a note for each user variable they change."""
    result, notes = {}, []
    for key, value in ours.items():
        theirs = current.get(key)
        if key in JOINED and theirs and value not in theirs:
            result[key] = f"{theirs} {value}"
            if key in user:
                notes.append(f"{key}: rayslice appends {value!r} to the runtime_env's value")
            continue
        result[key] = value
        if key in user and user[key] not in value:
            notes.append(f"{key}: rayslice sets {value!r} over the runtime_env's {user[key]!r} (it must, here)")
    return result, notes
