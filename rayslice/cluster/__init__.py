"""The cluster-side launcher: reserve, fan out, wire JAX, fail fast, release.

Runs inside a Ray driver (the Ray job that the Airflow side submits). Imports `ray`;
JAX is imported only inside the host processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from rayslice.cluster import (
    autoscaler,
    checkpoints,
    gang,
    host_env,
    host_process,
    jax_groups,
    log_drain,
    metrics,
    notices,
    phases,
    reaper,
    set_member,
    suspend,
)
from rayslice.cluster import queue as admission
from rayslice.cluster.environments import HostPlan
from rayslice.cluster.reservation import check_accelerator_satisfiable, check_satisfiable, intact_slices, reserve_slices
from rayslice.core import goodput, launcher
from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.context import CHECKPOINT_ROOT_ENV, checkpoint_dir_for
from rayslice.core.exceptions import (
    CapacityTimeoutError,
    InvalidRequestError,
    PreemptedError,
    RanElsewhereError,
    SuspendedError,
)
from rayslice.core.step import StepSpec, checkpoint_root_problem

__all__ = ["run_step", "reservation_name"]
#: What sets a shell up for the local cluster (RAY_ADDRESS, RAY_AUTH_MODE, ...), named in refusals.
LOCAL_ENV = 'eval "$(rayslice local env)"'


def log(message: str) -> None:
    print(f"[rayslice] {message}", flush=True)


def reservation_name(spec: StepSpec) -> str:
    """Names every placement group and actor so it traces back to its Airflow task."""
    return f"rayslice:{spec.owner.submission_id or 'adhoc'}"


def run_step(spec: StepSpec, *, driver_phases: dict[str, float] | None = None) -> Any:
    """Run the step on every host of its capacity; per-host results, or the fraction's one result.

    Call it in a Ray driver connected to the cluster (`ray.init(address=...)`); it never starts a Ray.
    `driver_phases` are the job's first phase times (accepted, driver started), known to the job's
    driver: every attempt logs its phase times (`rayslice.cluster.phases`) once its capacity is released.
    """
    _require_connected_driver()
    first = phases.Timeline()
    first.note("run_step")
    _reap_orphans(spec)
    first.note("reaped")
    checkpoint_dir = _checkpoint_dir(spec)
    waits = Waits(capacity=spec.capacity_timeout, start=gang.HOST_START_TIMEOUT_S)
    if spec.cluster_set is not None:  # one of several clusters: it runs the step only while it holds the claim
        waits.member = set_member.SetMember(spec, checkpoint_dir, log)
        waits.arrival = spec.cluster_set.arrival or waits.arrival  # one arrival in every cluster's queue
    records: list[dict] = []  # every attempt's, for the step's goodput figures
    outcome = "failed"
    try:
        result = _attempts(spec, first, checkpoint_dir, waits, records, driver_phases)
        outcome = "succeeded"
        return result
    except KeyboardInterrupt:
        outcome = "stopped"
        raise
    except BaseException as exc:
        outcome = f"failed: {type(exc).__name__}"
        raise
    finally:
        if waits.requeued is not None:  # requeued for an attempt that never came (it failed before it asked)
            waits.requeued.leave()
        if waits.member is not None:
            waits.member.finish(outcome)  # if it holds the step: the standbys end without running it; never raises
        _report_goodput(spec, records)


def _checkpoint_dir(spec: StepSpec) -> str | None:
    """The step's checkpoint folder: under its own root, else the cluster's (`RAYSLICE_CHECKPOINT_ROOT`).

    The step's root was checked when it was made; the cluster's is checked here, as the step starts: a
    relative `file://` root would put every checkpoint in a per-step folder that is deleted after the step.
    """
    root = spec.checkpoint_root or os.environ.get(CHECKPOINT_ROOT_ENV)
    if not spec.checkpoint_root and root and (problem := checkpoint_root_problem(root)):
        raise InvalidRequestError(f"the cluster's {CHECKPOINT_ROOT_ENV} {problem}; got {root!r} (set it on every node, "
                                  "or give the step its own checkpoint_root)")
    return checkpoint_dir_for(root, spec.owner)


def _report_goodput(spec: StepSpec, records: list[dict]) -> None:
    """The step's goodput line in the task log, its record in the job log, its figures to the metrics."""
    try:
        account = goodput.step_account(records)
        if not account.attempts and not any(account.seconds.values()):
            return  # refused before it asked for anything (an invalid or impossible request): nothing to account
        print(account.summary(), flush=True)
        print(goodput.record_line(account), flush=True)
        metrics.sender.goodput(spec, account)
    except Exception as exc:  # figures must never fail the step
        log(f"goodput figures unavailable: {type(exc).__name__}: {exc}")


