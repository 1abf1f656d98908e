"""Makes `jax.distributed.initialize()` with no arguments join a simulated slice's JAX group.

This folder is put first on `PYTHONPATH` of a command step's processes only (never of anything
else), so Python imports this file at start-up. It imports nothing heavy: it waits for JAX to
load its cluster environments and then adds one more, first in JAX's detection order, that
reads the group the launcher planned from `RAYSLICE_JAX_*` variables. Real TPU slices do not use
it (JAX's own Cloud TPU / GKE detection finds their peers). Another `sitecustomize` on the path
(a distribution's, a venv's) still runs afterwards.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_CLUSTERS = "jax._src.clusters"
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


class _AfterClusters(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of `jax._src.clusters` to run `_add_cluster_env` after it."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name != _CLUSTERS:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: object) -> None:
            load(module)
            _add_cluster_env(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _chain_next_sitecustomize() -> None:
    """Run the `sitecustomize` this one shadows, if the environment has one."""
    rest = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if "RAYSLICE_JAX_NUM_PROCESSES" in os.environ:
    if _CLUSTERS in sys.modules:
        _add_cluster_env(sys.modules[_CLUSTERS])
    else:
        sys.meta_path.insert(0, _AfterClusters())
_chain_next_sitecustomize()
