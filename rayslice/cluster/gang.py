"""Run one step as a gang: one fresh process per host, all of them or none.

Each host gets its own actor (a fresh worker process: `jax.distributed` initializes once
per process). There are no per-host retries (a restarted rank poisons JAX's coordination
service); the first host to fail or die ends the whole gang at once, instead of leaving
its peers blocked in a collective until JAX's 300 s shutdown barrier.
"""

from __future__ import annotations

import base64
import importlib
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from rayslice.cluster import (
    commands,
    environments,
    hang_watch,
    host_env,
    node_probe,
    notices,
    phases,
    shutdown_noise,
)
from rayslice.cluster.environments import HostPlan
from rayslice.core import goodput
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.context import NOTICE_FILE_ENV, StepContext, deliver_notice, set_step_context, withdraw_offer
from rayslice.core.exceptions import (
    CollectiveHangError,
    HostLostError,
    PreemptedError,
    StepFailedError,
    StepTimeoutError,
    SuspendedError,
)
from rayslice.core.step import HOST_DONE_MARKER, StepSpec

#: How long a lost host's node may take to be declared dead (Ray's default health checks: 3 s x 5).
NODE_DEATH_WINDOW_S = 30.0
#: How long host processes may take to start (a worker process and the job's runtime env, on a loaded node).
HOST_START_TIMEOUT_S = 300.0
#: How long a failed collective waits for Ray to report the peer whose death caused it.
PEER_DEATH_WINDOW_S = 2.0
#: How long a lost host waits for its group's coordinator to be reported lost too (then the coordinator is named).
COORDINATOR_DEATH_WINDOW_S = 1.0
#: After a command step's program failed like a lost peer: how long the program that caused it may take to be reported.
PROGRAM_END_WINDOW_S = 2.0
#: How long hosts that all returned may take to leave their JAX groups before they are killed anyway.
LEAVE_TIMEOUT_S = 10.0
#: How long a host that ends waits for its phase times to be published (phases.publish), at most.
PUBLISH_WAIT_S = 5.0
#: A host report's key: when the notice's signal was sent to the command step's running program (absent: it
#: never was: it ended before, the notice was held back, or `notice_signal="none"`).
NOTICE_HEARD_KEY = "notice_heard"
#: Once a host has ended for a preemption notice, how much longer its peers may take to end too (bounded
#: by the stop before the deadline): a peer stuck in a collective the first one left must not hold the
#: slice through a long notice (a maintenance notice an hour ahead, a long priority grace).
PEERS_STOP_S = 60.0
#: Failures that may be a peer's death: JAX/XLA runtime errors, and what a broken link says.
RUNTIME_ERRORS = ("JaxRuntimeError", "XlaRuntimeError")
PEER_LOSS_SIGNS = ("Connection reset", "Connection closed", "Connection refused", "Broken pipe", "UNAVAILABLE",
                   "DEADLINE_EXCEEDED", "heartbeat")


