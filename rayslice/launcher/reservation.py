"""Reserve whole TPU slices all-or-nothing, and give them back the moment the step ends.

Built on `ray.util.tpu.SlicePlacementGroup` (a head placement group on worker 0 to claim a
slice, then one bundle per host pinned to that slice), with two fixes around it:

- Single-host slices get a pod-type label selector; Ray's helper leaves them unpinned, so
  a `v6e-4` request could land on one host of a `v6e-16`.
- The head placement groups are held until release instead of dropped once the hosts
  are ready. Ray's own advice to drop them lets a second request claim a busy slice's
  head and then wait forever for its hosts while another slice sits idle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table
from ray.util.tpu import SlicePlacementGroup

from rayslice.accelerators import TpuSliceRequest
from rayslice.exceptions import CapacityTimeoutError, RaysliceError, UnsatisfiableRequestError
from rayslice.launcher.environments import HostPlan

POD_TYPE_LABEL = "ray.io/tpu-pod-type"
SLICE_NAME_LABEL = "ray.io/tpu-slice-name"
WORKER_ID_LABEL = "ray.io/tpu-worker-id"


@dataclass
class SliceReservation:
    """Placement groups held for one step, and the hosts they landed on."""

    request: TpuSliceRequest
    handle: SlicePlacementGroup
    hosts: list[HostPlan] = field(default_factory=list)
    bundles: dict[tuple[int, int], int] = field(default_factory=dict)  # (slice, worker) -> bundle

    @property
    def placement_group(self) -> PlacementGroup:
        return self.handle.placement_group

    def release(self, timeout: float = 10.0) -> None:
        """Remove every placement group of this reservation and wait until Ray has freed them."""
        groups = [
            *self.handle.head_placement_groups,
            *([self.placement_group] if self.handle.placement_group else []),
        ]
        self.handle.shutdown()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(placement_group_table(pg).get("state") in ("REMOVED", None) for pg in groups):
                return
            time.sleep(0.05)
        raise RaysliceError(f"placement groups of {self.request} were not removed within {timeout:.0f} s")


def reserve_slices(request: TpuSliceRequest, *, timeout: float, name: str) -> SliceReservation:
    """Reserve `request.num_slices` whole slices within `timeout` seconds, or hold nothing."""
    check_satisfiable(request)
    deadline = time.monotonic() + timeout
    try:
        handle = SlicePlacementGroup(
            topology=request.topology,
            accelerator_version=request.version,
            num_slices=request.num_slices,
            chips_per_vm=request.chips_per_host,
            resources_per_bundle={"TPU": request.chips_per_host, "CPU": 1},
            bundle_label_selector=[{POD_TYPE_LABEL: request.pod_type}] * request.total_hosts,
            head_reservation_timeout_s=timeout,
            name=name,
        )
    except TimeoutError as exc:  # no free slice head in time; Ray removed the pending head group
        raise _capacity_timeout(request, timeout) from exc
    reservation = SliceReservation(request=request, handle=handle)
    try:
        ready, _ = ray.wait([handle.placement_group.ready()], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise _capacity_timeout(request, timeout)
        _map_hosts(reservation)
    except BaseException:
        reservation.release()
        raise
    return reservation


def check_satisfiable(request: TpuSliceRequest) -> None:
    """Fail at once, instead of after capacity_timeout, when no slice could ever appear.

    Enough slices of the pod type exist (busy or not), or an autoscaler node group declares
    the slice head resource: then waiting makes sense. Otherwise it never will.
    """
    slices = {
        node["Labels"].get(SLICE_NAME_LABEL)
        for node in ray.nodes()
        if node["Alive"] and node.get("Labels", {}).get(POD_TYPE_LABEL) == request.pod_type
    }
    if len(slices) >= request.num_slices:
        return
    config = ray._private.state.state.get_cluster_config()
    groups = list(config.node_group_configs) if config else []
    if any(request.head_resource in group.resources and group.max_count != 0 for group in groups):
        return
    if config is None and _autoscaler_running():
        return  # its node groups are unknown (Ray 2.60's autoscaler does not report them): it may add the slice
    have = sorted(
        {node["Labels"].get(POD_TYPE_LABEL) for node in ray.nodes() if node.get("Labels", {}).get(POD_TYPE_LABEL)}
    )
    raise UnsatisfiableRequestError(
        f"{request} can never be scheduled on this cluster: it has {len(slices)} {request.pod_type} slice(s) and no "
        f"autoscaler node group with {request.head_resource}. Slice types here: {', '.join(have) or 'none'}."
    )


def _autoscaler_running() -> bool:
    """Whether an autoscaler v2 has reported its state to the GCS (KubeRay's, or `ray start` with v2 on).

    Not v1: every head without an autoscaling config runs a read-only v1 monitor that reports
    the same way, so v1's report cannot tell "may add a slice" from "never will".
    """
    from ray.core.generated.autoscaler_pb2 import GetClusterStatusReply

    reply = GetClusterStatusReply.FromString(ray._private.worker.global_worker.gcs_client.get_cluster_status())
    return reply.autoscaling_state.autoscaler_state_version > 0


def _capacity_timeout(request: TpuSliceRequest, timeout: float) -> CapacityTimeoutError:
    free = ray.available_resources().get("TPU", 0)
    return CapacityTimeoutError(
        f"no capacity for {request} within capacity_timeout={timeout:.0f} s "
        f"({request.total_hosts} hosts x {request.chips_per_host} chips needed, {free:.0f} TPU chips free "
        "in the cluster); nothing was left reserved. Raise capacity_timeout or add slices."
    )


def _map_hosts(reservation: SliceReservation) -> None:
    """Learn which slice and worker id each bundle landed on, from Ray's node labels."""
    request = reservation.request
    bundles = placement_group_table(reservation.placement_group)["bundles_to_node_id"]
    nodes = {node["NodeID"]: node for node in ray.nodes() if node["Alive"]}
    slice_names = [selector.get(SLICE_NAME_LABEL) for selector in reservation.handle.bundle_label_selector]
    per_slice = request.hosts_per_slice
    located = []
    for bundle_index, node_id in sorted(bundles.items()):
        labels = nodes[node_id].get("Labels", {})
        slice_index = bundle_index // per_slice
        located.append(
            (
                slice_index,
                labels.get(SLICE_NAME_LABEL) or slice_names[bundle_index] or f"slice{slice_index}",
                int(labels.get(WORKER_ID_LABEL, 0)),
                nodes[node_id]["NodeManagerAddress"],
                bundle_index,
                node_id,
            )
        )
    located.sort()
    reservation.bundles = {(s, w): b for s, _, w, _, b, _ in located}
    reservation.hosts = [
        HostPlan(
            slice_index=s,
            slice_name=name,
            worker_id=w,
            ip=ip,
            process_id=0,
            num_processes=1,
            coordinator="",
            megascale_coordinator="",
            node_id=node_id,
        )
        for s, name, w, ip, _, node_id in located
    ]
