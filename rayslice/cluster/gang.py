"""Run one step as a gang: one fresh process per host, all of them or none.

Each host gets its own actor (a fresh worker process: `jax.distributed` initializes once
per process). There are no per-host retries (a restarted rank poisons JAX's coordination
service); the first host to fail or die ends the whole gang at once, instead of leaving
its peers blocked in a collective until JAX's 300 s shutdown barrier.

This module is the driver's side of that: the wait for every host to start, the wait for
their ends (with what a preemption notice, a step_timeout or a collective hang make of
them), the cancel, and the leave. The host's own side is host_process.py; which host a
failure is blamed on, host_loss.py; the JAX groups' plan, jax_groups.py.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

import ray

from rayslice.cluster import hang_watch, host_loss, node_probe, notices, phases
from rayslice.cluster.environments import HostPlan
from rayslice.cluster.host_process import NOTICE_HEARD_KEY, Attempt
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.exceptions import (
    CollectiveHangError,
    HostLostError,
    PreemptedError,
    StepFailedError,
    StepTimeoutError,
    SuspendedError,
)
from rayslice.core.step import StepSpec

#: How long host processes may take to start (a worker process and the job's runtime env, on a loaded node).
HOST_START_TIMEOUT_S = 300.0
#: How long hosts that all returned may take to leave their JAX groups before they are killed anyway.
LEAVE_TIMEOUT_S = 10.0
#: Once a host has ended for a preemption notice, how much longer its peers may take to end too (bounded
#: by the stop before the deadline): a peer stuck in a collective the first one left must not hold the
#: slice through a long notice (a maintenance notice an hour ahead, a long priority grace).
PEERS_STOP_S = 60.0


def run_gang(actors: list[Any], plans: list[HostPlan], spec: StepSpec, attempt: Attempt | None = None,
             timeline: phases.Timeline | None = None, watch: notices.Watch | None = None) -> list[Any]:
    """Run the step on every actor; return results in host order, or fail on the first error.

    The hosts' phase times go to `timeline` once every host has returned. With a `watch`, a
    preemption notice the hosts were told changes what an end means (docs/preemption.md, "How a
    step's end is read"): every host returning is still success, but any failure after it (the step
    stopping for it, a host lost, its step_timeout or hang_timeout expiring) is a suspension
    (`SuspendedError`), and a step still running shortly before the deadline is stopped.
    """
    spec_json = spec.model_dump_json()
    attempt = attempt or Attempt()
    watch_keys: dict[str, str] = {}
    if spec.hang_timeout is not None and isinstance(spec.request, TpuSliceRequest):
        prefix = f"{spec.owner.submission_id or 'adhoc'}:{attempt.preemption_attempt}:{uuid.uuid4().hex[:8]}:"
        attempt = replace(attempt, hang_watch=prefix, hang_interval=hang_watch.poll_interval(spec.hang_timeout))
        watch_keys = {plan.label: prefix + plan.label for plan in plans}
    if timeline is not None:  # every host publishes its phases as its body starts: read back if it never returns
        attempt = replace(attempt, phases_key=phases.attempt_key(spec.owner.submission_id,
                                                                 attempt.preemption_attempt, uuid.uuid4().hex[:8]))
    refs = {actor.run.remote(spec_json, plan, attempt): i
            for i, (actor, plan) in enumerate(zip(actors, plans, strict=True))}
    results: list[Any] = [None] * len(plans)
    reports: list[dict[str, float]] = [{} for _ in plans]
    pending = list(refs)
    deadline = None if spec.step_timeout is None else time.monotonic() + spec.step_timeout
    returned, ended_at = False, None
    try:
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if watch_keys:
                timeout = attempt.hang_interval if timeout is None else min(timeout, attempt.hang_interval)
            if watch is not None:
                timeout = notices.POLL_S if timeout is None else min(timeout, notices.POLL_S)
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:  # a host that already returned counts, even when the stop is due: its body is done
                if _stop_due(watch, deadline) and _all_returned(pending):
                    continue  # every host returned as the wait ended: collected above, never stopped or timed out
                if watch is not None and (stop_at := watch.stop_at()) is not None and time.time() >= stop_at:
                    raise _suspension(watch, plans, stopped=True)
                stopping = watch is not None and (told := watch.heard()) is not None and not told.grow
                if deadline is not None and time.monotonic() >= deadline:
                    if stopping:  # it was stopping for the notice: a suspension, not a failed try
                        raise _suspension(watch, plans, stopped=True, how=(
                            f"its step_timeout={spec.step_timeout:.0f} s expired while it stopped for the notice"))
                    slow = ", ".join(plans[refs[r]].label for r in pending)
                    raise StepTimeoutError(
                        f"step exceeded step_timeout={spec.step_timeout:.0f} s; still running on {slow}")
                try:
                    _check_hang(spec, [plans[refs[r]] for r in pending], watch_keys, plans)
                except CollectiveHangError as exc:
                    if not stopping:
                        raise
                    raise _suspension(watch, plans, stopped=True, how=(
                        "its hang_timeout expired while it stopped for the notice (its hosts sat in a collective "
                        "their peers had left)")) from exc
                continue
            index = refs[ready[0]]
            try:
                results[index], reports[index] = host_loss.get_result(ready[0], plans[index])
            except StepFailedError as exc:
                told = None if watch is None else watch.heard()  # an offer taken back still counts
                if told is not None and (not told.grow or exc.cause.startswith("StepSuspended")):
                    # After a notice, an end short of success is the step stopping for it (or its node going):
                    # the others get until shortly before the deadline (at most PEERS_STOP_S more) to finish
                    # their checkpoint too. The host's own error stays in the message and as the cause.
                    stopped = _wait_until(pending, min(watch.stop_at() or time.time() + PEERS_STOP_S,
                                                       time.time() + PEERS_STOP_S))
                    lost = _lost_in_grace(index, exc, pending, refs, actors, plans)
                    raise _suspension(watch, plans, stopped=stopped, ended=exc, lost=lost) from exc
                if isinstance(exc, HostLostError):
                    index, error = host_loss.coordinator_first(index, exc, pending, refs, plans)
                    raise error from None
                if getattr(exc, "program_ended_at", None) is not None:  # a command step's program failed
                    index, error = host_loss.first_program_to_end(index, exc, pending, refs, plans)
                    raise error from None
                if not host_loss.may_be_a_peers_death(exc):
                    raise
                # A peer killed mid-collective makes the survivors' collectives fail first: blame the dead host.
                lost = host_loss.lost_peer(pending, refs, plans)
                if lost is None:
                    raise
                index, error = host_loss.coordinator_first(*lost, pending, refs, plans)
                raise error from None
        returned = True
    except SuspendedError:
        ended_at = time.time()
        kill(actors)
        raise
    except HostLostError as exc:
        ended_at = time.time()  # before the wait to tell a dead node from a dead process
        raise _lost_host(exc, index, actors, plans) from None
    except BaseException:
        ended_at = time.time()
        kill(actors)  # cancel the whole gang at once
        raise
    finally:
        hang_watch.forget(watch_keys)
        if attempt.phases_key:
            _record_phases(timeline, attempt.phases_key, plans, reports, ended_at=None if returned else ended_at)
    _leave_group(actors, plans, reports)
    if timeline is not None:
        timeline.hosts(reports)
    if watch is not None and watch.heard() is not None and watch.notice is not None:
        signalled = any(NOTICE_HEARD_KEY in report for report in reports)
        if spec.command is not None and signalled and all(r is None for r in results):
            # A program sent the notice's signal that then exits 0 with no result (MaxText: save, then
            # `sys.exit()`) stopped for it, unfinished. One never sent it (`notice_signal="none"`, a notice held
            # back) that exits 0 has finished: resuming it would run it twice.
            kill(actors)
            raise _suspension(watch, plans, stopped=False)
        print("[rayslice] the step returned after a preemption notice: its value is taken as the step's result "
              "(raise rayslice.StepSuspended instead to be resumed from the checkpoint)", flush=True)
    return results


def _stop_due(watch: notices.Watch | None, deadline: float | None) -> bool:
    """Whether the notice's stop or the step_timeout (`deadline`, monotonic) is due now."""
    stop_at = None if watch is None else watch.stop_at()
    return (stop_at is not None and time.time() >= stop_at) or (deadline is not None and time.monotonic() >= deadline)


