"""Reserve whole TPU slices all-or-nothing, and give them back the moment the step ends.

Two placement groups, each placed by Ray atomically (all bundles or none):

1. **heads**: one bundle per slice asking for `TPU-<pod type>-head` (worker 0 of a slice),
   spread over distinct nodes. It claims every slice of the request in one step: a request
   holds all of its slice heads or none, so two multi-slice requests can never each hold
   part of what the other needs.
2. **hosts**: one bundle per host (`{"TPU": chips, "CPU": 1}`), each pinned by label to the
   slice name its head landed on and to its worker id.

One deadline (`capacity_timeout`) bounds both waits together, whatever the number of
slices. Ray's `SlicePlacementGroup` is not used: it claims the heads one after another,
each with the full timeout, and keeps the heads it has while it waits for the rest.

What we keep from the fixes around it: heads are held until release (dropping them lets a
second request claim a busy slice's head), single-host slices are pinned to their pod type
(a `v6e-4` never takes one host of a `v6e-16`), and slices that lost a host are skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from rayslice.cluster import autoscaler
from rayslice.cluster import queue as admission
from rayslice.cluster.environments import HostPlan
from rayslice.core.accelerators import VISIBLE_DEVICES_ENV, AcceleratorRequest, TpuSliceRequest
from rayslice.core.exceptions import CapacityTimeoutError, SuspendedError, UnsatisfiableRequestError
from rayslice.core.queue import entry_for

POD_TYPE_LABEL = "ray.io/tpu-pod-type"
SLICE_NAME_LABEL = "ray.io/tpu-slice-name"
WORKER_ID_LABEL = "ray.io/tpu-worker-id"
#: How long release waits for Ray to confirm the groups are gone before it leaves them to Ray.
RELEASE_TIMEOUT_S = 10.0
#: How often a waiting heads group looks again at which slices are trapped by a busy worker.
RECHECK_S = 0.5
#: Longest single blocking wait, so a SIGTERM (`ray job stop`) is handled within this time.
_WAIT_SLICE_S = 0.5


@dataclass
class SliceReservation:
    """The placement groups held for one step, and the hosts they landed on."""

    request: TpuSliceRequest
    heads: PlacementGroup
    hosts_group: PlacementGroup | None = None
    hosts: list[HostPlan] = field(default_factory=list)
    bundles: dict[tuple[int, int], int] = field(default_factory=dict)  # (slice, worker) -> bundle index
    place: admission.Place | None = None  # in the admission queue: left once the groups are gone

    @property
    def groups(self) -> list[PlacementGroup]:
        return [self.heads, *([self.hosts_group] if self.hosts_group is not None else [])]

    def release(self, timeout: float | None = None, requeue: bool = False) -> list[str]:
        """Remove every group and wait (bounded) until Ray frees them; never raises.

        Returns the names of the groups Ray had not freed within `timeout`: their removal was
        requested, so Ray frees them when it catches up, and the launcher's sweep of ended jobs
        removes them if it never does. A slow GCS must not replace the step's outcome.
        `requeue`: the step resumes in another attempt, so its place goes back to waiting in its line
        (`Place.requeue`, one broker call) instead of leaving the queue: nobody it outranks gets in between.
        """
        timeout = RELEASE_TIMEOUT_S if timeout is None else timeout
        pending = []
        for group in self.groups:
            try:
                remove_placement_group(group)
                pending.append(group)
            except Exception:  # already removed
                pass
        deadline = time.monotonic() + timeout
        while pending:
            pending = [group for group in pending if not _removed(group)]
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if self.place is not None and requeue:
            self.place.requeue()  # those ranked ahead of it may reserve now; it keeps its place before the rest
        elif self.place is not None:
            self.place.leave()  # the next in line may reserve now
        return [_name(group) for group in pending]


def reserve_slices(request: TpuSliceRequest, *, timeout: float, name: str,
                   lost_nodes: frozenset[str] = frozenset(), place: admission.Place | None = None,
                   queued: bool = True) -> SliceReservation:
    """Reserve `request.num_slices` whole slices within `timeout` seconds, or hold nothing.

    First a place in the cluster's admission queue (`rayslice.cluster.queue`): `place`, the step's
    own (its priority, team, arrival), else one taken now; `timeout` covers the queue and the
    reservation together, and `release()` gives the place up. A request no slice could ever
    hold fails before it takes a place. `queued=False` skips the queue (for measuring it only: such
    a reservation is ordered by nothing, as before the queue).

    A slice whose head is free while another of its hosts is busy is passed over: a head bundle
    claims only worker 0, so such a slice (a plain Ray task asking for `TPU` on a worker) would be
    held while its hosts stay busy. `lost_nodes`: nodes a step just lost, which the GCS may still show
    alive for seconds; their slices are avoided like broken ones.

    A step the queue tells to suspend while Ray still places its slices (admitted, but its heads or hosts not
    placed yet) raises `SuspendedError` within `RECHECK_S`, holding nothing: a victim still waiting frees
    what it holds within the grace, not after its capacity_timeout. The place is then its caller's to keep
    (the step resumes in it) or leave.
    """
    deadline = time.monotonic() + timeout
    nodes = ray.nodes()  # one snapshot for the reservation (refreshed only for a node that joined since)
    broken = check_satisfiable(request, nodes, lost=lost_nodes)
    if place is None:
        place = admission.Place(entry_for(request, id=f"{name}/{time.time_ns()}", label=name))
    if not queued:
        place = admission.Place.unqueued()
    try:
        if place.wait(timeout) > 0.5:  # at once for a place already admitted; after a wait, a fresh snapshot
            nodes = ray.nodes()
            broken = check_satisfiable(request, nodes, lost=lost_nodes)
    except BaseException:
        place.leave()
        raise
    suspended = _suspended_by(place)
    try:
        heads = _hold_heads(request, nodes, broken, deadline, name, lost_nodes, suspended)
    except BaseException as exc:
        if not isinstance(exc, SuspendedError):
            place.leave()
        raise
    if heads is None:
        place.leave()
        raise _capacity_timeout(request, timeout, "no free slice heads")
    reservation = SliceReservation(request=request, heads=heads, place=place)
    try:
        slices = _slice_names(heads, nodes)
        plan = [(s, slice_name, w) for s, slice_name in enumerate(slices) for w in range(request.hosts_per_slice)]
        reservation.hosts_group = placement_group(
            [{"TPU": request.chips_per_host, "CPU": 1} for _ in plan],
            strategy="STRICT_SPREAD",
            name=f"{name}/hosts",
            bundle_label_selector=[
                {SLICE_NAME_LABEL: slice_name, WORKER_ID_LABEL: str(w), POD_TYPE_LABEL: request.pod_type}
                for _, slice_name, w in plan
            ],
        )
        if not _placed(reservation.hosts_group, deadline, suspended):
            busy = f"held the heads of {', '.join(slices)}, but their hosts stayed busy"
            raise _capacity_timeout(request, timeout, busy)
        _map_hosts(reservation, plan, nodes)
    except BaseException as exc:
        if isinstance(exc, SuspendedError):
            reservation.place = None  # its caller keeps the place (the step resumes in it) or leaves it
        reservation.release()
        raise
    return reservation


def _suspended_by(place: admission.Place) -> Callable[[], None]:
    """A check that raises `SuspendedError` once the queue told `place`'s step to suspend (`Place.suspend`), or
    `Withdrawn` once the place's step no longer needs it here (`Place.give_up`)."""
    def check() -> None:
        told = getattr(place, "suspend", None)
        if told is not None:
            error = SuspendedError(f"suspended by a preemption notice ({told[0]}); Ray was still placing its "
                                   "slices: no step body ran, and nothing is held", cause="preemption notice")
            error.node_id, error.slice_name, error.stopped_at_deadline = "", "", False
            raise error
        give_up = getattr(place, "give_up", None)
        if give_up is not None and give_up():  # a step on several clusters that another cluster claimed meanwhile
            raise admission.Withdrawn(place.entry.what)
    return check