def _attempts(spec: StepSpec, first: phases.Timeline, checkpoint_dir: str | None, waits: Waits,
              records: list[dict], driver_phases: dict[str, float] | None) -> Any:
    suspended: suspend.Suspension | None = None
    # An elastic step's suspensions to grow use no preemption retry, up to one per slice it may grow by.
    attempt, retries_used = 0, 0
    waits.grows_left = _growth_room(spec)
    while True:
        timeline = first if attempt == 0 else phases.Timeline()
        timeline.resumed_after = suspended
        for phase, at in (driver_phases or {}).items() if attempt == 0 else ():
            if phase in phases.PHASES:
                timeline.mark(phase, at)
            else:
                timeline.note(phase, at)
        if checkpoint_dir:
            log(checkpoints.describe_and_record(checkpoint_dir, try_number=spec.owner.try_number,
                                                preemption_attempt=attempt, submission_id=spec.owner.submission_id))
        timeline.note("checkpoint_described")
        step = host_process.Attempt(preemption_attempt=attempt, checkpoint_dir=checkpoint_dir)
        waits.resumptions_left = spec.preemption_retries - retries_used
        timeline.chips = (spec.request.total_chips if isinstance(spec.request, TpuSliceRequest)
                          else spec.request.count)
        timeline.outcome = "failed"
        try:
            if isinstance(spec.request, TpuSliceRequest):
                result = _run_on_slices(spec, spec.request, step, timeline, waits)
            else:
                result = _run_on_fraction(spec, spec.request, step, timeline, waits)
            timeline.outcome = "succeeded"
            return result
        except KeyboardInterrupt:
            timeline.outcome = "stopped"
            raise
        except RanElsewhereError:
            timeline.outcome = "stood by"  # another cluster of its set ran the step: no failure of this one's
            raise
        except PreemptedError as exc:
            timeline.outcome = "preempted"
            _note_lost_work(timeline, checkpoint_dir)
            suspended = suspend.Suspension.of(exc, timeline) if isinstance(exc, SuspendedError) else None
            grows = bool(getattr(exc, "grow", False)) and waits.grows_left > 0
            waits.grows_left -= grows
            if waits.member is not None:  # a set counts its retries once, whichever clusters used them
                retries_used = max(retries_used, waits.member.retries_used)
            if not grows and retries_used >= spec.preemption_retries:
                if suspended is not None:
                    log(suspend.exhausted(spec))
                raise
            retries_used += not grows
            if waits.member is not None:  # its hosts have ended: whichever cluster admits it next runs it
                if waits.hosts_unaccounted:  # another cluster must not start beside a host that may still run
                    log("cluster set: a host of the suspended attempt was never reported ended, so the step does not "
                        "move to another cluster of its set: it fails here (an Airflow retry starts it afresh)")
                    raise
                waits.member.release(str(exc), retries_used)
            # The GCS may show a lost node alive for seconds yet (a host lost in a notice's grace rides along too).
            waits.lost_nodes |= {node for node in (getattr(exc, "node_id", ""), getattr(exc, "also_lost", "")) if node}
            waits.suspended = str(exc) if suspended is not None else ""
            waits.held_slices = waits.granted_slices if getattr(exc, "grow", False) else 0
            if getattr(exc, "grow", False):
                timeline.outcome = "grew"  # stopped at a checkpoint of its own choosing: nothing lost but what it says
            if grows:
                log(f"elastic: the step stopped to grow: it goes back into the queue at its original arrival and "
                    f"resumes on as many slices as are free, at least the {waits.held_slices} it had, up to "
                    f"{spec.request.num_slices} (no preemption retry used)")
                waits.capacity, waits.start = spec.capacity_timeout, gang.HOST_START_TIMEOUT_S
            elif suspended is not None:
                log(suspend.requeued(spec, exc, waits.arrival, retries_used, checkpoint_dir))
                # Not the step's own doing: its wait to come back (behind whoever suspended it, for as long as
                # that runs) and its hosts' start get their whole budgets again.
                waits.capacity, waits.start = spec.capacity_timeout, gang.HOST_START_TIMEOUT_S
            else:
                log(f"preempted: {exc}; retrying the whole gang ({retries_used} of {spec.preemption_retries})"
                    + (f", avoiding {exc.slice_name}" if getattr(exc, "slice_name", "") else ""))
        finally:
            if timeline.resumed_after is not None and timeline.resumed_after.released:
                # Suspended from the capacity's release to its return (goodput counts it apart from waiting).
                back = timeline.times.get("reserved", time.time())
                timeline.add_spans({"suspended": [[timeline.resumed_after.released, back]]})
            for line in timeline.lines():
                print(line, flush=True)
            records.append(timeline.record())
            if timeline.outcome != "stood by":  # another cluster of its set ran it: nothing held, no attempt here
                metrics.sender.attempt(spec, timeline.times, timeline.queue_wait())
        attempt += 1


