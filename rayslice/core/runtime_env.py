"""A step's Ray runtime environment: the user's code folder, pip packages and environment variables.

The format is Ray's own (`working_dir`, `py_modules`, `pip`, `uv`, `env_vars`, ...), checked here
when the DAG is parsed so a typo fails the import instead of a run. The launcher gives it to every
host process of the step (`rayslice.cluster.host_env`), merged with what rayslice itself needs.
Local folders are uploaded by the Airflow side (`rayslice.client.submission`) as Ray's
content-addressed `gcs://` packages, so by the time a `StepSpec` travels it holds URIs only.
Pure Python: no ray, jax or airflow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rayslice.core.exceptions import InvalidRequestError

#: The keys rayslice passes on, with what each must be (Ray's runtime_env format).
FIELDS: dict[str, str] = {
    "working_dir": "a local folder, or a URI such as 'gcs://…zip', 's3://…zip', 'https://…zip'",
    "py_modules": "a list of local folders (or .whl files) and URIs",
    "excludes": "a list of gitignore-style patterns left out of local working_dir / py_modules",
    "pip": "a list of requirements, a requirements.txt path, or {'packages': [...], 'pip_check': ...}",
    "uv": "a list of requirements, a requirements.txt path, or {'packages': [...]}",
    "conda": "an environment name, an environment.yml path, or its content as a dict",
    "env_vars": "a dict of variable names to string values",
    "image_uri": "a container image to run the host processes in (Ray's image_uri plugin)",
    "container": "Ray's older container settings, a dict with 'image' (prefer image_uri)",
    "config": "Ray's runtime env settings, e.g. {'setup_timeout_seconds': 600}",
    "py_executable": "the Python executable (or launcher command) that starts the host processes",
}


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _requirements(value: Any) -> bool:
    return isinstance(value, str) or _is_str_list(value) or (
        isinstance(value, dict) and _is_str_list(value.get("packages", [])))


_CHECKS = {
    "working_dir": lambda v: isinstance(v, str) and bool(v),
    "py_modules": _is_str_list,
    "excludes": _is_str_list,
    "pip": _requirements,
    "uv": _requirements,
    "conda": lambda v: isinstance(v, str | dict),
    "env_vars": lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()),
    "image_uri": lambda v: isinstance(v, str) and bool(v),
    "container": lambda v: isinstance(v, dict) and isinstance(v.get("image"), str),
    "config": lambda v: isinstance(v, dict),
    "py_executable": lambda v: isinstance(v, str) and bool(v),
}


def validate(value: Any, where: str = "runtime_env") -> dict[str, Any] | None:
    """The runtime env as a plain dict, or InvalidRequestError naming the key at fault and the valid ones.

    Values that are still Jinja templates (`"{{ ... }}"`) are left for after rendering.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"{where} must be a dict in Ray's runtime_env format (keys: {_keys()}), "
                                  f"got {type(value).__name__}")
    env = dict(value)
    unknown = sorted(k for k in env if k not in FIELDS)
    if unknown:
        raise InvalidRequestError(f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; valid keys: {_keys()}")
    if "conda" in env and ("pip" in env or "uv" in env):
        raise InvalidRequestError(f"{where} may have 'conda' or 'pip'/'uv', not both (Ray refuses the mix)")
    if "pip" in env and "uv" in env:
        raise InvalidRequestError(f"{where} may have 'pip' or 'uv', not both")
    if "image_uri" in env and "container" in env:
        raise InvalidRequestError(f"{where} may have 'image_uri' or 'container', not both")
    for key, item in env.items():
        if item is None or _templated(item):
            continue
        if not _CHECKS[key](item):
            raise InvalidRequestError(f"{where}[{key!r}] must be {FIELDS[key]}, got {item!r}")
    return env


def merge(base: Mapping[str, Any] | None, override: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`override` over `base` (a connection's default under a task's): keys replace, `env_vars` merge."""
    if not base and not override:
        return None
    merged = {**(base or {}), **(override or {})}
    if base and override and ("env_vars" in base or "env_vars" in override):
        merged["env_vars"] = {**(base.get("env_vars") or {}), **(override.get("env_vars") or {})}
    return merged


def local_paths(env: Mapping[str, Any]) -> list[str]:
    """The entries of working_dir / py_modules that are local paths (to upload), not URIs."""
    paths = [env["working_dir"]] if isinstance(env.get("working_dir"), str) else []
    paths += list(env.get("py_modules") or [])
    return [p for p in paths if "://" not in p]


def _templated(value: Any) -> bool:
    if isinstance(value, str):
        return "{{" in value or "{%" in value
    if isinstance(value, Mapping):
        return any(_templated(v) for v in value.values())
    if isinstance(value, list):
        return any(_templated(v) for v in value)
    return False


def _keys() -> str:
    return ", ".join(FIELDS)