def _placed(group: PlacementGroup, deadline: float, suspended: Callable[[], None]) -> bool:
    """`wait_ready`, looking every `RECHECK_S` whether the step was told to suspend meanwhile (`suspended`)."""
    while True:
        suspended()
        if wait_ready(group, min(deadline, time.monotonic() + RECHECK_S)):
            return True
        if time.monotonic() >= deadline:
            return False


def _hold_heads(request: TpuSliceRequest, nodes: list[dict], broken: set[str], deadline: float,
                name: str, lost: frozenset[str] = frozenset(),
                suspended: Callable[[], None] = lambda: None) -> PlacementGroup | None:
    """One head per slice, never on a slice that lost a host or whose head is free while a worker is busy.

    A trapped slice (a plain Ray task asking for `TPU` sits on a worker) would be held for hosts that
    stay busy while another slice is free. Ray places a group's bundles at random among the nodes
    that match, so the trapped slices are excluded by label, and looked at again every `RECHECK_S`:
    the group is made anew only when that set changes (a trap cleared, or a freshly released
    slice whose workers' chips Ray reports free a moment after its head). None: nothing by `deadline`.
    `suspended` raises once the queue told the step to suspend (looked at as often): the heads are removed.
    """
    heads, avoided, first = None, None, True
    try:
        while True:
            suspended()
            if not first:  # a lost host may be back (a new node), or another lost: look again
                nodes = ray.nodes()
                broken = _slices(request, nodes, lost)[0]
            first = False
            avoid = broken | trapped_slices(request, nodes, broken)
            if avoid != avoided:
                if heads is not None:
                    remove_placement_group(heads)
                selector = {POD_TYPE_LABEL: request.pod_type, WORKER_ID_LABEL: "0"}
                if avoid:
                    selector[SLICE_NAME_LABEL] = f"!in({','.join(sorted(avoid))})"
                heads = placement_group([{request.head_resource: 1}] * request.num_slices, strategy="STRICT_SPREAD",
                                        name=f"{name}/heads", bundle_label_selector=[selector] * request.num_slices)
                avoided = avoid
            if wait_ready(heads, min(deadline, time.monotonic() + RECHECK_S)):
                return heads
            if time.monotonic() >= deadline:
                remove_placement_group(heads)
                return None
    except BaseException:
        if heads is not None:
            remove_placement_group(heads)
        raise