def _growth_room(spec: StepSpec) -> int:
    """How many suspensions to grow an elastic step may take without a preemption retry: one per slice."""
    request = spec.request
    if isinstance(request, TpuSliceRequest) and request.elastic:
        return request.num_slices - (request.min_slices or request.num_slices)
    return 0


def _note_lost_work(timeline: phases.Timeline, checkpoint_dir: str | None) -> None:
    """A preempted attempt's lost work: from its newest checkpoint (written during it) to where its body stopped.

    The preempted hosts' own reports died with them, so the checkpoint folder tells where the resume
    starts; without a checkpoint of this attempt the goodput counts its whole body lost (its default).
    """
    started = timeline.times.get("step_started", timeline.detail.get("actors_started"))
    ended = timeline.detail.get("gang_returned")
    if ended is not None and timeline.times.get("step_done", ended) < ended:
        # The body stopped on every host before the gang returned (it raised after its save): what follows,
        # the hosts' exit, is redone by no one.
        ended = timeline.times["step_done"]
    written = checkpoints.newest_written(checkpoint_dir) if checkpoint_dir else None
    if started is not None and ended is not None and written is not None and started <= written <= ended:
        timeline.add_spans({"lost": [[written, ended]]})


#: After a suspension, how much longer to wait for host processes Ray has not yet reported ended.
HOSTS_END_S = 90.0


@dataclass
class Waits:
    """What a step may still spend waiting, over all its attempts together (preemption retries included).

    Capacity: `capacity_timeout` in all; host processes starting: `HOST_START_TIMEOUT_S` in all.
    So a step never waits longer than capacity_timeout + 300 s in total, however many retries; after
    a suspension (a preemption notice, a higher-priority step) both budgets start again.
    """

    capacity: float
    start: float
    lost_nodes: frozenset[str] = frozenset()
    arrival: float = field(default_factory=time.time)  # in the admission queue: kept by a retried gang
    suspended: str = ""  # why the last attempt was suspended (shown while the step waits in the queue again)
    resumptions_left: int = 0  # preemption retries left: a step with none left is no priority victim
    granted_slices: int = 0  # an elastic step: the slices its current attempt runs on
    grows_left: int = 0  # an elastic step: suspensions to grow it may still take (no more offers after)
    held_slices: int = 0  # an elastic step that stopped to grow: the slices it had (it never comes back on fewer)
    # The queue place of an attempt that ended to resume: back to waiting in its line, never left (`_admit` rejoins
    # it; `run_step` leaves it if no attempt does).
    requeued: admission.Place | None = None
    # A step on several clusters: this job's part (it stands by while another cluster holds the step).
    member: set_member.SetMember | None = None
    hosts_unaccounted: bool = False  # the last attempt's hosts were not all reported ended (a node cut off)

    def spend(self, kind: str, since: float) -> None:
        setattr(self, kind, max(0.0, getattr(self, kind) - (time.monotonic() - since)))

    def resumes_after(self, error: BaseException | None) -> bool:
        """Whether `_attempts` starts another attempt after this one ended with `error` (as it decides): a
        preemption (a suspension, a lost host) with a preemption retry left, or a stop to grow with a growth
        left. Then the step's queue place is requeued at its release rather than left."""
        if not isinstance(error, PreemptedError):
            return False
        return self.resumptions_left > 0 or (bool(getattr(error, "grow", False)) and self.grows_left > 0)

    def keep_place(self, place: admission.Place, error: BaseException | None) -> bool:
        """At an attempt's release: requeue `place` (True) when the step resumes, else the caller leaves it."""
        if not self.resumes_after(error):
            return False
        self.requeued = place.requeue()
        return True