def _all_returned(pending: list[Any]) -> bool:
    """A last look, without waiting, before a stop ends the gang: have all of these hosts returned meanwhile?

    A body that ended between the wait's timeout and the stop is done; stopping it would discard its
    value, and a resumption would run a finished step again (its writes twice).
    """
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
    return len(done) == len(pending)


def _lost_in_grace(index: int, first: StepFailedError, pending: list[Any], refs: dict[Any, int],
                   actors: list[Any], plans: list[HostPlan]) -> HostLostError | None:
    """A host lost while the step stopped for its notice (the first to end, or one that ended since), as
    `_lost_host` names it: with its node and slice where the node went, so the resumption avoids them.
    """
    if not isinstance(first, HostLostError):
        first = None
        ended, _ = ray.wait(pending, num_returns=len(pending), timeout=0) if pending else ([], [])
        for ref in ended:
            try:
                host_loss.get_result(ref, plans[refs[ref]])
            except HostLostError as exc:
                index, first = refs[ref], exc
                break
            except StepFailedError:
                continue
    if first is None:
        return None
    return _lost_host(first, index, actors, plans)


def _record_phases(timeline: phases.Timeline | None, key: str, plans: list[HostPlan],
                   reports: list[dict[str, float]], *, ended_at: float | None) -> None:
    """After an end short of success (at `ended_at`, when the gang was stopped): the hosts' phases from what they
    published; then the keys are forgotten."""
    try:
        if ended_at is not None and timeline is not None:
            found = phases.published(key, {i: plan.label for i, plan in enumerate(plans) if not reports[i]})
            timeline.hosts(phases.ended_short(reports, found, ended_at))
    except Exception as exc:  # figures must never hide the step's own outcome
        print(f"[rayslice] the hosts' phase times are unavailable: {type(exc).__name__}: {exc}", flush=True)
    finally:
        phases.forget(key, [plan.label for plan in plans])