@ray.remote(max_restarts=0, max_task_retries=0)
class HostProcess:
    """The step's process on one host. Its repr prefixes every line it prints in the job log.

    It starts preparing at once, in a thread, while the driver waits for the whole gang and
    plans it: it parses the spec, sets the environment JAX needs, imports JAX (slice steps) and
    loads the step function. `run` waits for that, then wires JAX and calls the step.
    """

    def __init__(self, label: str, spec_json: str | None = None, plan: HostPlan | None = None,
                 launcher_digest: str | None = None) -> None:
        self._label = label
        self._launcher_digest = launcher_digest  # the installed launcher this host must have (host_env)
        self._times = {"hosts_started": phases.process_start_time(), "actor_init": time.time()}
        self._prepared: tuple[StepSpec, Any] | None = None
        self._command_env: dict[str, str] = {}  # a command step's variables, for its child process
        self._failed: BaseException | None = None
        self._preparing: threading.Thread | None = None
        if spec_json is not None and plan is not None:
            self._preparing = threading.Thread(target=self._prepare, args=(spec_json, plan), daemon=True)
            self._preparing.start()

    def __repr__(self) -> str:
        return self._label

    def free_port(self) -> int:
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def _prepare(self, spec_json: str, plan: HostPlan) -> None:
        try:
            host_env.check_installed(self._launcher_digest)
            spec = StepSpec.model_validate_json(spec_json)
            environment = environments.detect(spec.request)
            if spec.command is not None:  # the program imports JAX itself, in a child process
                self._prepared = (spec, None)
                self._times["prepared"] = time.time()
                return
            os.environ.update(_over_user_env(spec, plan, environment.env(spec.request, plan)))
            if environments.preimports_jax(spec.request):
                import jax  # noqa: F401  (no backend is initialized: nothing is opened or held)
            self._times["jax_imported"] = time.time()
            self._prepared = (spec, load_step(spec))
            self._times["prepared"] = time.time()
        except BaseException as exc:  # raised again by run(), in the step's own words
            self._failed = exc

    def run(self, spec_json: str, plan: HostPlan, attempt: Attempt) -> tuple[Any, dict[str, float]]:
        """The step's value on this host, and the times of this host's phases."""
        self._times["run_called"] = time.time()
        if self._preparing is None:
            self._prepare(spec_json, plan)
        else:
            self._preparing.join()
        if self._failed is not None:
            raise self._failed
        assert self._prepared is not None
        spec, step = self._prepared
        environment = environments.detect(spec.request)
        if spec.command is None:  # a command's program joins its JAX group itself (command_env)
            environment.wire(spec.request, plan)
        self._times["jax_ready"] = time.time()
        owner = spec.owner
        context = StepContext(
            dag_id=owner.dag_id, run_id=owner.run_id, task_id=owner.task_id, map_index=owner.map_index,
            try_number=owner.try_number, submission_id=owner.submission_id,
            preemption_attempt=attempt.preemption_attempt, slice_index=plan.slice_index,
            slice_name=plan.slice_name, worker_id=plan.worker_id, process_index=plan.process_id,
            num_processes=plan.num_processes, checkpoint_dir=attempt.checkpoint_dir,
            num_slices=getattr(spec.request, "num_slices", 1),
        )
        self._times["step_started"] = time.time()
        # Read back by the driver if this host never returns its report (it raised, or was stopped).
        publishing = phases.publish(attempt.phases_key, plan.label, dict(self._times)) if attempt.phases_key \
            else None
        watched = attempt.hang_watch and environment is environments.SimulatedTpuSlice
        reported = False
        try:
            with _step_folder(spec), \
                 (tempfile.TemporaryDirectory(prefix="rayslice-program-", ignore_cleanup_errors=True)
                  if spec.command is not None else nullcontext()) as report_dir, \
                 (hang_watch.HostWatch(attempt.hang_watch + self._label, threading.get_ident(), attempt.hang_interval,
                                       # a command step's JAX runs in its program, which samples itself
                                       program_state=report_dir and os.path.join(report_dir, commands.IDLE_FILE))
                  if watched else nullcontext()):
                goodput.collect()  # spans a step reported before this one in this process are not this step's
                spans_file = report_dir and os.path.join(report_dir, "spans.jsonl")
                if spec.command is not None:
                    env = _over_user_env(spec, plan, environment.command_env(spec.request, plan))
                    notice = notices.CommandNotice(os.path.join(report_dir, "notice.json"), spec.notice_signal)
                    with _listening(attempt, notice.deliver):
                        result, heard = run_program(spec.command, {**os.environ, **env, **context.to_env(),
                                                                   goodput.SPANS_FILE_ENV: spans_file,
                                                                   NOTICE_FILE_ENV: notice.path},
                                                    report_dir, attempt.hang_interval if watched else 0.0, notice)
                    self._times.update(heard)  # the driver tells a program stopped for the notice from one done
                else:
                    set_step_context(context)
                    try:
                        with _listening(attempt, deliver_notice, withdraw_offer):
                            result = step(**spec.kwargs)
                    finally:
                        set_step_context(None)
                spans = goodput.collect(spans_file)  # what the step reported through its context (before the
                # command's report folder goes)
            self._times["step_done"] = time.time()
            if spans:
                self._times[phases.SPANS_KEY] = spans  # type: ignore[assignment]
            reported = True
        finally:  # also when the step raised: the driver waits for this host's last lines either way
            if publishing is not None:  # raised: the driver reads it, so it waits; reported: not needed
                publishing.leave(PUBLISH_WAIT_S, reported=reported)
                if not reported:  # where the body stopped (a suspension's lost work ends there, not at the exit)
                    self._times["step_done"] = time.time()
                    phases.publish(attempt.phases_key, plan.label, dict(self._times)).leave(
                        PUBLISH_WAIT_S, reported=False)
            sys.stderr.flush()
            print(f"{HOST_DONE_MARKER}{self._label}", flush=True)  # after everything the step printed
        return result, self._times

    def leave(self) -> float:
        """Leave the JAX group, once every host has returned: its shutdown is a barrier with the peers.

        Called only then, so no host waits at the barrier for one still working (which fails
        once JAX's shutdown timeout passes); a failure here is logged, never the step's outcome.
        """
        try:
            _leave_jax_group()
        except Exception as exc:
            print(f"[rayslice] leaving the JAX group failed after the step succeeded: {type(exc).__name__}: {exc}",
                  flush=True)
        return time.time()