def wait_ready(group: PlacementGroup, deadline: float) -> bool:
    """Wait for Ray to place the whole group until `deadline`, in short waits that let signals in.

    `ray.wait` on the group's ready future, not `PlacementGroup.wait`: that one takes whole seconds.
    """
    ready = group.ready()
    while True:
        remaining = deadline - time.monotonic()
        done, _ = ray.wait([ready], timeout=max(0.0, min(_WAIT_SLICE_S, remaining)))
        if done:
            return True
        if remaining <= _WAIT_SLICE_S:
            return False


def trapped_slices(request: TpuSliceRequest, nodes: list[dict], broken: set[str]) -> set[str]:
    """Intact slices of the request's pod type whose head is free while some other host's chips are taken."""
    from ray._private.state import available_resources_per_node

    available = available_resources_per_node()
    head_free, worker_busy = set(), set()
    for node in nodes:
        labels = node.get("Labels", {})
        name = labels.get(SLICE_NAME_LABEL)
        if not node["Alive"] or labels.get(POD_TYPE_LABEL) != request.pod_type or not name or name in broken:
            continue
        free = available.get(node["NodeID"], {})
        if labels.get(WORKER_ID_LABEL) == "0":
            if free.get(request.head_resource, 0) >= 1:
                head_free.add(name)
        elif free.get("TPU", 0) < request.chips_per_host:
            worker_busy.add(name)
    return head_free & worker_busy


def check_satisfiable(request: TpuSliceRequest, nodes: list[dict] | None = None,
                      lost: frozenset[str] = frozenset()) -> set[str]:
    """Fail at once, instead of after capacity_timeout, when no slice could ever appear.

    Enough intact slices of the pod type exist (busy or not), or did (a slice that lost a host: a
    preempted or restarting host comes back, so the step waits for it within capacity_timeout, and
    `preemption_retries` can work on a cluster of exactly `num_slices` slices), or an autoscaler may
    add them: then waiting makes sense. Returns the names of broken slices (alive, but missing hosts),
    which the reservation avoids. `nodes`: a `ray.nodes()` snapshot to use; `lost`: nodes to count as gone.
    """
    nodes = ray.nodes() if nodes is None else nodes
    broken, intact = _slices(request, nodes, lost)
    if intact >= request.num_slices:
        return broken
    known = {node["Labels"][SLICE_NAME_LABEL] for node in nodes
             if node.get("Labels", {}).get(POD_TYPE_LABEL) == request.pod_type
             and node.get("Labels", {}).get(SLICE_NAME_LABEL)}  # alive or not: a slice this cluster has had
    if len(known) >= request.num_slices or autoscaler.may_add(request.head_resource):
        return broken
    alive = [node for node in nodes if node["Alive"] and node["NodeID"] not in lost]
    have = sorted({node["Labels"][POD_TYPE_LABEL] for node in alive if node.get("Labels", {}).get(POD_TYPE_LABEL)})
    raise UnsatisfiableRequestError(
        f"{request} can never be scheduled on this cluster: it has {intact} intact {request.pod_type} slice(s)"
        f"{f' ({len(broken)} more missing hosts)' if broken else ''} and no autoscaler that could add "
        f"{request.head_resource}. Slice types here: {', '.join(have) or 'none'}."
    )


def intact_slices(request: TpuSliceRequest, nodes: list[dict], lost: frozenset[str] = frozenset()) -> int:
    """How many slices of the request's type have every host alive (busy or not), `lost` nodes counted gone."""
    return _slices(request, nodes, lost)[1]


