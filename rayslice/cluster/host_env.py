"""What reaches each host process of a step: the user's runtime env, merged with what rayslice needs.

Two levels, as Ray has them. The job's own runtime env (the spec, the shipped launcher) is the
driver's; the user's `runtime_env` goes on every host actor, with the launcher's `py_modules` kept
in front of the user's (Ray replaces a key it finds in both). Inside the host, the variables an
environment needs (`environments.Environment.env`) are set over the user's `env_vars`: `XLA_FLAGS`
is joined (the user's flags first, so rayslice's device count wins), every other variable rayslice
sets replaces the user's, and the host that is process 0 says so in the task log.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rayslice.core.step import StepSpec

#: Variables that hold flag lists: joined, not replaced.
JOINED = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")


def actor_runtime_env(spec: StepSpec, job_env: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The runtime env of the step's host actors: None (the job's) unless the user gave one."""
    if not spec.runtime_env:
        return None
    env = {k: v for k, v in spec.runtime_env.items() if k != "excludes"}
    launcher = list((job_env or {}).get("py_modules") or [])
    if launcher:  # a shipped launcher: the host processes import rayslice from it
        env["py_modules"] = launcher + [m for m in env.get("py_modules") or [] if m not in launcher]
    return env


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