def _require_connected_driver() -> None:
    """Refuse to run where Ray would reserve nothing real: no driver, or a Ray this process started itself."""
    connect = ("connect this process to the cluster first: ray.init(address=...) with its GCS address, or "
               f"ray.init() with RAY_ADDRESS set (for the local cluster: {LOCAL_ENV})")
    if not ray.is_initialized():
        raise InvalidRequestError(f"run_step needs a Ray driver connected to a cluster, and none is: {connect}")
    node = getattr(ray._private.worker, "_global_node", None)
    if getattr(node, "head", False):  # ray.init() found no cluster to join and started one in this process
        raise InvalidRequestError(
            "run_step needs a Ray driver connected to a cluster, but ray.init() started a new local Ray in this "
            f"process (it found no RAY_ADDRESS), which has no slices: {connect}")
    _require_matching_auth(getattr(node, "webui_url", None))


def _require_matching_auth(dashboard: str | None) -> None:
    """Refuse a token-auth driver on a cluster without auth: Ray would start its host processes and lose them.

    Such a driver (RAY_AUTH_MODE=token, or unset where Ray turned token auth on because it found a
    token) connects to a cluster without auth, but the workers that cluster starts for it cannot
    talk back to it, and Ray reports an `ActorDiedError` naming neither. The dashboard says which
    mode the cluster runs in; the check costs one local HTTP call, and only in token mode.
    """
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token auth: no mode to mismatch
        return
    if not dashboard or not is_token_auth_enabled():
        return
    try:
        url = dashboard if "://" in dashboard else f"http://{dashboard}"
        with urllib.request.urlopen(f"{url}/api/authentication_mode", timeout=5) as resp:
            cluster_mode = json.load(resp).get("authentication_mode")
    except (OSError, ValueError):
        return  # cannot tell: Ray's own error stays the only one
    if cluster_mode == "disabled":
        mode = os.environ.get("RAY_AUTH_MODE", "unset")
        raise InvalidRequestError(
            f"this driver uses Ray token auth (RAY_AUTH_MODE={mode}) but the cluster at {dashboard} runs without "
            "auth, so the processes it starts for this driver could not reach it: set RAY_AUTH_MODE=disabled before "
            f"ray.init() (for the local cluster, {LOCAL_ENV} sets it)")


def _reap_orphans(spec: StepSpec) -> None:
    """Before reserving, free what ended jobs left behind (cheap; it must never fail the step)."""
    try:
        for orphan in reaper.reap(exclude=spec.owner.submission_id or None):
            log(f"reaped {orphan.kind} {orphan.name}: its Ray job {orphan.submission_id} is {orphan.job_status}")
    except Exception as exc:
        log(f"could not sweep orphaned reservations: {type(exc).__name__}: {exc}")
    try:  # keys in Ray's KV outlive their job: a killed driver never forgot its hosts' phase times
        reaper.forget_ended_phases(exclude=spec.owner.submission_id or None)
    except Exception as exc:
        log(f"could not sweep ended steps' phase keys: {type(exc).__name__}: {exc}")