def _slices(request: TpuSliceRequest, nodes: list[dict], lost: frozenset[str]) -> tuple[set[str], int]:
    """The broken slices of the request's type (alive, missing hosts) and how many are intact."""
    hosts: dict[str, int] = {}
    for node in nodes:
        labels = node.get("Labels", {})
        if node["Alive"] and node["NodeID"] not in lost and labels.get(POD_TYPE_LABEL) == request.pod_type \
                and labels.get(SLICE_NAME_LABEL):
            hosts[labels[SLICE_NAME_LABEL]] = hosts.get(labels[SLICE_NAME_LABEL], 0) + 1
    broken = {name for name, count in hosts.items() if count < request.hosts_per_slice}
    return broken, len(hosts) - len(broken)


def check_accelerator_satisfiable(request: AcceleratorRequest) -> None:
    """The same fail-fast rule for an accelerator (fraction): some node, present or autoscalable, must fit it."""
    needed = {request.resource: request.count}
    if request.accelerator_type:
        needed[f"accelerator_type:{request.accelerator_type}"] = 0.001
    alive = [node for node in ray.nodes() if node["Alive"]]
    if any(all(node["Resources"].get(k, 0) >= v for k, v in needed.items()) for node in alive):
        return
    if autoscaler.may_add(request.resource):
        return
    have = _accelerators_here(alive)
    raise UnsatisfiableRequestError(
        f"{request} can never be scheduled on this cluster: no node has "
        f"{' and '.join(f'{k} >= {v:g}' for k, v in needed.items())}, and no autoscaler could add one. "
        f"Accelerators here: {', '.join(have) or 'none'}."
    )


def _accelerators_here(nodes: list[dict]) -> list[str]:
    """`GPU x3 (H100)`, `TPU x4 (TPU-V6E)`: each kind of accelerator node, for error messages."""
    found = set()
    for node in nodes:
        resources = node["Resources"]
        types = ", ".join(sorted(k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")))
        for resource in VISIBLE_DEVICES_ENV:
            if resources.get(resource):
                found.add(f"{resource} x{resources[resource]:g}" + (f" ({types})" if types else ""))
    return sorted(found)


def _capacity_timeout(request: TpuSliceRequest, timeout: float, why: str) -> CapacityTimeoutError:
    free = ray.available_resources().get("TPU", 0)
    return CapacityTimeoutError(
        f"no capacity for {request} within capacity_timeout={timeout:g} s ({why}; "
        f"{request.total_hosts} hosts x {request.chips_per_host} chips needed, {free:.0f} TPU chips free "
        "in the cluster); nothing was left reserved. Raise capacity_timeout or add slices."
    )


def _slice_names(heads: PlacementGroup, nodes: list[dict]) -> list[str]:
    """The slice of each head bundle, from the labels of the node it landed on."""
    on = placement_group_table(heads)["bundles_to_node_id"]
    labels = {node["NodeID"]: node.get("Labels", {}) for node in _covering(nodes, on.values())}
    return [labels[on[index]][SLICE_NAME_LABEL] for index in sorted(on)]


def _map_hosts(reservation: SliceReservation, plan: list[tuple[int, str, int]], nodes: list[dict]) -> None:
    """Record each host's node and address: bundle i is (slice, worker) plan[i], pinned by label."""
    on = placement_group_table(reservation.hosts_group)["bundles_to_node_id"]
    addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in _covering(nodes, on.values())}
    reservation.bundles = {(s, w): index for index, (s, _, w) in enumerate(plan)}
    reservation.hosts = [
        HostPlan(
            slice_index=s,
            slice_name=slice_name,
            worker_id=w,
            ip=addresses[on[index]],
            process_id=0,
            num_processes=1,
            coordinator="",
            megascale_coordinator="",
            node_id=on[index],
        )
        for index, (s, slice_name, w) in enumerate(plan)
    ]


def _covering(nodes: list[dict], node_ids: object) -> list[dict]:
    """`nodes`, or a fresh `ray.nodes()` if a node the groups landed on joined after the snapshot."""
    known = {node["NodeID"] for node in nodes}
    return nodes if all(node_id in known for node_id in node_ids) else ray.nodes()


def _removed(group: PlacementGroup) -> bool:
    try:
        return placement_group_table(group).get("state") in ("REMOVED", None)
    except Exception:
        return False


def _name(group: PlacementGroup) -> str:
    try:
        return placement_group_table(group).get("name") or group.id.hex()
    except Exception:
        return group.id.hex()