def _wait_until(pending: list[Any], until: float | None) -> bool:
    """Wait for these hosts to end, until `until` (epoch seconds); True if some were still running then."""
    if not pending:
        return False
    ready, left = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, (until or time.time()) - time.time()))
    return bool(left)


def _suspension(watch: notices.Watch, plans: list[HostPlan], *, stopped: bool,
                ended: StepFailedError | None = None, how: str = "",
                lost: BaseException | None = None) -> SuspendedError:
    """The suspension error: which notice, which host's node, whether the step stopped by itself, and how.

    `ended`: the first host's end after the notice, kept in the message (a host that raised a real
    error as the notice came must not vanish into "suspended"). `lost`: a host lost meanwhile whose
    node is gone (`host_loss.with_node`): its node and slice ride on the error too, so the resumption avoids them.
    """
    notice = watch.notice or watch.offer
    assert notice is not None
    how = how or ("it was still running shortly before the deadline and was stopped: it resumes from its last "
                  "checkpoint" if stopped else "the step stopped for it")
    if ended is not None and not ended.cause.startswith("StepSuspended"):
        first = str(ended).strip().splitlines()[0][:300] if str(ended).strip() else type(ended).__name__
        how += f" (the first host to end: {first})"
    host = next((p.ip for p in plans if p.node_id == notice.node), None)
    error = SuspendedError(f"suspended by a preemption notice ({notice.reason}); {how}", cause="preemption notice",
                           host=host)
    error.node_id = notice.node
    error.slice_name = next((p.slice_name for p in plans if p.node_id == notice.node), "")
    error.stopped_at_deadline = stopped
    lost_node = getattr(lost, "node_id", "")
    if lost_node and not error.node_id:  # a priority notice names no node: the lost host's is the one to avoid
        error.node_id, error.slice_name = lost_node, getattr(lost, "slice_name", "")
    elif lost_node and lost_node != error.node_id:
        error.also_lost = lost_node  # type: ignore[attr-defined]
    return error


