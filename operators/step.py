"""The shared flow of every step operator: validate, submit once, follow or defer, return the result.

Subclasses only say what capacity they want (`build_request`). Everything else is here:

- literal request arguments are validated in ``__init__`` (so a bad ``tpu`` fails the DAG
  import), templated ones right after rendering, before anything is submitted;
- the Ray submission id holds the try's task-instance id (new for every try in Airflow 3): the
  same try run again (a resumed deferral, a restarted worker) reattaches to its job, anything
  else submits afresh; a new try first stops every earlier try's job that still runs, of this
  Airflow deployment only (`RayHook.deployment`: each job's metadata names it);
- the id goes to XCom before any waiting, for ``on_kill`` and the "Ray job" link;
- the job's log is relayed line by line to the task log (by the trigger when deferred);
- a deferrable step (the default) starts in the triggerer (`rayslice.operators.start_trigger`): no
  worker process unless it fails or cannot be built there; the worker path below is the fallback
  and the blocking mode (``deferrable=False``).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import pickle
import re
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.bases.operator import TRIGGER_FAIL_REPR
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowTaskTimeout
from rayslice.hooks.ray import ClusterSetSettings, RayConnectionSettings, RayHook
from rayslice.operators import metrics
from rayslice.operators.links import CLUSTER_KEY, SUBMISSION_ID_KEY, RayJobLink, job_link
from rayslice.operators.start_trigger import (
    START_ON_WORKER,
    STEP_ARGUMENTS,
    CannotStart,
    encode_refs,
    ship_function,
    start_trigger_args,
)
from rayslice.operators.templating import is_templated  # also importable from here, as it always was
from rayslice.operators.triggers import EXECUTION_TIMEOUT, RayStepTrigger

from rayslice.client.cluster_set import Member, run_on_set, spec_for_set
from rayslice.client.jobs_client import AsyncRayJobsClient
from rayslice.client.submission import LogFollower, running_earlier_tries, submission_id, submit_step, wait_for_step
from rayslice.cloud import cluster_names
from rayslice.core import runtime_env as runtime_envs
from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.cluster_claim import end_chain, end_other_chains
from rayslice.core.context import checkpoint_dir_for
from rayslice.core.exceptions import InvalidRequestError, JobNotFoundError, RaysliceError, error_fields
from rayslice.core.queue import TEAM_PATTERN, team_for
from rayslice.core.step import (
    CHECKPOINT_ROOT_FORMS,
    PREEMPTIBLE_NEEDS_RETRIES,
    Owner,
    StepSpec,
    checkpoint_root_problem,
    notice_signal_name,
    split_command,
    split_templated_command,
    warn_entrypoint,
)

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = ["RayStepOperator", "is_templated"]

#: A task a worker deferred resumes no sooner than this after deferring (Airflow's scheduler race,
#: apache/airflow#67287 / #72716; see `min_deferral`). Steps started in the triggerer never wait it.
MIN_DEFERRAL_S = 15.0
#: How long a new try waits for the earlier tries' stopped jobs to end before giving up.
PREVIOUS_TRY_STOP_TIMEOUT_S = 120.0
#: Per attempt of a step, on top of capacity_timeout + step_timeout: the hosts' start (the launcher waits
#: up to 300 s for them) and the job's own start and end.
ATTEMPT_MARGIN_S = 600.0
#: Airflow's own timeout of a deferral comes this long after the trigger's deadline: the trigger stops
#: the job at its deadline and reports; Airflow's timeout only catches a trigger that could not.
DEFERRAL_BACKSTOP_S = 300.0


def _run_coroutine(coroutine: Any) -> Any:
    """asyncio.run, also from a thread that already runs a loop (e.g. `dag.test()` in a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1, thread_name_prefix="rayslice") as pool:
        return pool.submit(asyncio.run, coroutine).result()


#: Failures no retry can fix: the request is invalid, no node could ever hold it, or the submission
#: id is another submitter's. They fail the task at once, whatever its `retries`.
NOT_RETRIED = frozenset({"InvalidRequestError", "UnsatisfiableRequestError", "SubmissionConflictError"})


class RayStepFailed(AirflowException):
    """A step failed: the message, and where (the launcher's structured fields), for callbacks to read.

    ``error_type`` (rayslice's error class name), ``submission_id``, and when the failure says them
    ``slice_index``, ``worker_id``, ``host``, ``cause``, ``exit_code`` (a command step's); else None.
    """

    def __init__(self, message: str, *, error_type: str, submission_id: str, slice_index: int | None = None,
                 worker_id: int | None = None, host: str | None = None, cause: str | None = None,
                 exit_code: int | None = None) -> None:
        super().__init__(message)
        self.error_type, self.submission_id = error_type, submission_id
        self.slice_index, self.worker_id, self.host, self.cause, self.exit_code = (
            slice_index, worker_id, host, cause, exit_code)


class RayStepFailedForGood(RayStepFailed, AirflowFailException):
    """A failure no retry can fix (``NOT_RETRIED``): Airflow fails the task without retrying it."""