def _admit(spec: StepSpec, waits: Waits, timeline: phases.Timeline, most_slices: int | None = None) -> admission.Place:
    """Take the step's place in the cluster's admission queue and wait (within capacity_timeout) until admitted.

    After an attempt that ended to resume, the place it kept (requeued, never left) takes this attempt's request.
    A step on several clusters waits out of the queue while another cluster holds it, and leaves the queue when
    another claims it meanwhile (`set_member`); it claims the step once its capacity is held (`_claim_or_give_back`).
    """
    member = waits.member
    while True:
        if member is not None and member.must_stand_by():
            if waits.requeued is not None:  # another cluster took the step back up: no place held here meanwhile
                waits.requeued.leave()
                waits.requeued = None
            member.stand_by()
            # Another cluster ran it meanwhile, for as long as that took: waiting here starts afresh.
            waits.capacity, waits.start = spec.capacity_timeout, gang.HOST_START_TIMEOUT_S
        if member is not None:  # retries used on other clusters of its set count before it waits here
            waits.resumptions_left = min(waits.resumptions_left, member.count_retries())
        place = admission.place_for(spec, arrival=waits.arrival,
                                    preemptible=spec.preemptible and waits.resumptions_left > 0,
                                    most_slices=most_slices, least_slices=waits.held_slices or None,
                                    grows=waits.grows_left > 0)
        if waits.requeued is not None:
            place, waits.requeued = waits.requeued.rejoin(place.entry), None
        if member is not None:
            place.give_up = member.taken_elsewhere
        started = time.monotonic()
        timeline.note("queued")
        marker = None
        try:
            if not place.join().admitted.is_set():  # it waits: say so where the Slices page and `capacity` look
                why = f"/suspended: {suspend.marker_text(waits.suspended)}" if waits.suspended else ""
                marker = placement_group([{"CPU": 0.001}], name=f"{reservation_name(spec)}{why}/queued")
            waited = place.wait(waits.capacity)
        except admission.Withdrawn:
            continue  # another cluster claimed the step while it waited here: stand by
        except BaseException:
            place.leave()  # a cancelled step (ray job stop) gives its place up at once
            raise
        finally:
            waits.spend("capacity", started)
            if marker is not None:
                with contextlib.suppress(Exception):
                    remove_placement_group(marker)
        timeline.note("admitted")
        if member is not None:
            member.admitted()  # a tie with a cluster later in the set's order goes to this one
        if waited >= 1:
            log(f"admitted after {waited:.1f} s in the queue")
        return place


def _run_on_slices(spec: StepSpec, request: TpuSliceRequest, attempt: host_process.Attempt,
                   timeline: phases.Timeline, waits: Waits) -> list[Any]:
    name = reservation_name(spec)
    log(f"waiting for capacity: {request} (capacity_timeout={spec.capacity_timeout:.0f} s, "
        f"{waits.capacity:.0f} s of it left)")
    started = time.monotonic()
    if request.subslice:  # before the queue: nothing is held or waited for
        raise InvalidRequestError(
            f"{request}: this launcher does not run subslices yet. Ray's SubslicePlacementGroup places one only "
            "on real TPU hosts (it reads their chip coordinates through libtpu), and rayslice reserves whole slices; "
            f"ask for a whole {request.pod_type}, or for the smaller slice type of the subslice's size")
    most = None
    if request.elastic:  # never waits for more than its least; after a loss, asks for no more than are left
        least = request.with_slices(request.min_slices)  # type: ignore[arg-type]
        check_satisfiable(least, lost=waits.lost_nodes)
        if waits.lost_nodes:
            most = intact_slices(request, ray.nodes(), waits.lost_nodes)
    else:
        check_satisfiable(request, lost=waits.lost_nodes)  # an impossible request never enters the queue
    asked, asked_spec = request, spec
    while True:
        place = _admit(asked_spec, waits, timeline, most_slices=most)
        try:
            request, spec = asked, asked_spec
            if request.elastic:  # the slices the queue admitted it on: what this attempt reserves and its program sees
                request = request.with_slices(int(place.entry.amount))
                waits.granted_slices = request.num_slices
                spec = spec.model_copy(update={"request": request})
                log(f"elastic: starting on {request.num_slices} of {asked.min_slices}-{asked.num_slices} x "
                    f"{request.pod_type} (elastic_wait={asked.wait_for_all_s:g} s)")
            timeline.chips = request.total_chips
            return _reserve_and_run_on_slices(spec, request, attempt, timeline, waits, name, started, place)
        except admission.Withdrawn:
            continue  # another cluster of its set claimed the step: nothing is held here; stand by
        finally:
            if waits.requeued is not place:
                place.leave()