def _check_hang(spec: StepSpec, running: list[HostPlan], watch_keys: dict[str, str],
                plans: list[HostPlan]) -> None:
    """Fail the step once every still-running host has sat idle inside JAX for its hang_timeout.

    The message names every host: those stuck, where, and those that already returned (often the
    one that skipped the collective its peers wait in).
    """
    if not watch_keys or spec.hang_timeout is None:
        return
    states = hang_watch.read({plan.label: watch_keys[plan.label] for plan in running})
    idle = hang_watch.all_idle_for(states)
    if idle < spec.hang_timeout:
        return
    where = {s.label: s.where for s in states}
    hosts = "; ".join(f"{host_loss.where_is(plan)} in {where[plan.label]}" for plan in running)
    returned = [host_loss.where_is(plan) for plan in plans if plan not in running]
    if returned:
        hosts += f"; already returned from the step: {'; '.join(returned)}"
    first = running[0]
    raise CollectiveHangError(
        f"collective hang: every host process still running has sat idle inside JAX for {idle:.0f} s "
        f"(hang_timeout={spec.hang_timeout:.0f} s: no CPU time used, the step blocked in a JAX call): {hosts}. "
        "Every process must run the same collectives in the same order; one that skips, adds or reorders one "
        "(or a CPU-collectives bug) leaves its peers waiting forever. The slice is released. (Simulated "
        "cluster only; hang_timeout=None turns this off. On real TPUs, step_timeout covers a hung step.)",
        slice_index=first.slice_index, worker_id=first.worker_id, host=first.ip, cause="collective hang",
    )


def _leave_group(actors: list[Any], plans: list[HostPlan], reports: list[dict[str, float]]) -> None:
    """Every host has returned: let them leave their JAX groups together (bounded; the results are in)."""
    if all(plan.num_processes <= 1 for plan in plans):
        return
    refs = {actor.leave.remote(): i for i, actor in enumerate(actors)}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=LEAVE_TIMEOUT_S)
    for ref in ready:
        try:
            reports[refs[ref]]["left_group"] = ray.get(ref)
        except Exception:  # a host lost after it returned: the step's value stands
            pass


