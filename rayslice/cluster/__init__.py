"""The cluster-side launcher: reserve, fan out, wire JAX, fail fast, release.

Runs inside a Ray driver (the Ray job that the Airflow side submits). Imports `ray`;
JAX is imported only inside the host processes.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray

from rayslice.cluster import checkpoints, gang, reaper
from rayslice.cluster.environments import HostPlan
from rayslice.cluster.reservation import check_accelerator_satisfiable, reserve_slices
from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.context import CHECKPOINT_ROOT_ENV, checkpoint_dir_for
from rayslice.core.exceptions import CapacityTimeoutError, PreemptedError
from rayslice.core.step import StepSpec

__all__ = ["run_step", "reservation_name"]


def log(message: str) -> None:
    print(f"[rayslice] {message}", flush=True)


def reservation_name(spec: StepSpec) -> str:
    """Names every placement group and actor so it traces back to its Airflow task."""
    return f"rayslice:{spec.owner.submission_id or 'adhoc'}"


def run_step(spec: StepSpec) -> Any:
    """Run the step on every host of its capacity; per-host results, or the fraction's one result."""
    _reap_orphans(spec)
    checkpoint_dir = checkpoint_dir_for(spec.checkpoint_root or os.environ.get(CHECKPOINT_ROOT_ENV), spec.owner)
    for attempt in range(spec.preemption_retries + 1):
        if checkpoint_dir:
            log(checkpoints.describe_and_record(checkpoint_dir, try_number=spec.owner.try_number,
                                                preemption_attempt=attempt, submission_id=spec.owner.submission_id))
        step = gang.Attempt(preemption_attempt=attempt, checkpoint_dir=checkpoint_dir)
        try:
            if isinstance(spec.request, TpuSliceRequest):
                return _run_on_slices(spec, spec.request, step)
            return _run_on_fraction(spec, spec.request, step)
        except PreemptedError as exc:
            if attempt == spec.preemption_retries:
                raise
            log(f"preempted: {exc}; retrying the whole gang ({attempt + 1} of {spec.preemption_retries})")
    raise AssertionError("unreachable")


def _reap_orphans(spec: StepSpec) -> None:
    """Before reserving, free what ended jobs left behind (cheap; it must never fail the step)."""
    try:
        for orphan in reaper.reap(exclude=spec.owner.submission_id or None):
            log(f"reaped {orphan.kind} {orphan.name}: its Ray job {orphan.submission_id} is {orphan.job_status}")
    except Exception as exc:
        log(f"could not sweep orphaned reservations: {type(exc).__name__}: {exc}")


def _run_on_slices(spec: StepSpec, request: TpuSliceRequest, attempt: gang.Attempt) -> list[Any]:
    name = reservation_name(spec)
    log(f"waiting for capacity: {request} (capacity_timeout={spec.capacity_timeout:.0f} s)")
    started = time.monotonic()
    reservation = reserve_slices(request, timeout=spec.capacity_timeout, name=name)
    actors: list[Any] = []
    try:
        slices = sorted({h.slice_name for h in reservation.hosts})
        log(f"reserved {', '.join(slices)} in {time.monotonic() - started:.1f} s")
        strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy
        for host in reservation.hosts:
            actors.append(
                gang.HostProcess.options(
                    name=f"{name}/{host.label}",
                    num_cpus=1,
                    resources={"TPU": request.chips_per_host},
                    scheduling_strategy=strategy(
                        reservation.hosts_group,
                        placement_group_bundle_index=reservation.bundles[(host.slice_index, host.worker_id)],
                    ),
                ).remote(host.label)
            )
        ports = gang.await_started(actors, reservation.hosts)
        leaders = gang.group_leaders(reservation.hosts, multislice=request.multislice)
        plans = gang.plan_processes(reservation.hosts, multislice=request.multislice,
                                    ports={i: ports[i] for i in leaders})
        log(f"running on {', '.join(slices)}: {len(plans)} hosts x {request.chips_per_host} chips")
        return gang.run_gang(actors, plans, spec, attempt)
    finally:
        gang.kill(actors)
        _log_release(str(request), started, reservation.release())


def _log_release(what: str, started: float, still_held: list[str]) -> None:
    if still_held:
        log(f"released {what} after {time.monotonic() - started:.1f} s, but Ray has not freed "
            f"{', '.join(still_held)} yet (a busy GCS): their removal is requested, and the sweep of ended "
            "jobs removes them if Ray never does")
    else:
        log(f"released {what} after {time.monotonic() - started:.1f} s")


def _run_on_fraction(spec: StepSpec, request: AcceleratorRequest, attempt: gang.Attempt) -> Any:
    check_accelerator_satisfiable(request)
    log(f"waiting for capacity: {request} (capacity_timeout={spec.capacity_timeout:.0f} s)")
    started = time.monotonic()
    actor = gang.HostProcess.options(
        name=f"{reservation_name(spec)}/{request.resource}", num_cpus=0, **request.ray_options()
    ).remote(str(request))
    try:
        ready, _ = ray.wait([actor.free_port.remote()], timeout=spec.capacity_timeout)
        if not ready:
            raise CapacityTimeoutError(
                f"no capacity for {request} within capacity_timeout={spec.capacity_timeout:.0f} s; "
                "nothing was left reserved. Raise capacity_timeout or add nodes with that accelerator."
            )
        plan = HostPlan(
            slice_index=0,
            slice_name=str(request),
            worker_id=0,
            ip="",
            process_id=0,
            num_processes=1,
            coordinator="",
            megascale_coordinator="",
        )
        log(f"running on {request}")
        return gang.run_gang([actor], [plan], spec, attempt)[0]
    finally:
        gang.kill([actor])
        log(f"released {request} after {time.monotonic() - started:.1f} s")
