"""A command step's program, unmodified: it joins a simulated slice's JAX group and reports to its host.

This folder is put first on `PYTHONPATH` of a command step's processes only (never of anything
else), so Python imports this file at start-up. It imports nothing heavy; it waits for JAX's modules:

- `jax._src.clusters` (simulated slices, `RAYSLICE_JAX_*` set): one more cluster environment, first in
  JAX's detection order, that reads the group the launcher planned, so `jax.distributed.initialize()`
  with no arguments joins it. Real TPU slices do not need it (JAX's Cloud TPU / GKE detection finds
  their peers).
- `jax._src.distributed` (`RAYSLICE_PROGRAM_REPORT` set): once the process joined its group,
  `rayslice_program` reports its exit status and idleness to the host actor.

Another `sitecustomize` on the path (a distribution's, a venv's) still runs afterwards.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_CLUSTERS = "jax._src.clusters"
_DISTRIBUTED = "jax._src.distributed"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _add_cluster_env(clusters: object) -> None:
    base = getattr(clusters, "ClusterEnv", None)
    if base is None:  # a JAX whose plugin interface moved: JAX_COORDINATOR_ADDRESS alone is still set
        return

    class RaysliceSimulatedSlice(base):  # type: ignore[misc, valid-type]
        name = "rayslice"

        @classmethod
        def is_env_present(cls) -> bool:
            return "RAYSLICE_JAX_NUM_PROCESSES" in os.environ

        @classmethod
        def get_coordinator_address(cls, timeout_secs: int | None = None,
                                    override_coordinator_port: str | None = None) -> str:
            return os.environ["RAYSLICE_JAX_COORDINATOR"]

        @classmethod
        def get_process_count(cls) -> int:
            return int(os.environ["RAYSLICE_JAX_NUM_PROCESSES"])

        @classmethod
        def get_process_id(cls) -> int:
            return int(os.environ["RAYSLICE_JAX_PROCESS_ID"])

    types = getattr(base, "_cluster_types", None)
    if isinstance(types, list) and RaysliceSimulatedSlice in types:
        types.remove(RaysliceSimulatedSlice)
        types.insert(0, RaysliceSimulatedSlice)  # before GKE's, whose variables the local nodes also carry


def _report_once_joined(distributed: object) -> None:
    """Wrap `State.initialize` (what `jax.distributed.initialize()` calls): report once it returned."""
    state = getattr(distributed, "State", None)
    initialize = getattr(state, "initialize", None)
    if initialize is None:
        return

    def initialize_and_report(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        result = initialize(self, *args, **kwargs)
        import rayslice_program  # this folder's, on the path with this file

        rayslice_program.joined_group()
        return result

    state.initialize = initialize_and_report


class _After(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of module `name` to run `then(module)` after it."""

    def __init__(self, name: str, then) -> None:  # noqa: ANN001
        self._name = name
        self._then = then

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name != self._name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: object) -> None:
            load(module)
            self._then(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _chain_next_sitecustomize() -> None:
    """Run the `sitecustomize` this one shadows, if the environment has one."""
    rest = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def _after_import(name: str, then) -> None:  # noqa: ANN001
    if name in sys.modules:
        then(sys.modules[name])
    else:
        sys.meta_path.insert(0, _After(name, then))


if "RAYSLICE_JAX_NUM_PROCESSES" in os.environ:
    _after_import(_CLUSTERS, _add_cluster_env)
if os.environ.get("RAYSLICE_PROGRAM_REPORT"):
    _after_import(_DISTRIBUTED, _report_once_joined)
_chain_next_sitecustomize()