def run_program(argv: list[str], env: dict[str, str], report_dir: str, hang_interval: float,
                notice: notices.CommandNotice) -> tuple[Any, dict[str, float]]:
    """A command step's program on this host, under its notice: its result, and the host's notice report.

    A program that wrote its result file has finished, even if the notice's signal then ended it on
    its way out (an exporter that wrote its rows must not be run again). The report says whether the
    signal was sent while it ran: only then does a clean exit without a result read as a stop for it.
    """
    try:
        result = commands.run(argv, env, report_dir, hang_interval, on_start=notice.started,
                              on_end=notice.program_ended)
    except commands.CommandExitError:
        written = commands.written_result(report_dir)
        if notice.signalled_at is None or written is None:
            raise
        print("[rayslice] the program wrote its result before the notice's signal ended it: it has finished",
              flush=True)
        result = written[0]
    return result, notice_report(notice)


def notice_report(notice: notices.CommandNotice) -> dict[str, float]:
    """What a host tells the driver of its program and the notice: when the notice's signal was sent to it."""
    return {} if notice.signalled_at is None else {NOTICE_HEARD_KEY: notice.signalled_at}


@dataclass(frozen=True)
class Attempt:
    """One gang attempt of a step: which whole-gang retry it is, and the step's checkpoint folder."""

    preemption_attempt: int = 0
    checkpoint_dir: str | None = None
    hang_watch: str = ""  # the key prefix simulated hosts publish their idleness under ("": not watched)
    hang_interval: float = 0.0
    notice_key: str = ""  # where the driver publishes a preemption notice for this attempt ("": none watched)
    phases_key: str = ""  # where each host publishes its phase times as its body starts ("": not recorded)


@contextmanager
def _step_folder(spec: StepSpec) -> Iterator[None]:
    """The step runs in its `working_dir`, else in a folder of its own, removed after it (not the raylet's).

    A host process started without a runtime env starts where the raylet runs, shared by every step on
    the node; one with a runtime env but no `working_dir` also does. A host killed mid-step (a peer
    failed, a timeout, a suspension) leaves its folder: the next step on the node removes those of
    processes no longer alive. What is still writing into it when the step ends never fails the step.
    """
    if (spec.runtime_env or {}).get("working_dir"):  # Ray started the process in it
        yield
        return
    _remove_folders_of_ended_hosts()
    before = os.getcwd()
    with tempfile.TemporaryDirectory(prefix=f"{STEP_FOLDER_PREFIX}{os.getpid()}-", ignore_cleanup_errors=True) \
            as folder:
        os.chdir(folder)
        try:
            yield
        finally:
            os.chdir(before)


#: A step's own folder, under the host's temporary folder: the prefix, then the host process's pid.
STEP_FOLDER_PREFIX = "rayslice-step-"


