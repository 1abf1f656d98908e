"""The step's process on one host (a Ray actor), as the gang's driver starts and calls it.

Kept apart from the driver's loop (gang.py) because it runs in another process: Ray loads this
module (and with it the rayslice.cluster package) to build every host actor, so what they import
is what each host pays for at start-up (bench/startup_imports.py measures it). It prepares while
the gang is planned, runs the step (a function, or a command step's program under its preemption
notice), reports its phase times, and leaves its JAX group once every host has returned.
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
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import ray

from rayslice.cluster import commands, environments, hang_watch, host_env, notices, phases
from rayslice.cluster.environments import HostPlan
from rayslice.cluster.step_folders import step_folder
from rayslice.core import goodput
from rayslice.core.context import NOTICE_FILE_ENV, StepContext, deliver_notice, set_step_context, withdraw_offer
from rayslice.core.step import HOST_DONE_MARKER, StepSpec

#: How long a host that ends waits for its phase times to be published (phases.publish), at most.
PUBLISH_WAIT_S = 5.0
#: A host report's key: when the notice's signal was sent to the command step's running program (absent: it
#: never was: it ended before, the notice was held back, or `notice_signal="none"`).
NOTICE_HEARD_KEY = "notice_heard"


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
            with step_folder(spec), \
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