def _executor_can_race() -> bool:
    """Whether an executor runs this task in a process of its own, whose exit can race the trigger (`min_deferral`).

    The race (apache/airflow#67287) is the scheduler reading the deferring worker's exit report after
    the resumed task started. `dag.test()` runs the task in the calling process through the Task SDK's
    in-process supervisor, with no executor and no exit report: nothing to wait for, so a step ended
    there resumes its task at once instead of `min_deferral` (15 s) later.
    """
    try:
        from airflow.sdk.execution_time import task_runner
        from airflow.sdk.execution_time.supervisor import InProcessSupervisorComms
    except ImportError:  # another Task SDK layout: keep the wait
        return True
    return not isinstance(getattr(task_runner, "SUPERVISOR_COMMS", None), InProcessSupervisorComms)


class RayStepOperator(BaseOperator):
    """Run one step (a function or a program) on Ray capacity and return its result as the task's XCom.

    :param python_callable: a function, shipped by value with its DAG file's helpers (and the
        modules of its DAGs folder that the DAG file imports).
    :param callable: or ``"package.module:function"`` importable on the cluster (templated).
    :param command: or a program: an argv list (a string is split like a shell would, before its
        ``{{ ... }}`` values are rendered, so a value stays one argument), run on every
        host from the runtime env's ``working_dir``; ``jax.distributed.initialize()`` finds its peers
        by itself. Its XCom item per host is the JSON it writes to ``$RAYSLICE_RESULT_FILE``, else None
        (templated).
    :param entrypoint: the old name of ``callable`` (deprecated).
    :param runtime_env: Ray's runtime_env for every host process of the step: ``working_dir``,
        ``py_modules`` (local folders are uploaded once per content), ``pip``/``uv``, ``env_vars``,
        ``excludes``, ``image_uri``/``container``, ``config`` (templated; merged over the connection's
        ``runtime_env`` extra).
    :param op_kwargs: keyword arguments for the function; must be JSON (templated). Not with ``command=``
        (refused at parse time): a program gets its values as argv or ``runtime_env`` ``env_vars``.
    :param ray_conn_id: the `ray` connection (the Ray dashboard URL and token).
    :param kuberay_cluster: the RayCluster to run on instead of the one the connection's ``kuberay`` extra
        names (same namespace and API server; templated). ``"per-run"``: the DAG run's own, as
        ``CreateRayClusterOperator(name="per-run")`` made it, so runs of one DAG may overlap.
    :param capacity_timeout: seconds to wait for free capacity before failing, counted from the moment the
        step takes its place in the cluster's admission queue.
    :param priority: the step's rank in the cluster's admission queue (higher first); by default the task's
        Airflow ``priority_weight``.
    :param team: narrows the team the step counts against (the cluster's quotas) below its connection's
        ``team`` extra, e.g. ``research/vision`` on a ``research`` connection; never another team. None:
        the connection's team (docs/security.md).
    :param step_timeout: seconds the step may run once started (None: no limit). On real TPUs this is what
        ends a hung step (a collective that a host never joins).
    :param hang_timeout: simulated cluster only: fail the step (``CollectiveHangError``) once every host
        process has sat idle inside JAX this many seconds, and release its slice (None: never; default 300).
    :param preemption_retries: times the whole gang is retried on a fresh slice when a host's node is
        lost (preemption), separately from Airflow's ``retries`` (which also cover the step's own errors).
    :param preemptible: where the cluster's queue policy says ``preemption: lower-priority``, a waiting step
        of higher priority may suspend this one (a preemption notice: it checkpoints, and resumes later in
        the same try, within ``preemption_retries``).
    :param notice_signal: a command step: the signal its program gets on a preemption notice (default
        ``"SIGTERM"``; ``"none"``: the ``$RAYSLICE_NOTICE_FILE`` only).
    :param checkpoint_root: root URL of the step's checkpoint folder (``gs://…``, ``s3://…``, ``file://…``;
        templated); else the `ray` connection's ``checkpoint_root`` extra, else the cluster's
        ``RAYSLICE_CHECKPOINT_ROOT``. The step finds its folder in ``rayslice.get_step_context()``.
    :param deferrable: (default True) start, wait and end in the triggerer: a step that succeeds costs no
        Airflow worker process. A step that cannot be built there (see ``start_blocker``) submits from a
        worker and then waits in the triggerer. False: a worker submits and waits (blocking).
    :param poll_interval: seconds between polls of the job's status (its log is streamed as it is written).
    :param min_deferral: only for a step a worker deferred (the fallback path): the task resumes no sooner
        than this many seconds after it deferred, even if the step ended earlier. Airflow's scheduler
        (3.3.2 and earlier) fails a task that resumes before it has seen the deferring worker's exit
        (apache/airflow#67287, #72716). A step started in the triggerer has no deferring worker and never
        waits, nor does one run by ``dag.test()`` (no executor). Capacity is released when the step ends
        either way; 0 turns the wait off.
    :param shipped_callable: set by rayslice (the decorators, or ``python_callable=``): the function pickled
        at parse time, for the triggerer.
    """

    template_fields: Sequence[str] = ("callable", "command", "op_kwargs", "checkpoint_root", "runtime_env",
                                      "kuberay_cluster")
    template_fields_renderers = {"op_kwargs": "py", "runtime_env": "json"}
    operator_extra_links = (RayJobLink(),)
    ui_color = "#e3f2fd"
    #: The attributes `build_request` reads; validated at parse time when none is templated.
    request_fields: Sequence[str] = ()
    #: Airflow 3.3: start in the triggerer. A mapped task takes these class values (its trigger rebuilds
    #: the step from the serialized task); an unmapped one sets its own in `plan_trigger_start`.
    start_from_trigger = True
    start_trigger_args = start_trigger_args()
    #: Why this (unmapped) task starts on a worker, when it is deferrable and does; None: it starts in the triggerer.
    start_blocker: str | None = None

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any] | None = None,
        callable: str | None = None,
        command: str | Sequence[str] | None = None,
        entrypoint: str | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        ray_conn_id: str = RayHook.default_conn_name,
        kuberay_cluster: str | None = None,
        capacity_timeout: float = 600,
        priority: int | None = None,
        team: str | None = None,
        step_timeout: float | None = None,
        hang_timeout: float | None = 300,
        preemption_retries: int = 0,
        preemptible: bool = False,
        notice_signal: str = "SIGTERM",
        checkpoint_root: str | None = None,
        deferrable: bool = True,
        poll_interval: float = 2,
        min_deferral: float = MIN_DEFERRAL_S,
        shipped_callable: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if entrypoint is not None:
            warn_entrypoint(type(self).__name__)
            if callable is not None:
                raise InvalidRequestError(f"{self.task_id!r}: give callable= only (entrypoint= is its old name)")
            callable = entrypoint
        given = [name for name, value in (("python_callable", python_callable), ("callable", callable),
                                          ("command", command)) if value is not None]
        if len(given) != 1:
            raise InvalidRequestError(
                f"{type(self).__name__} {self.task_id!r} needs exactly one of python_callable=<function>, "
                "callable='package.module:function' or command=['python', 'train.py', ...]"
                + (f"; got {' and '.join(given)}" if given else "")
            )
        if python_callable is not None and not builtins.callable(python_callable):
            raise InvalidRequestError(
                f"python_callable of {self.task_id!r} is not callable: {python_callable!r}"
            )
        if isinstance(callable, str) and not is_templated(callable) and ":" not in callable:
            raise InvalidRequestError(
                f"callable {callable!r} of {self.task_id!r} must look like 'package.module:function'"
            )
        if isinstance(command, str):  # split now, render each argument: a value cannot add arguments
            command = split_templated_command(command)
        elif command is not None and not is_templated(command) and not any(is_templated(a) for a in command):
            command = split_command(list(command))
        if command is not None and (is_templated(op_kwargs) or op_kwargs):
            raise InvalidRequestError(
                f"op_kwargs of {self.task_id!r} cannot go with command=: a program takes no keyword arguments; "
                "pass the values as arguments in command=[...] or as runtime_env={'env_vars': {...}}"
            )
        runtime_envs.validate(runtime_env, f"runtime_env of {self.task_id!r}")
        if isinstance(min_deferral, bool) or not isinstance(min_deferral, (int, float)) or not min_deferral >= 0:
            raise InvalidRequestError(
                f"min_deferral of {self.task_id!r} must be a number of seconds >= 0, got {min_deferral!r}"
            )
        if hang_timeout is not None and (
            isinstance(hang_timeout, bool) or not isinstance(hang_timeout, (int, float)) or not hang_timeout > 0
        ):
            raise InvalidRequestError(
                f"hang_timeout of {self.task_id!r} must be a number of seconds > 0 or None, got {hang_timeout!r}"
            )
        if isinstance(preemption_retries, bool) or not isinstance(preemption_retries, int) or preemption_retries < 0:
            raise InvalidRequestError(
                f"preemption_retries of {self.task_id!r} must be a whole number >= 0, got {preemption_retries!r}"
            )
        if not isinstance(preemptible, bool):
            raise InvalidRequestError(f"preemptible of {self.task_id!r} must be True or False, got {preemptible!r}")
        if preemptible and preemption_retries < 1:
            raise InvalidRequestError(f"{PREEMPTIBLE_NEEDS_RETRIES} (task {self.task_id!r})")
        try:
            notice_signal = notice_signal_name(notice_signal)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{exc} (task {self.task_id!r})") from None
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
            raise InvalidRequestError(f"priority of {self.task_id!r} must be a whole number, got {priority!r}")
        if team is not None and (not isinstance(team, str) or not 0 < len(team) <= 64
                                 or not re.fullmatch(TEAM_PATTERN, team)):
            raise InvalidRequestError(f"team of {self.task_id!r} must be a name of 1 to 64 letters, digits, '.', '_', "
                                      f"'-' (parts joined by '/'), got {team!r}")
        if kuberay_cluster is not None and not is_templated(kuberay_cluster):
            cluster_names.check_name(kuberay_cluster, f"kuberay_cluster of {self.task_id!r}")
        self.kuberay_cluster = kuberay_cluster
        self.priority = priority
        self.team = team
        self.callable = callable
        self.command = command
        self.runtime_env = None if runtime_env is None else dict(runtime_env)
        self.python_callable = python_callable
        self.op_kwargs = dict(op_kwargs or {})
        self.ray_conn_id = ray_conn_id
        self.capacity_timeout = capacity_timeout
        self.step_timeout = step_timeout
        self.hang_timeout = hang_timeout
        self.preemption_retries = preemption_retries
        self.preemptible = preemptible
        self.notice_signal = notice_signal
        self.checkpoint_root = checkpoint_root
        self._check_checkpoint_root(checkpoint_root)
        self.deferrable = deferrable
        self.poll_interval = poll_interval
        self.min_deferral = float(min_deferral)
        if shipped_callable is None and python_callable is not None and deferrable:
            try:
                shipped_callable = ship_function(python_callable)
            except CannotStart as exc:
                shipped_callable = {"cannot_start": str(exc)}
        self.shipped_callable = None if shipped_callable is None else dict(shipped_callable)
        self._in_triggerer = False
        self._submission_id: str | None = None
        self._settings: RayConnectionSettings | None = None
        self._cluster: str | None = None  # `kuberay_cluster` resolved for this run (never "per-run")
        self._cluster_owner: str | None = None  # for "per-run": the owner mark the run's cluster must carry
        self._set: ClusterSetSettings | None = None  # the connection is a cluster set: its members
        self._members: dict[str, RayConnectionSettings] = {}  # the set's members that resolved, in its order
        self._ran_on: str | None = None  # a set's step: the member that runs (ran) it, once one claimed it
        self._set_folder: str | None = None  # a set's step: its checkpoint folder (its claims live there)
        self._ti: Any = None  # the running try (a set's step pushes which member runs it as that changes)

    @property
    def entrypoint(self) -> str | None:
        """The old name of `callable`."""
        return self.callable

    # ---- what subclasses provide

    @staticmethod
    def make_request(**fields: Any) -> TpuSliceRequest | AcceleratorRequest:
        """The request from the operator's arguments; raises InvalidRequestError when invalid."""
        raise NotImplementedError("RayStepOperator subclasses implement make_request()")

    def build_request(self) -> TpuSliceRequest | AcceleratorRequest:
        return self.make_request(**{name: getattr(self, name) for name in self.request_fields})

    def plan_trigger_start(self) -> None:
        """Whether this task starts in the triggerer, and with what (subclasses call it last in `__init__`)."""
        reason, step = None, None
        if not self.deferrable:
            reason = "deferrable=False"
        elif self.shipped_callable and "cannot_start" in self.shipped_callable:
            reason = str(self.shipped_callable["cannot_start"])
        elif self.get_closest_mapped_task_group() is not None:
            # Each group index reads its share of the group's input and its upstreams' XComs by the Task
            # SDK's map-index rules (`XComArg.resolve`); the triggerer does not rebuild those.
            reason = "the step is in a mapped task group"
        else:
            names = [*STEP_ARGUMENTS, *self.request_fields, *(("op_args",) if hasattr(self, "op_args") else ())]
            try:
                step = {name: encode_refs(getattr(self, name, None)) for name in names}
            except CannotStart as exc:
                reason = str(exc)
        self.start_blocker = reason
        self.start_from_trigger = reason is None
        self.start_trigger_args = start_trigger_args(step) if reason is None else None

    def validate_literal_request(self) -> None:
        """Build the request now (DAG parse time) unless some of its arguments are templated."""
        if not any(is_templated(getattr(self, name)) for name in self.request_fields):
            self.build_request()

    def step_kwargs(self, context: Context) -> dict[str, Any]:
        """The function's keyword arguments, as shipped to the cluster."""
        return dict(self.op_kwargs)

    # ---- the flow

    def execute(self, context: Context) -> Any:
        started = time.time()  # Airflow's execution_timeout counts from here, too
        hook = RayHook(self.ray_conn_id)
        try:
            request = self.build_request()  # the rendered values, before anything is submitted
            if note := getattr(request, "programs_note", None):
                self.log.info("[rayslice] %s", note)
            self._check_zone_offers(hook, request)
            self._set = hook.cluster_set()
            deployment = hook.deployment()
            if note := self.setup_mismatch():  # once, as the step starts (not again as it resumes or is killed)
                self.log.warning("[rayslice] %s", note)
            if self._set is not None:
                self._settings = self._set_members()
            else:
                self._settings = self.cluster_hook(context, deployment).settings()
            self._check_checkpoint_root(self.checkpoint_root)
        except InvalidRequestError as exc:
            raise AirflowFailException(f"{self.task_id}: {exc}") from None
        if self.deferrable and self.start_blocker:
            self.log.info("[rayslice] submitting from a worker, not the triggerer: %s", self.start_blocker)
        owner = self._owner(context, deployment)
        spec = self._spec(request, owner, context)
        self._submission_id = sid = owner.submission_id
        context["ti"].xcom_push(key=SUBMISSION_ID_KEY, value=sid)
        self._ti = context["ti"]
        try:
            result = _run_coroutine(self._submit_and_follow(spec))
        except RaysliceError as exc:  # logged once, by Airflow, as the task's exception
            raise self._failure(type(exc).__name__, str(exc), error_fields(exc)) from None
        if self.deferrable and self._set is None:  # a set's step was followed here, to its end
            # Airflow 3 does not time deferred tasks out: the trigger stops the job at the deadline.
            limit, reason = self.deferral_limit()
            deadline = None if limit is None else started + limit
            metrics.deferred("worker")
            wait = self.min_deferral if _executor_can_race() else 0.0
            self.defer(
                trigger=RayStepTrigger(ray_conn_id=self.ray_conn_id, kuberay_cluster=self._cluster,
                                       kuberay_owner=self._cluster_owner, submission_id=sid,
                                       poll_interval=self.poll_interval, deadline=deadline, deadline_reason=reason,
                                       resume_not_before=time.time() + wait),
                method_name="execute_complete",
                timeout=None if deadline is None else timedelta(
                    seconds=max(deadline - time.time(), self.min_deferral) + DEFERRAL_BACKSTOP_S),
            )
        return result

    def _set_members(self) -> RayConnectionSettings:
        """Resolve the set's member connections (one that does not resolve is skipped, in the log); the first's
        settings, with the set's checkpoint root, give the step its defaults (team, runtime_env)."""
        clusters = self._set
        assert clusters is not None
        if self.kuberay_cluster not in (None, ""):
            raise InvalidRequestError(f"kuberay_cluster={self.kuberay_cluster!r} names one RayCluster, but "
                                      f"{self.ray_conn_id!r} is a cluster set: drop one of them")
        for name in clusters.members:
            try:
                self._members[name] = RayHook(name).settings()
            except RaysliceError as exc:
                self.log.warning("[rayslice] cluster %s skipped: its connection does not resolve (%s)", name, exc)
            except Exception as exc:  # no such connection: Airflow's own error
                self.log.warning("[rayslice] cluster %s skipped: %s: %s", name, type(exc).__name__, exc)
        if not self._members:
            raise InvalidRequestError(f"no member connection of the cluster set {self.ray_conn_id!r} resolves "
                                      f"({', '.join(clusters.members)}): the lines above say why")
        first = next(iter(self._members.values()))
        return dataclasses.replace(first, checkpoint_root=clusters.checkpoint_root)

    async def _run_on_set(self, spec: StepSpec) -> Any:
        """Submit to every member at once, follow them all, return the result of the one that ran the step."""
        clusters = self._set
        assert clusters is not None
        try:
            spec = spec_for_set(spec, clusters.name, clusters.members, shared_root=clusters.shared_root)
        except InvalidRequestError as exc:
            raise AirflowFailException(f"{self.task_id}: {exc}") from None
        async with contextlib.AsyncExitStack() as stack:
            members = []
            unreachable: set[str] = set()
            for name, settings in self._members.items():
                client = await stack.enter_async_context(settings.async_client())
                if spec.owner.try_number > 1:
                    try:
                        await self._stop_earlier_tries(client, spec.owner)
                    except RaysliceError as exc:  # its earlier job, if any, is kept from running by its claims
                        unreachable.add(name)
                        self.log.warning("[rayslice] cluster %s: could not stop the earlier tries' jobs there (%s)",
                                         name, exc)
                members.append(Member(name, client, launcher=settings.launcher))
            self._set_folder = checkpoint_dir_for(spec.checkpoint_root, spec.owner)
            if spec.owner.try_number > 1:
                # A member whose connection did not resolve was not reached either: its earlier job is not stopped.
                unreachable |= set(clusters.members) - set(self._members)
                await self._end_earlier_chains(spec, unreachable)
            sid = spec.owner.submission_id or ""
            self.log.info("[rayslice] on cluster set %s: %s, in that order of preference (Ray job %s on each)",
                          clusters.name, ", ".join(self._members), sid)
            self._push_link(job_link(sid, self.ray_conn_id))  # until a cluster claims it: the route picks the member
            waiting, outcome = time.monotonic(), "error"
            try:
                result = await run_on_set(spec, members, emit=self.log.info, on_cluster=self._cluster_runs)
                outcome = "success"
                return result
            finally:
                metrics.waited(time.monotonic() - waiting, where="worker", outcome=outcome)
                if self._ran_on:  # the try's last word on where it ran (the standbys' lines come before)
                    self.log.info("[rayslice] Ray job %s %s on cluster %s of set %s: %s", sid,
                                  "ran" if outcome == "success" else "ran (and failed)", self._ran_on, clusters.name,
                                  job_link(sid, self._ran_on))

    def _cluster_runs(self, name: str) -> None:
        """A cluster of the set claimed the step (or took it over, or ran it): the task's XCom and its "Ray job"
        link name that member from now on (`rayslice.operators.links`)."""
        sid = self._submission_id or ""
        moved = self._ran_on is not None
        self._ran_on = name
        self.log.info("[rayslice] %s cluster %s: Ray job %s there: %s", "the step moved to" if moved else
                      "the step runs on", name, sid, job_link(sid, name))
        if self._ti is not None:
            self._ti.xcom_push(key=CLUSTER_KEY, value={"submission_id": sid, "cluster": name})
        self._push_link(job_link(sid, name))

    def _push_link(self, link: str) -> None:
        """The "Ray job" link now, not only when the task ends: Airflow reads it from this XCom (the metadata DB's,
        as the Task SDK's `finalize` writes it), and a set's step runs on a worker for its whole length."""
        ti = self._ti
        if ti is None:
            return
        from airflow.sdk import BaseXCom

        try:
            BaseXCom.set(RayJobLink().xcom_key, link, dag_id=ti.dag_id, run_id=ti.run_id, task_id=ti.task_id,
                         map_index=ti.map_index if ti.map_index is not None else -1)
        except Exception as exc:  # the link is worth a line, never the step
            self.log.warning("[rayslice] could not record the Ray job link: %s", exc)

    async def _end_earlier_chains(self, spec: StepSpec, unreachable: set[str] | None = None) -> None:
        """End the earlier tries' claim chains: their jobs on a member this try could not reach never claim later.
        One that holds the step on such a member may still run it: this try fails rather than start beside it."""
        folder = checkpoint_dir_for(spec.checkpoint_root, spec.owner)
        if not folder:
            return
        try:
            ended = await asyncio.to_thread(end_other_chains, folder, spec.owner.submission_id or "",
                                            f"superseded by try {spec.owner.try_number}", frozenset(unreachable or ()))
        except InvalidRequestError as exc:
            raise AirflowException(f"{self.task_id}: {exc}") from None
        except Exception as exc:
            if unreachable:  # blind: an earlier try may hold the step on a member this try could not stop
                raise AirflowException(
                    f"{self.task_id}: could not read the earlier tries' claims in {folder} ({type(exc).__name__}: "
                    f"{exc}), and cluster(s) {', '.join(sorted(unreachable))} could not be reached: an earlier try "
                    "may still run the step there, so this try does not start beside it") from None
            # storage down, every member reached: the earlier tries' jobs were stopped above
            self.log.warning("[rayslice] could not end the earlier tries' claims in %s: %s: %s", folder,
                             type(exc).__name__, exc)
            return
        for sid in ended:
            self.log.info("[rayslice] ended the claims of Ray job %s (an earlier try): its jobs on any cluster of "
                          "the set end without running", sid)

    def cluster_hook(self, context: Context, deployment: str | None = None) -> RayHook:
        """The connection's hook, aimed at ``kuberay_cluster`` as rendered (the run's own for "per-run")."""
        if self.kuberay_cluster not in (None, "") and self._cluster is None:
            if deployment is None and self.kuberay_cluster == cluster_names.PER_RUN:
                deployment = RayHook(self.ray_conn_id).deployment()
            ti = context["ti"]
            self._cluster = cluster_names.resolve_name(self.kuberay_cluster, ti.dag_id, ti.run_id, deployment or "",
                                                       what=f"kuberay_cluster of {self.task_id!r}")
            if self.kuberay_cluster == cluster_names.PER_RUN:
                self._cluster_owner = cluster_names.owner_for_run(ti.dag_id, ti.run_id, deployment or "")
            self.log.info("[rayslice] on RayCluster %s (kuberay_cluster=%r)", self._cluster, self.kuberay_cluster)
        return RayHook(self.ray_conn_id, cluster=self._cluster, cluster_owner=self._cluster_owner)

    def setup_mismatch(self) -> str | None:
        """Why this step may not run on the cluster an upstream `CreateRayClusterOperator` makes (None: it does).

        The names are compared as written (a templated one is not compared): a setup with ``name="per-run"``
        and a step without ``kuberay_cluster="per-run"`` would run on the connection's shared cluster while
        the run pays for its own.
        """
        from rayslice.operators.kuberay import CreateRayClusterOperator

        if not self.has_dag():  # rebuilt in the triggerer outside its DAG: no upstream to compare with
            return None
        mine = self.kuberay_cluster or None
        seen: set[str] = set()
        stack = list(self.upstream_list)
        while stack:
            task = stack.pop()
            if task.task_id in seen:
                continue
            seen.add(task.task_id)
            stack.extend(task.upstream_list)
            if not isinstance(task, CreateRayClusterOperator) or task.ray_conn_id != self.ray_conn_id:
                continue
            theirs = task.name or None
            if theirs == mine or any(is_templated(n) for n in (theirs, mine) if n):
                continue
            return (f"{task.task_id!r} upstream creates the RayCluster "
                    f"{f'name={theirs!r}' if theirs else 'the connection names'}, but this step runs on "
                    f"{f'kuberay_cluster={mine!r}' if mine else 'the connection' + chr(39) + 's cluster'}: "
                    f"give it kuberay_cluster={theirs!r} to run on the cluster the run made")
        return None

    def deferral_limit(self) -> tuple[float | None, str]:
        """Seconds from the start of `execute` the step may take, and what sets them (None: no limit).

        The task's `execution_timeout` when it has one; else every attempt's `capacity_timeout` +
        `step_timeout` + `ATTEMPT_MARGIN_S` (attempts: 1 + `preemption_retries`); a step without a
        `step_timeout` runs as long as it runs.
        """
        if self.execution_timeout is not None:
            return self.execution_timeout.total_seconds(), "execution_timeout"
        if self.step_timeout is None:
            return None, ""
        attempt = float(self.capacity_timeout) + float(self.step_timeout) + ATTEMPT_MARGIN_S
        return (1 + self.preemption_retries) * attempt, "capacity_timeout + step_timeout (with a margin)"

    def _check_checkpoint_root(self, root: Any) -> None:
        if root is None or is_templated(root):
            return
        problem = checkpoint_root_problem(root) if isinstance(root, str) else f"must be {CHECKPOINT_ROOT_FORMS}"
        if problem:
            raise InvalidRequestError(f"checkpoint_root of {self.task_id!r} {problem}; got {root!r}")

    def _check_zone_offers(self, hook: RayHook, request: Any) -> None:
        """A slice type the connection's Cloud TPU zone lacks fails here (optional `cloud_tpu` extra).

        Advisory: if the Cloud TPU API cannot answer, say so and submit anyway; Ray's own wait
        for capacity (`capacity_timeout`) still bounds the step.
        """
        if not isinstance(request, TpuSliceRequest):
            return
        from rayslice.cloud.cloud_tpu import CloudTpuError

        try:
            hook.check_tpu_type(request)
        except CloudTpuError as exc:
            self.log.warning("[rayslice] could not check %s against the connection's zone: %s", request.pod_type, exc)

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context: Context) -> Any:
        if next_method == TRIGGER_FAIL_REPR:  # Airflow timed the deferral out, or the trigger crashed
            self._stop_if_running(self._owner(context).submission_id, context)
        return super().resume_execution(next_method, next_kwargs, context)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        """Resume after the trigger: relay what the trigger did not, return the result or fail."""
        if event.get("status") == START_ON_WORKER:  # the triggerer could not build the step: the worker path
            self.start_blocker = str(event.get("reason"))  # execute() logs it
            return self.execute(context)
        sid = event.get("submission_id") or self._owner(context).submission_id
        self._submission_id = sid
        if not event.get("log_complete"):  # the trigger relayed the whole log unless it says otherwise
            self._relay_rest(sid, int(event.get("log_offset") or 0), context)
        if event.get("status") == "success":
            self.log.info("[rayslice] Ray job %s succeeded", sid)
            return event.get("result")
        if not event.get("log_complete"):  # the trigger gave up on a job that may still run: the task does too
            self._stop_if_running(sid, context)
        message = str(event.get("message") or "no message")  # logged once, by Airflow, as the task's exception
        if event.get("error_type") == EXECUTION_TIMEOUT:
            raise AirflowTaskTimeout(message)
        raise self._failure(str(event.get("error_type") or "StepFailedError"), message, event.get("error_fields"))

    def _stop_if_running(self, sid: str, context: Context) -> None:
        """The task gives up on the job: stop it, so that nothing runs (and holds capacity) without an owner."""
        try:
            with self.cluster_hook(context).client() as client:
                if client.get(sid).is_terminal:
                    return
                client.stop(sid)
        except JobNotFoundError:
            return
        except RaysliceError as exc:
            self.log.warning("[rayslice] could not stop Ray job %s: %s", sid, exc)
            return
        self.log.warning("[rayslice] stopped Ray job %s: the task gave up on it", sid)

    def on_kill(self) -> None:
        """Stop the Ray job: its end releases every slice or device it held."""
        sid, settings = self._submission_id, self._settings
        if not sid or settings is None:
            return
        where = dict(self._members) if self._set is not None else {"": settings}  # a set's job runs on each member
        for name, each in where.items():
            on = f" on cluster {name}" if name else ""
            on += " (it runs the step there)" if name and name == self._ran_on else ""
            try:
                with each.client() as client:
                    stopped = client.stop(sid)
            except RaysliceError as exc:
                self.log.warning("[rayslice] could not stop Ray job %s%s: %s", sid, on, exc)
                continue
            self.log.info("[rayslice] %s Ray job %s%s", "stopped" if stopped else "not running:", sid, on)
        if self._set is not None and self._set_folder:  # a member not reached above: its job ends when admitted
            try:
                if end_chain(self._set_folder, sid, "stopped: its Airflow task was killed", killed=True):
                    self.log.info("[rayslice] ended the step's claims: its job on any cluster of set %s not reached "
                                  "above ends without running", self._set.name)
            except Exception as exc:  # storage down: the jobs reached above are stopped anyway
                self.log.warning("[rayslice] could not end the step's claims in %s: %s: %s", self._set_folder,
                                 type(exc).__name__, exc)

    # ---- helpers

    def _owner(self, context: Context, deployment: str = "") -> Owner:
        ti = context["ti"]
        map_index = ti.map_index if ti.map_index is not None else -1
        owner = Owner(dag_id=ti.dag_id, run_id=ti.run_id, task_id=ti.task_id, map_index=map_index,
                      try_number=ti.try_number, deployment=deployment, ti_id=str(ti.id))
        return owner.model_copy(update={"submission_id": submission_id(owner)})

    def _priority_weight(self, context: Context) -> int:
        """The task try's Airflow priority weight (after its weight rule), else the operator's own."""
        weight = getattr(context.get("ti"), "priority_weight", None)
        if weight is None:
            weight = self.priority_weight
        try:
            return int(weight)
        except (TypeError, ValueError):
            return 0

    def _spec(self, request: Any, owner: Owner, context: Context) -> StepSpec:
        try:
            fields = {"request": request, "kwargs": self.step_kwargs(context), "owner": owner,
                      "capacity_timeout": float(self.capacity_timeout),
                      "priority": self.priority if self.priority is not None else self._priority_weight(context),
                      "team": team_for(self._settings.team if self._settings else None, self.team,
                                       f"task {self.task_id!r}"),
                      "step_timeout": None if self.step_timeout is None else float(self.step_timeout),
                      "hang_timeout": None if self.hang_timeout is None else float(self.hang_timeout),
                      "preemption_retries": self.preemption_retries,
                      "preemptible": self.preemptible, "notice_signal": self.notice_signal,
                      "checkpoint_root": self.checkpoint_root or (self._settings and self._settings.checkpoint_root),
                      "launcher": self._settings.launcher if self._settings else "shipped",
                      "runtime_env": runtime_envs.merge(self._settings and self._settings.runtime_env,
                                                        runtime_envs.validate(self.runtime_env,
                                                                              f"runtime_env of {self.task_id!r}"))}
            if self.callable is not None:
                spec = StepSpec(callable=self.callable, **fields)
            elif self.command is not None:
                spec = StepSpec(command=split_command(self.command), **fields)
            elif self._in_triggerer and self.shipped_callable:  # pickled at parse time (the live function is not here)
                spec = StepSpec(pickled=self.shipped_callable["pickled"], **fields)
            else:
                spec = StepSpec.for_function(self.python_callable, **fields)
            spec.model_dump_json()  # the arguments must be JSON: fail here, not halfway through submitting
            return spec
        except (InvalidRequestError, ValueError, TypeError, pickle.PicklingError) as exc:
            raise AirflowFailException(f"{self.task_id}: cannot ship the step: {exc}") from None

    async def _submit_and_follow(self, spec: StepSpec) -> Any:
        assert self._settings is not None
        if self._set is not None:
            return await self._run_on_set(spec)
        async with self._settings.async_client() as client:
            if spec.owner.try_number > 1:
                await self._stop_earlier_tries(client, spec.owner)
            sid = await submit_step(client, spec, emit=self.log.info)
            metrics.submitted("worker")
            self.log.info("[rayslice] Ray job %s: %s", sid, job_link(sid, self.ray_conn_id))
            if self.deferrable:
                return None
            waiting, outcome = time.monotonic(), "error"
            try:
                result = await self._follow(client, sid)
                outcome = "success"
                return result
            finally:
                metrics.waited(time.monotonic() - waiting, where="worker", outcome=outcome)

    async def _follow(self, client: AsyncRayJobsClient, sid: str) -> Any:
        """Poll to the end, relaying new log lines; a short dashboard outage is waited out."""
        return await wait_for_step(client, sid, emit=self.log.info, poll=self.poll_interval)

    async def _stop_earlier_tries(self, client: AsyncRayJobsClient, owner: Owner) -> None:
        """A retry must not run next to the tries it replaces: stop every one still running, wait for their ends.

        Only this Airflow deployment's tries: another Airflow's task of the same name runs on.
        Not only try - 1: try 3 also stops try 1 when try 2 never got to submit. Earlier tries are
        found by their jobs' metadata, since their ids hold task-instance ids this try cannot know.
        """
        tries = running_earlier_tries(await client.list_jobs(), owner)
        for sid, try_number in sorted(tries.items(), key=lambda item: item[1]):
            self.log.info("[rayslice] stopping Ray job %s of try %d before this try starts", sid, try_number)
            await client.stop(sid)
        waiting = dict(tries)
        deadline = time.monotonic() + PREVIOUS_TRY_STOP_TIMEOUT_S
        while waiting:
            for sid, try_number in list(waiting.items()):
                try:
                    status = (await client.get(sid)).status
                except JobNotFoundError:  # deleted meanwhile: it runs no more
                    status = None
                if status is None or status.is_terminal:
                    del waiting[sid]
                    self.log.info("[rayslice] Ray job %s of try %d is %s", sid, try_number,
                                  status.value if status else "gone")
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise AirflowException(
                    f"Ray job(s) {', '.join(sorted(waiting))} of earlier tries still run "
                    f"{PREVIOUS_TRY_STOP_TIMEOUT_S:.0f} s after they were stopped; stop them in the Ray dashboard "
                    "and retry the task"
                )
            await asyncio.sleep(0.5)

    def _relay_rest(self, sid: str, offset: int, context: Context) -> None:
        follower = LogFollower(self.log.info, offset=offset)
        try:
            with self.cluster_hook(context).client() as client:
                follower.feed(client.logs(sid))
            follower.flush()
        except RaysliceError as exc:
            self.log.warning("[rayslice] could not read the rest of Ray job %s's log: %s", sid, exc)

    def _failure(self, error_type: str, message: str, fields: Mapping[str, Any] | None = None) -> AirflowException:
        """The task's error, with where the step failed; what a retry cannot fix fails without retrying."""
        sid = self._submission_id or "?"
        if error_type in NOT_RETRIED:
            return RayStepFailedForGood(f"Ray step {sid} cannot run ({error_type}): {message}", error_type=error_type,
                                        submission_id=sid, **dict(fields or {}))
        return RayStepFailed(f"Ray step {sid} failed ({error_type}): {message}", error_type=error_type,
                             submission_id=sid, **dict(fields or {}))