def _reserve_and_run_on_slices(spec: StepSpec, request: TpuSliceRequest, attempt: host_process.Attempt,
                               timeline: phases.Timeline, waits: Waits, name: str, started: float,
                               place: admission.Place) -> list[Any]:
    reserving = time.monotonic()
    timeline.note("reserving")
    try:
        reservation = reserve_slices(request, timeout=waits.capacity, name=name, lost_nodes=waits.lost_nodes,
                                     place=place)
    except SuspendedError as exc:  # told while Ray still placed its slices: nothing held, it resumes in its place
        waits.keep_place(place, exc)
        raise
    finally:
        waits.spend("capacity", reserving)
    _claim_or_give_back(waits, reservation.release)
    timeline.mark("reserved")
    actors: list[Any] = []
    spec_json = spec.model_dump_json()
    # After a failure: the last line of a host that raised, and a quiet spell (QUIET_S) for hosts that died.
    drain, drain_from, quiet = log_drain.LogDrain(), [], log_drain.LogDrain.QUIET_S
    # From here on a drained node of the reservation is the step's preemption notice (cluster/notices.py).
    # An elastic function step also hears the queue's offer to grow (a command step's program is never offered it:
    # its exit after the notice would read as a stop for it).
    # With no resumption left, stopping early cannot help: the hosts hear a notice only at its last call.
    suspended, ended, watch, watching = False, None, None, False
    try:  # from here on, whatever happens (an interrupt included), the reservation is released (the finally below)
        watch = notices.Watch(
            f"{spec.owner.submission_id or 'adhoc'}:{attempt.preemption_attempt}:{uuid.uuid4().hex[:8]}",
            {h.node_id: h.label for h in reservation.hosts if h.node_id},
            requested=lambda: place.suspend or ((place.grow, 0.0, True)
                                                if place.grow and spec.command is None else None),
            resumable=waits.resumptions_left > 0)
        attempt = replace(attempt, notice_key=watch.key)
        watch.__enter__()
        watching = True
        # Once the attempt heard its notice, its hosts' JAX ending their processes as peers stop is expected noise.
        drain.explain_shutdown({h.label for h in reservation.hosts}, watch.hosts_stopping)
        slices = sorted({h.slice_name for h in reservation.hosts})
        log(f"reserved {', '.join(slices)} in {(time.monotonic() - started) * 1000:.0f} ms")
        strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy
        # What a host needs before its coordinator is known (its slice, the megascale coordinator).
        early = jax_groups.plan_processes(reservation.hosts, multislice=request.multislice, ports={})
        hosts_env = _hosts_runtime_env(spec, [h.node_id for h in reservation.hosts])
        for host, plan in zip(reservation.hosts, early, strict=True):
            actors.append(
                host_process.HostProcess.options(
                    name=f"{name}/{host.label}",
                    num_cpus=1,
                    resources={"TPU": request.chips_per_host},
                    runtime_env=hosts_env.runtime_env,
                    scheduling_strategy=strategy(
                        reservation.hosts_group,
                        placement_group_bundle_index=reservation.bundles[(host.slice_index, host.worker_id)],
                    ),
                ).remote(host.label, spec_json, plan, hosts_env.launcher_digest)
            )
        timeline.note("actors_created")
        starting = time.monotonic()
        try:  # a notice while the hosts start suspends the step at once: a victim frees its slice within its grace
            ports = gang.await_started(actors, reservation.hosts, timeout=waits.start, watch=watch)
        except SuspendedError:
            suspended = True
            raise
        finally:
            waits.spend("start", starting)
        timeline.note("actors_started")
        leaders = jax_groups.group_leaders(reservation.hosts, multislice=request.multislice)
        plans = jax_groups.plan_processes(reservation.hosts, multislice=request.multislice,
                                    ports={i: ports[i] for i in leaders})
        log(f"running on {', '.join(slices)}: {len(plans)} hosts x {request.chips_per_host} chips")
        try:
            results = gang.run_gang(actors, plans, spec, attempt, timeline, watch)
        except BaseException as exc:
            drain_from = log_drain.raised_on(exc, plans)
            suspended = isinstance(exc, SuspendedError)
            if suspended and gang.stopped_to_grow(watch):
                # it stopped to take more slices (for an offer, even one the queue took back or a notice held back)
                exc.grow = True  # type: ignore[attr-defined]
            if isinstance(exc, KeyboardInterrupt):  # stopped on request: nobody waits for last lines
                quiet = 0.0
            raise
        drain_from, quiet = [plan.label for plan in plans], 0.0
        return results
    except BaseException as exc:
        ended = exc
        raise
    finally:
        timeline.note("gang_returned")
        if watching:
            watch.__exit__(None, None, None)
            if watch.noticed_at is not None:
                timeline.note("notice", watch.noticed_at)
        gang.kill(actors)
        # and leaves the queue (the next in line may reserve now), or, if the step resumes, keeps its place in line
        resumes = waits.resumes_after(ended)
        still_held = reservation.release(requeue=resumes)
        if resumes:
            waits.requeued = place
        if suspended or (resumes and waits.member is not None):
            # no step body may run on two slices (or clusters) at once: the next attempt starts after every host ended
            waits.hosts_unaccounted = not _wait_for_hosts_to_end(actors)
        timeline.mark("released")
        _log_release(str(request), started, still_held)
        drain.wait(drain_from, quiet=quiet)  # after the release: the chips are free while the last lines arrive
        drain.close()