def _remove_folders_of_ended_hosts() -> None:
    import shutil

    root = tempfile.gettempdir()
    for name in os.listdir(root):
        pid = name.removeprefix(STEP_FOLDER_PREFIX).split("-", 1)[0]
        if name.startswith(STEP_FOLDER_PREFIX) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _listening(attempt: Attempt, deliver: Any, withdraw: Any = None) -> Any:
    """While the step runs: hear the attempt's preemption notice (or offer to grow), if the driver watches."""
    return notices.HostListener(attempt.notice_key, deliver, withdraw=withdraw) if attempt.notice_key \
        else nullcontext()


def _leave_jax_group() -> None:
    """Leave the JAX group cleanly (a barrier with the peers) so killing the process later is quiet."""
    jax = sys.modules.get("jax")
    if jax is not None and jax.process_count() > 1:
        jax.distributed.shutdown()


def _over_user_env(spec: StepSpec, plan: HostPlan, ours: dict[str, str]) -> dict[str, str]:
    """rayslice's variables over the runtime env's; process 0 says in the task log which it changed."""
    user = (spec.runtime_env or {}).get("env_vars") or {}
    values, notes = host_env.merged(os.environ, ours, user)
    if notes and plan.process_id == 0 and plan.slice_index == 0:
        print(f"[rayslice] runtime_env env_vars: {'; '.join(notes)}", flush=True)
    return values


def load_step(spec: StepSpec) -> Any:
    if spec.callable:
        module, _, name = spec.callable.partition(":")
        return getattr(importlib.import_module(module), name)
    try:
        import cloudpickle
    except ImportError:  # the job ships cloudpickle with the launcher; this is a last resort
        from ray import cloudpickle

    return cloudpickle.loads(base64.b64decode(spec.pickled))


def plan_processes(hosts: list[HostPlan], *, multislice: bool, ports: dict[int, int]) -> list[HostPlan]:
    """Fill in JAX process ids and coordinators: one group per slice, or one for a multislice job.

    `ports` maps a group leader's index in `hosts` to the coordinator port it reserved.
    """
    first_of_slice = {h.slice_index: i for i, h in reversed(list(enumerate(hosts)))}
    per_slice = {h.slice_index: 0 for h in hosts}
    for h in hosts:
        per_slice[h.slice_index] += 1
    megascale = hosts[0].ip
    planned = []
    for host in hosts:
        leader = 0 if multislice else first_of_slice[host.slice_index]
        in_group = len(hosts) if multislice else per_slice[host.slice_index]
        process_id = (host.slice_index * per_slice[host.slice_index] if multislice else 0) + host.worker_id
        planned.append(
            replace(
                host,
                process_id=process_id,
                num_processes=in_group,
                coordinator=f"{hosts[leader].ip}:{ports.get(leader, 0)}",
                megascale_coordinator=megascale,
            )
        )
    return planned


