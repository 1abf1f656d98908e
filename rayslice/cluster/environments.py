"""Where a host process runs, and how it wires JAX there. The step code never branches on it.

Like JAX's own cluster environments, each class answers one question set: am I here, what
must be set before anything imports JAX (`env`), and how the process joins its JAX group
(`wire`, once the coordinator is known). They are tried in the order of
`ENVIRONMENTS`; detection has no side effects (it looks at device files and the
request, never at a metadata server).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any

from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest

DEFAULT_MEGASCALE_PORT = 8081
#: How long a simulated slice's JAX group waits at `jax.distributed.shutdown` for every process (JAX: 300 s).
JAX_SHUTDOWN_TIMEOUT_ENV = "RAYSLICE_JAX_SHUTDOWN_TIMEOUT_S"


@dataclass(frozen=True)
class HostPlan:
    """One host process of a gang: where it sits and how it reaches its peers."""

    slice_index: int
    slice_name: str
    worker_id: int
    ip: str
    process_id: int  # JAX process id within its distributed group
    num_processes: int  # size of that group (whole multislice job, or one slice)
    coordinator: str  # "ip:port" of process 0 of the group
    megascale_coordinator: str  # ip of slice 0, worker 0 (multislice only)
    node_id: str = ""  # the Ray node the host's bundle sits on: tells a lost node from a dead process

    @property
    def label(self) -> str:
        return f"{self.slice_name}/host{self.worker_id}"


class Environment:
    """One place a host process can run: `detect`, `env` and `wire` are each environment's own."""

    name = ""
    #: The requests this environment serves.
    request_type: type = object

    @classmethod
    def detect(cls, request: object) -> bool:
        """Whether this process runs here; no side effects (device files and the request, no metadata server)."""
        return isinstance(request, cls.request_type)

    @staticmethod
    def env(request: Any, plan: HostPlan) -> dict[str, str]:
        raise NotImplementedError

    @staticmethod
    def wire(request: Any, plan: HostPlan) -> None:
        raise NotImplementedError

    @classmethod
    def command_env(cls, request: Any, plan: HostPlan) -> dict[str, str]:
        """What a command step's process needs so that `jax.distributed.initialize()` finds its group by itself."""
        return cls.env(request, plan)

    @classmethod
    def setup(cls, request: Any, plan: HostPlan) -> dict[str, str]:
        """Both steps at once: set the environment, then wire JAX (the host process splits them to overlap)."""
        env = cls.env(request, plan)
        os.environ.update(env)
        cls.wire(request, plan)
        return env


class RealTpuSlice(Environment):
    """Real TPU VMs: libtpu and JAX find their peers themselves; multislice needs fresh MEGASCALE_*."""

    name = "tpu"
    request_type = TpuSliceRequest

    @classmethod
    def detect(cls, request: object) -> bool:
        return super().detect(request) and bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))

    @staticmethod
    def env(request: TpuSliceRequest, plan: HostPlan) -> dict[str, str]:
        if not request.multislice:
            return {}
        # Computed per attempt: stale values after a slice is replaced hang initialization.
        return {
            "MEGASCALE_COORDINATOR_ADDRESS": plan.megascale_coordinator,
            "MEGASCALE_PORT": str(DEFAULT_MEGASCALE_PORT),
            "MEGASCALE_NUM_SLICES": str(request.num_slices),
            "MEGASCALE_SLICE_ID": str(plan.slice_index),
        }

    @staticmethod
    def wire(request: TpuSliceRequest, plan: HostPlan) -> None:
        if request.is_multi_host or request.multislice:
            import jax

            jax.distributed.initialize()


class SimulatedTpuSlice(Environment):
    """A local simulated slice: CPU devices = JAX's devices per host (chips, x2 on v7x), gloo across processes."""

    name = "simulated-tpu"
    request_type = TpuSliceRequest

    @staticmethod
    def env(request: TpuSliceRequest, plan: HostPlan) -> dict[str, str]:
        return {
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={request.devices_per_host}",
        }

    @classmethod
    def command_env(cls, request: TpuSliceRequest, plan: HostPlan) -> dict[str, str]:
        """JAX's detection finds a small plugin (`jax_autodetect/sitecustomize.py`, on every command step's
        PYTHONPATH: `commands.program_env`) that reads the plan."""
        return {
            **cls.env(request, plan),
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
            "RAYSLICE_JAX_COORDINATOR": plan.coordinator,
            "RAYSLICE_JAX_NUM_PROCESSES": str(plan.num_processes),
            "RAYSLICE_JAX_PROCESS_ID": str(plan.process_id),
        }

    @staticmethod
    def wire(request: TpuSliceRequest, plan: HostPlan) -> None:
        if plan.num_processes > 1:  # one process needs no wiring
            import jax

            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(
                coordinator_address=plan.coordinator,
                num_processes=plan.num_processes,
                process_id=plan.process_id,
                local_device_ids=list(range(request.devices_per_host)),
                cluster_detection_method="deactivate",
                initialization_timeout=120,
                shutdown_timeout_seconds=int(os.environ.get(JAX_SHUTDOWN_TIMEOUT_ENV, "300")),
            )


class AcceleratorFraction(Environment):
    """One process holding a (fraction of an) accelerator; JAX may use only its share of memory."""

    name = "accelerator"
    request_type = AcceleratorRequest

    @staticmethod
    def env(request: AcceleratorRequest, plan: HostPlan) -> dict[str, str]:
        if request.resource == "GPU" and request.count < 1:
            # Ray isolates no memory: without this, the first JAX process takes 75% of the GPU.
            return {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{request.count * 0.95:.3f}"}
        return {}

    @staticmethod
    def wire(request: AcceleratorRequest, plan: HostPlan) -> None:
        return None


def preimports_jax(request: object) -> bool:
    """Whether a host process imports JAX as soon as it starts: TPU slice steps are JAX programs.

    Importing JAX initializes no backend and opens no device, so nothing is held by it; it
    overlaps the slowest part of a host's start-up with the driver's round trips. A fraction's
    step may not use JAX at all, so it imports nothing it did not ask for.
    """
    return isinstance(request, TpuSliceRequest)


ENVIRONMENTS = (RealTpuSlice, SimulatedTpuSlice, AcceleratorFraction)


def detect(request: object) -> type[Environment]:
    for environment in ENVIRONMENTS:
        if environment.detect(request):
            return environment
    raise TypeError(f"no launcher environment handles {request!r}")
