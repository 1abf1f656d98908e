"""A step's local code, uploaded once per content: the runtime env's `working_dir` and `py_modules` folders.

Each folder is zipped deterministically (`jobs_client.zip_directory`, the runtime env's `excludes`
left out) and stored as Ray's content-addressed `gcs://_ray_pkg_<sha1>.zip` package, uploaded only
when the cluster does not hold those bytes yet: 32 mapped tasks that ship the same folder upload it
once (concurrent submissions from one process share one upload). A `pip`/`uv` requirements file is
read here, where it exists. What returns holds URIs only, as the cluster needs.
"""

from __future__ import annotations

import asyncio
import fnmatch
from pathlib import Path
from typing import Any

from rayslice.client.jobs_client import AsyncRayJobsClient, package_name_for, zip_directory
from rayslice.core import runtime_env as runtime_envs
from rayslice.core.exceptions import InvalidRequestError

_locks: dict[tuple[int, str, str], asyncio.Lock] = {}


async def upload_runtime_env(client: AsyncRayJobsClient, env: dict[str, Any] | None) -> dict[str, Any] | None:
    """`env` with its local folders replaced by package URIs (uploaded if new) and requirement files read."""
    env = runtime_envs.validate(env)
    if not env:
        return env
    env = dict(env)
    excludes = list(env.pop("excludes", None) or [])
    if isinstance(env.get("working_dir"), str) and "://" not in env["working_dir"]:
        env["working_dir"] = await _upload(client, env["working_dir"], excludes, "working_dir", parent=False)
    if env.get("py_modules"):
        env["py_modules"] = [m if "://" in m else await _upload(client, m, excludes, "py_modules", parent=True)
                             for m in env["py_modules"]]
    for key in ("pip", "uv"):
        if isinstance(env.get(key), str):
            env[key] = _requirements(env[key], key)
    return env


def package_of(path: str, excludes: list[str], *, parent: bool, what: str = "working_dir") -> bytes:
    """The zip of a local folder (or the bytes of a `.zip` / `.whl` file) as Ray takes it."""
    local = Path(path).expanduser()
    if local.is_file() and local.suffix in (".zip", ".whl"):
        return local.read_bytes()
    if not local.is_dir():
        raise InvalidRequestError(f"runtime_env {what} {path!r} is neither a folder nor a .zip/.whl file here "
                                  f"({Path.cwd()}); give a path the Airflow worker can read, or a URI "
                                  "(gcs://, s3://, https://)")

    def keep(rel: str) -> bool:
        name = rel.rsplit("/", 1)[-1]
        if name == "__pycache__" or name.endswith((".pyc", ".pyo")):
            return False
        return not any(fnmatch.fnmatch(rel, p.strip("/")) or fnmatch.fnmatch(name, p.strip("/")) for p in excludes)

    return zip_directory(local, include=keep, include_parent_dir=parent)


async def _upload(client: AsyncRayJobsClient, path: str, excludes: list[str], what: str, *, parent: bool) -> str:
    # Zipping a folder takes seconds of CPU and disk: off the event loop (a triggerer runs every trigger on it).
    data = await asyncio.to_thread(package_of, path, excludes, parent=parent, what=what)
    key = (id(asyncio.get_running_loop()), str(client.address), package_name_for(data))
    lock = _locks.setdefault(key, asyncio.Lock())
    async with lock:  # the second of two concurrent submissions finds the first's package
        return await client.ensure_package(data)


def _requirements(path: str, key: str) -> list[str]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise InvalidRequestError(f"runtime_env {key} {path!r} is not a requirements file here ({Path.cwd()}); "
                                  "give the requirements as a list instead")
    return [line.strip() for line in file.read_text().splitlines() if line.strip() and not line.startswith("#")]