def _wait_for_hosts_to_end(actors: list[Any]) -> bool:
    """After a suspension: every host process has ended before the next attempt starts elsewhere.

    Usually within a second of the kill. A host on a node cut off from the GCS stays "alive" until
    Ray declares its node dead (its health check, tens of seconds): wait for that too, up to
    `HOSTS_END_S`, and say so when even that was not enough. Whether every host was reported ended.
    """
    left = gang.wait_dead(actors)
    if not left:
        return True
    log(f"{len(left)} host process(es) of the suspended attempt have not ended yet: waiting up to "
        f"{HOSTS_END_S:.0f} s before the step resumes elsewhere")
    left = gang.wait_dead(left, timeout=HOSTS_END_S)
    if left:
        log(f"{len(left)} host process(es) of the suspended attempt still not reported ended after "
            f"{HOSTS_END_S:.0f} s more (their node unreachable): the step resumes anyway"
)
    return not left


class HostsEnv(NamedTuple):
    """How the step's host processes start: their runtime env, and the launcher they must find installed."""

    runtime_env: dict[str, Any] | None
    launcher_digest: str | None  # set where the launcher was left out (a labelled node): the host checks it


def _hosts_runtime_env(spec: StepSpec, node_ids: list[str] | None = None, resource: str = "") -> HostsEnv:
    """The host processes' runtime env on these nodes: the user's, and the launcher where it is not installed.

    `resource` instead of nodes: Ray picks the node, so the launcher is left out only if every node that has
    the resource has it installed (and the caller pins the actor to the label: a node may join meanwhile).
    """
    if node_ids is None:  # an autoscaler may add a node for it, which nobody can know to carry the label: ship it
        node_ids = [] if autoscaler.may_add(resource) else \
            [n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
    modules = host_env.launcher_modules(node_ids, spec)
    env = host_env.actor_runtime_env(spec, modules)
    if spec.runtime_env:
        log(f"host processes get the step's runtime_env: {', '.join(sorted(spec.runtime_env.keys() - {'excludes'}))}")
    return HostsEnv(env, host_env.installed_digest(modules))


def _log_release(what: str, started: float, still_held: list[str]) -> None:
    if still_held:
        log(f"released {what} after {time.monotonic() - started:.1f} s, but Ray has not freed "
            f"{', '.join(still_held)} yet (a busy GCS): their removal is requested, and the sweep of ended "
            "jobs removes them if Ray never does")
    else:
        log(f"released {what} after {time.monotonic() - started:.1f} s")


def _claim_or_give_back(waits: Waits, give_back: Callable[[], Any]) -> None:
    """A step on several clusters, its capacity held here and no host started: claim it, or give the capacity back
    and raise `Withdrawn` (another cluster claimed it first). Claiming only now, not at admission, means a cluster
    that admitted the step onto capacity Ray cannot place (a draining slice) never holds it from the others."""
    member = waits.member
    if member is None:
        return
    try:
        claimed = member.claim()
    except BaseException:
        give_back()
        raise
    if not claimed:
        give_back()
        raise admission.Withdrawn("claimed by another cluster of its set")
    # Retries the step used on other clusters of its set count here too (its notice watch reads this).
    waits.resumptions_left = min(waits.resumptions_left, member.resumptions_left)


def _run_on_fraction(spec: StepSpec, request: AcceleratorRequest, attempt: host_process.Attempt,
                     timeline: phases.Timeline, waits: Waits) -> Any:
    check_accelerator_satisfiable(request)  # an impossible request never enters the queue
    log(f"waiting for capacity: {request} (capacity_timeout={spec.capacity_timeout:.0f} s)")
    started = time.monotonic()
    while True:
        place = _admit(spec, waits, timeline)
        try:
            _claim_or_give_back(waits, place.leave)
            return _place_and_run_fraction(spec, request, attempt, timeline, waits, started, place)
        except admission.Withdrawn:
            continue  # another cluster of its set claimed the step: nothing is held here; stand by
        finally:
            if waits.requeued is not place:
                place.leave()


def _fraction_started(actor: Any, plan: HostPlan, within: float, watch: notices.Watch | None) -> float | None:
    """Wait (up to `within` s) for the fraction's worker to run: how long it took, or None if it did not.

    A notice told meanwhile suspends the step at once: no body ran, and its accelerator is free for whoever
    outranks it within the grace, not after the worker's start-up.
    """
    began = time.monotonic()
    ref = actor.free_port.remote()
    while True:
        left = within - (time.monotonic() - began)
        ready, _ = ray.wait([ref], timeout=max(0.0, min(left, notices.POLL_S if watch is not None else left)))
        if ready:
            return time.monotonic() - began
        if watch is not None and (told := watch.heard()) is not None and not told.grow:
            raise gang.suspension_while_starting(watch, [plan])
        if left <= 0:
            return None


def _place_and_run_fraction(spec: StepSpec, request: AcceleratorRequest, attempt: host_process.Attempt,
                            timeline: phases.Timeline, waits: Waits, started: float, place: admission.Place) -> Any:
    placing = time.monotonic()
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
    options = request.ray_options()
    if place.entry.part:  # TPU chips: on the slice type the queue counted them against, packed onto one slice
        from ray._private.state import available_resources_per_node

        options["label_selector"] = admission.chip_label_selector(place.entry.kind, request.count, ray.nodes(),
                                                                  available_resources_per_node())
    hosts_env = _hosts_runtime_env(spec, resource=request.resource)
    if hosts_env.launcher_digest:  # only where the launcher is installed (not on a node that joined since)
        options["label_selector"] = {**options.get("label_selector", {}), launcher.LABEL: hosts_env.launcher_digest}
    drain, drain_from, quiet = log_drain.LogDrain(), [], log_drain.LogDrain.QUIET_S
    suspended, ended, watch, actors = False, None, None, []
    try:  # from the actor's creation on, whatever happens (an interrupt included), it is killed (the finally below)
        actors.append(host_process.HostProcess.options(
            name=f"{reservation_name(spec)}/{request.resource}", num_cpus=0, runtime_env=hosts_env.runtime_env,
            **options).remote(str(request), spec.model_dump_json(), plan, hosts_env.launcher_digest))
        actor = actors[0]
        # A preemptible fraction hears the queue's word (a higher-priority step needs its accelerator) as a notice;
        # the others listen for nothing (no host polls the GCS for a notice that cannot come).
        if place.entry.preemptible:
            entering = notices.Watch(
                f"{spec.owner.submission_id or 'adhoc'}:{attempt.preemption_attempt}:{uuid.uuid4().hex[:8]}", {},
                requested=lambda: place.suspend, resumable=waits.resumptions_left > 0)
            attempt = replace(attempt, notice_key=entering.key)
            entering.__enter__()
            watch = entering
        budget = waits.start
        try:  # admitted: its worker's start has the host start budget, not what the queue left of capacity_timeout
            started_in = _fraction_started(actor, plan, budget, watch)
        except SuspendedError:
            suspended = True
            raise
        finally:
            waits.spend("start", placing)
        if started_in is None:
            raise CapacityTimeoutError(
                f"{request} was admitted, but its process did not start on a node within the {budget:.0f} s "
                "left of the host start budget (its runtime_env installing, or Ray placing it): nothing was left "
                "reserved. Check the job log for the runtime_env's setup, or that a node with that accelerator is up."
            )
        log(f"running on {request}")
        try:
            result = gang.run_gang([actor], [plan], spec, attempt, timeline, watch)[0]
        except BaseException as exc:
            drain_from = [str(request)] if log_drain.raised_on(exc, [plan]) else []  # the actor's label
            suspended = isinstance(exc, SuspendedError)
            if isinstance(exc, KeyboardInterrupt):  # stopped on request: nobody waits for last lines
                quiet = 0.0
            raise
        drain_from, quiet = [str(request)], 0.0
        return result
    except BaseException as exc:
        ended = exc
        raise
    finally:
        if watch is not None:
            watch.__exit__(None, None, None)
            if watch.noticed_at is not None:
                timeline.note("notice", watch.noticed_at)
        gang.kill(actors)
        if suspended or (waits.member is not None and waits.resumes_after(ended)):
            # its process has ended before the step resumes: no body runs twice at once
            waits.hosts_unaccounted = not _wait_for_hosts_to_end(actors)
        if not waits.keep_place(place, ended):  # a step that resumes keeps its place in line
            place.leave()
        timeline.mark("released")
        log(f"released {request} after {time.monotonic() - started:.1f} s")
        drain.wait(drain_from, quiet=quiet)
        drain.close()