def group_leaders(hosts: list[HostPlan], *, multislice: bool) -> list[int]:
    if multislice:
        return [0]
    return sorted({h.slice_index: i for i, h in reversed(list(enumerate(hosts)))}.values())


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
                results[index], reports[index] = _get(ready[0], plans[index])
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
                    index, error = _coordinator_first(index, exc, pending, refs, plans)
                    raise error from None
                if getattr(exc, "program_ended_at", None) is not None:  # a command step's program failed
                    index, error = _first_program_to_end(index, exc, pending, refs, plans)
                    raise error from None
                if not _may_be_a_peers_death(exc):
                    raise
                # A peer killed mid-collective makes the survivors' collectives fail first: blame the dead host.
                lost = _lost_peer(pending, refs, plans)
                if lost is None:
                    raise
                index, error = _coordinator_first(*lost, pending, refs, plans)
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
                _get(ref, plans[refs[ref]])
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
    node is gone (`_with_node`): its node and slice ride on the error too, so the resumption avoids them.
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
    hosts = "; ".join(f"{_where(plan)} in {where[plan.label]}" for plan in running)
    returned = [_where(plan) for plan in plans if plan not in running]
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
                ports[index] = _get(ref, plans[index])
            if not pending:
                break
            dead = _dead_nodes({plans[refs[ref]].node_id for ref in pending})
            for ref in pending:
                index = refs[ref]
                if plans[index].node_id in dead:
                    plan = plans[index]
                    lost = _with_node(PreemptedError(
                        f"host {_where(plan)} was lost before the step started: its node was preempted or removed",
                        slice_index=plan.slice_index, worker_id=plan.worker_id, host=plan.ip,
                        cause="its node was preempted or removed",
                    ), plan)
                    if watch is not None and watch.notice is not None and not watch.notice.grow:
                        # the noticed node went: a suspension (budgets renewed), avoiding the lost node's slice
                        kill(actors)
                        raise _suspension(watch, plans, stopped=False, lost=lost, how=(
                            f"its hosts were still starting when {_where(plan)}'s node went")) from None
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
            raise _with_node(PreemptedError(
                f"host {_where(plan)} was lost before the step started: its node does not answer",
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


def _with_node(error: PreemptedError, plan: HostPlan) -> PreemptedError:
    """The lost host's node and slice ride on the error: the retry avoids them while the GCS still shows them."""
    error.node_id = plan.node_id
    error.slice_name = plan.slice_name
    return error


def _lost_host(exc: HostLostError, index: int, actors: list[Any], plans: list[HostPlan]) -> HostLostError:
    """Cancel the rest of the gang at once, then tell a preempted node from a process that died on a live one."""
    kill([actor for i, actor in enumerate(actors) if i != index])  # the lost actor's record tells its node's fate
    preempted = isinstance(exc, PreemptedError) or _node_died(plans[index].node_id, actors[index])
    kill([actors[index]])
    if not preempted:
        return exc
    return _with_node(PreemptedError(
        str(exc).replace("its process died", "its node was preempted or removed"),
        slice_index=exc.slice_index,
        worker_id=exc.worker_id,
        host=exc.host,
        cause="its node was preempted or removed",
    ), plans[index])


def _dead_nodes(node_ids: set[str]) -> set[str]:
    """Which of these nodes the GCS has declared dead (or no longer knows)."""
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    return {node_id for node_id in node_ids if node_id and node_id not in alive}


def _may_be_a_peers_death(exc: StepFailedError) -> bool:
    """A failure inside JAX's runtime (a collective, the coordination service) may be a peer's death.

    Only those are worth waiting up to PEER_DEATH_WINDOW_S for Ray to name a dead host; the
    step's own exceptions (a ValueError in user code) fail the gang at once.
    """
    cause = exc.cause or ""
    return cause.startswith(RUNTIME_ERRORS) or any(sign in cause for sign in PEER_LOSS_SIGNS)


def _lost_peer(
    pending: list[Any], refs: dict[Any, int], plans: list[HostPlan], within: float = PEER_DEATH_WINDOW_S
) -> tuple[int, HostLostError] | None:
    """The host whose process or node died, if Ray reports one within `within` seconds."""
    deadline = time.monotonic() + within
    pending = list(pending)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        index = refs[ready[0]]
        try:
            _get(ready[0], plans[index])
        except HostLostError as exc:
            return index, exc
        except StepFailedError:
            continue
    return None


def _first_program_to_end(index: int, error: StepFailedError, pending: list[Any], refs: dict[Any, int],
                          plans: list[HostPlan], within: float = PROGRAM_END_WINDOW_S) -> tuple[int, StepFailedError]:
    """The host whose program failed first: the cause, not a peer whose collective it broke.

    A program that ends breaks its peers' collectives, and their programs then fail too (exit 1,
    "Connection reset by peer" in their last lines); on a loaded machine such a failure can reach
    the driver first. A failure whose last lines read like a lost peer waits up to `within` for
    the others: one that does not read so wins, then the program that ended first (each failure
    carries when its program ended). A host lost in that window (its process or node died) is the
    cause instead. A failure that reads like the program's own is named at once.
    """
    first = (index, error)
    deadline = time.monotonic() + within
    pending = list(pending)
    while pending and _reads_like_a_lost_peer(first[1]):
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        other = refs[ready[0]]
        try:
            _get(ready[0], plans[other])
        except HostLostError as lost:
            return _coordinator_first(other, lost, pending, refs, plans)
        except StepFailedError as failed:
            if getattr(failed, "program_ended_at", None) is not None and _rank(failed) < _rank(first[1]):
                first = (other, failed)
    return first


def _reads_like_a_lost_peer(error: StepFailedError) -> bool:
    return any(sign in (error.cause or "") for sign in PEER_LOSS_SIGNS)


def _rank(error: StepFailedError) -> tuple[bool, float]:
    return _reads_like_a_lost_peer(error), error.program_ended_at


def _coordinator_first(index: int, error: HostLostError, pending: list[Any], refs: dict[Any, int],
                       plans: list[HostPlan], within: float = COORDINATOR_DEATH_WINDOW_S) -> tuple[int, HostLostError]:
    """The lost host to name: its group's coordinator, if that died too, else `index`.

    JAX ends every process of a group whose coordinator process died, and Ray may report one of
    those deaths before the coordinator's own. So a lost host that is not its group's coordinator
    waits up to `within` for the coordinator's outcome; a coordinator lost too is the cause.
    """
    plan = plans[index]
    if plan.process_id == 0 or plan.num_processes <= 1:
        return index, error
    coordinator = [ref for ref in pending
                   if plans[refs[ref]].process_id == 0 and plans[refs[ref]].coordinator == plan.coordinator]
    ready, _ = ray.wait(coordinator, timeout=within) if coordinator else ([], [])
    if not ready:
        return index, error
    try:
        _get(ready[0], plans[refs[ready[0]]])
    except HostLostError as lost:
        message = f"{lost}; {plan.label} ended with it (JAX ends every process of a group whose coordinator died)"
        return refs[ready[0]], type(lost)(message, slice_index=lost.slice_index, worker_id=lost.worker_id,
                                          host=lost.host, cause=lost.cause)
    except StepFailedError:
        pass
    return index, error


def _where(plan: HostPlan) -> str:
    return f"{plan.label} (slice {plan.slice_index}, worker {plan.worker_id}, {plan.ip})"


def _get(ref: Any, plan: HostPlan) -> Any:
    """A host's return value, or the error that names the host and why it failed."""
    where = _where(plan)
    try:
        return ray.get(ref)
    except RayTaskError as exc:
        raised = exc.cause if isinstance(exc.cause, BaseException) else exc
        cause = f"{type(raised).__name__}: {raised}"
        exit_code = ended_at = None
        if isinstance(raised, commands.CommandExitError):  # the program's own failure: its lines, not our stack
            error, message, exit_code = StepFailedError, f"step failed on {where}: {raised}", raised.exit_code
            ended_at = raised.ended_at
        else:
            error, message = StepFailedError, f"step failed on {where}: {cause}\n{_remote_traceback(exc)}"
    except RayActorError as exc:
        exit_code = ended_at = None
        node_lost = node_was_lost(exc)
        cause = "its node was preempted or removed" if node_lost else "its process died"
        error = PreemptedError if node_lost else HostLostError
        message = f"host {where} was lost: {cause} ({_first_line(exc)})"
    failure = error(message, slice_index=plan.slice_index, worker_id=plan.worker_id, host=plan.ip, cause=cause,
                    exit_code=exit_code)
    if ended_at is not None:
        failure.program_ended_at = ended_at  # the driver names the program that ended first (driver-side only)
    raise failure from None


def node_was_lost(exc: BaseException) -> bool:
    """Preemption (the node died or was drained) as opposed to the step's own process dying."""
    text = str(exc).lower()
    return (
        bool(getattr(exc, "preempted", False))
        or "node has died" in text
        or "node died" in text
        or "draining" in text
        or "node was terminated" in text
    )


def _node_died(node_id: str, actor: Any, within: float = NODE_DEATH_WINDOW_S) -> bool:
    """Whether a lost host's node is gone, as far as the GCS or its raylet can tell within `within` seconds.

    A killed node first surfaces as an unreachable actor ("Socket closed"); the GCS marks the
    node dead only after its health checks fail (~10 s), so a raylet that accepts no connection
    twice in a row is taken as the node's loss at once. A process that died on a live node is
    reported dead by its raylet at once, so that case returns quickly.
    """
    if not node_id:
        return False
    actor_id = actor._actor_id.hex()
    deadline = time.monotonic() + within
    unreachable = 0
    while True:
        actor_info = ray._private.state.state.actor_table(actor_id)
        node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
        if node is None or not node["Alive"] or "node has died" in str(actor_info.get("DeathCause", "")):
            return True
        if actor_info.get("State") == "DEAD" or time.monotonic() > deadline:
            return False  # the process died on a node that is still alive
        unreachable = unreachable + 1 if node_probe.raylet_unreachable(node_id) else 0
        if unreachable >= 2:
            return True
        time.sleep(0.2)


def _remote_traceback(exc: RayTaskError) -> str:
    text = str(exc)
    return text if "Traceback" in text else "".join(traceback.format_exception(exc))


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(exc).__name__


class LogDrain:
    """Sees the hosts' output arrive in this driver's log, so the driver's own last line comes after it.

    Ray forwards host output to the driver asynchronously (each node's log monitor tails the
    processes' files); a driver that printed its result and exited at once could lose a host's
    final lines, and after a failure those are the lines a user needs. Only where this driver
    prints host output.
    """

    #: The longest a drain waits, on success or failure. It runs after the release (no chip waits on it)
    #: and ends as soon as every host's last line is in; a loaded node's log monitor can lag for seconds.
    TIMEOUT_S = 15.0
    #: After a failure, how long host output must have been quiet: a killed host prints no last line.
    QUIET_S = 1.0

    def __init__(self) -> None:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        self._dispatcher = dispatcher
        try:  # made once capacity is reserved: a Ray whose dispatcher differs must not cost the step
            self.active = any(pair[0] == "ray_print_logs" for pair in dispatcher.handlers
                              if isinstance(pair, tuple) and len(pair) == 2)
        except Exception:
            self.active = False
        self._done: set[str] = set()
        self._seen = threading.Condition()
        self._last_line = 0.0
        self._name = f"rayslice-drain-{id(self)}"
        self._explainers: list[shutdown_noise.Explainer] = []
        if self.active:
            dispatcher.add_handler(self._name, self._handle)

    def explain_shutdown(self, labels: set[str], noticed: Any) -> None:
        """Until `close`: these hosts' JAX termination after `noticed()` is explained, not shown as fatal."""
        if self.active:
            self._explainers.append(shutdown_noise.Explainer(self._dispatcher, labels, noticed))

    def _handle(self, data: dict) -> None:
        with self._seen:
            self._last_line = time.monotonic()
            for line in data.get("lines", ()):
                if line.startswith(HOST_DONE_MARKER):
                    self._done.add(line[len(HOST_DONE_MARKER):].strip())
            self._seen.notify_all()

    def wait(self, labels: list[str], *, quiet: float = 0.0) -> None:
        """Until every host in `labels` printed its last line and host output was quiet for `quiet` s; bounded.

        On success every host prints a last line. After a failure, the hosts that raised did
        (`HostProcess.run` prints it on the way out), and the ones that died or were killed
        did not: for those, `quiet` seconds without a line (counted from this call) stand for it.
        """
        if not self.active:
            return
        start = time.monotonic()
        deadline = start + self.TIMEOUT_S
        with self._seen:
            while True:
                now = time.monotonic()
                quiet_at = max(start, self._last_line) + quiet
                if now >= deadline or (self._done.issuperset(labels) and now >= quiet_at):
                    return
                self._seen.wait(min(deadline, quiet_at if self._done.issuperset(labels) else deadline) - now)

    def close(self) -> None:
        if self.active:
            self._dispatcher.remove_handler(self._name)
        for explainer in self._explainers:
            explainer.close()


def raised_on(exc: BaseException, plans: list[HostPlan]) -> list[str]:
    """The label of the host whose step raised `exc` (it printed its last line), if one did."""
    if not isinstance(exc, StepFailedError) or isinstance(exc, HostLostError):
        return []
    return [plan.label for plan in plans if (plan.slice_index, plan.worker_id) == (exc.slice_index, exc.worker_id)]


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