def await_started(actors: list[Any], plans: list[HostPlan], timeout: float = HOST_START_TIMEOUT_S,
                  watch: notices.Watch | None = None) -> list[int]:
    """Wait until every host process runs; each returns a free port (the group leaders' become coordinators).

    Bounded, and watching the hosts' nodes: a node lost before the step starts is a
    preemption exactly like one lost mid-step (whole-gang retry), never a hang. With a `watch`, a
    notice told while the hosts still start suspends the step at once (no body ran: nothing to save),
    so a victim frees its slice within its grace, not after its start-up (`HOST_START_TIMEOUT_S`).
    """
    refs = {actor.free_port.remote(): i for i, actor in enumerate(actors)}
    ports = [0] * len(actors)
    pending = list(refs)
    deadline = time.monotonic() + timeout
    index = 0
    slow: list[int] = []
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending),
                                      timeout=max(0.0, min(1.0 if watch is None else notices.POLL_S,
                                                           deadline - time.monotonic())))
            for ref in ready:
                index = refs[ref]
                ports[index] = host_loss.get_result(ref, plans[index])
            if not pending:
                break
            dead = host_loss.dead_nodes({plans[refs[ref]].node_id for ref in pending})
            for ref in pending:
                index = refs[ref]
                if plans[index].node_id in dead:
                    plan = plans[index]
                    lost = host_loss.with_node(PreemptedError(
                        f"host {host_loss.where_is(plan)} was lost before the step started: "
                        "its node was preempted or removed",
                        slice_index=plan.slice_index, worker_id=plan.worker_id, host=plan.ip,
                        cause="its node was preempted or removed",
                    ), plan)
                    if watch is not None and watch.notice is not None and not watch.notice.grow:
                        # the noticed node went: a suspension (budgets renewed), avoiding the lost node's slice
                        kill(actors)
                        raise _suspension(watch, plans, stopped=False, lost=lost, how=(
                            f"its hosts were still starting when {host_loss.where_is(plan)}'s node went")) from None
                    raise lost
            if watch is not None and (told := watch.heard()) is not None and not told.grow:
                kill(actors)
                raise suspension_while_starting(watch, plans)
            if time.monotonic() >= deadline:
                slow = [refs[ref] for ref in pending]
                break
    except SuspendedError:
        raise
    except HostLostError as exc:
        raise _lost_host(exc, index, actors, plans) from None
    if slow:  # alive as far as the GCS knows (checked each second): one probe of its raylet, no death window
        kill(actors)
        plan = plans[slow[0]]
        where = ", ".join(plans[i].label for i in slow)
        if node_probe.raylet_unreachable(plan.node_id):
            raise host_loss.with_node(PreemptedError(
                f"host {host_loss.where_is(plan)} was lost before the step started: its node does not answer",
                slice_index=plan.slice_index, worker_id=plan.worker_id, host=plan.ip,
                cause="its node was preempted or removed"), plan)
        raise HostLostError(f"the host processes on {where} did not start within {timeout:.0f} s",
                            slice_index=plan.slice_index, worker_id=plan.worker_id, host=plan.ip)
    return ports


def stopped_to_grow(watch: notices.Watch) -> bool:
    """Whether a suspension of this watch's attempt is a stop to grow: what its hosts were told last is an offer
    (one the queue took back meanwhile, or one told before a notice that is still held back from them)."""
    told = watch.heard()
    return told is not None and told.grow


def suspension_while_starting(watch: notices.Watch, plans: list[HostPlan]) -> SuspendedError:
    """A notice told before the step's body ran on any host: suspended at once, with nothing to save."""
    return _suspension(watch, plans, stopped=False, how="its hosts were still starting: no step body ran")


def _lost_host(exc: HostLostError, index: int, actors: list[Any], plans: list[HostPlan]) -> HostLostError:
    """Cancel the rest of the gang at once, then tell a preempted node from a process that died on a live one."""
    kill([actor for i, actor in enumerate(actors) if i != index])  # the lost actor's record tells its node's fate
    preempted = isinstance(exc, PreemptedError) or host_loss.node_died(plans[index].node_id, actors[index])
    kill([actors[index]])
    if not preempted:
        return exc
    return host_loss.with_node(PreemptedError(
        str(exc).replace("its process died", "its node was preempted or removed"),
        slice_index=exc.slice_index,
        worker_id=exc.worker_id,
        host=exc.host,
        cause="its node was preempted or removed",
    ), plans[index])


def kill(actors: list[Any]) -> None:
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already dead
            pass


def wait_dead(actors: list[Any], timeout: float = 10.0) -> list[Any]:
    """Wait (bounded) until Ray reports every one of these actors dead; those still alive after `timeout`.

    After a suspension the next attempt starts on other capacity: the old hosts must have ended
    first, so that no step body runs on two slices at once.
    """
    deadline = time.monotonic() + timeout
    left = list(actors)
    while left and time.monotonic() < deadline:
        left = [actor for actor in left
                if ray._private.state.state.actor_table(actor._actor_id.hex()).get("State") != "DEAD"]
        if left:
            time.sleep(0.05)
    return left
