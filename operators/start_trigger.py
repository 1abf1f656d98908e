"""Steps that start in the triggerer: a step that succeeds costs no Airflow worker process.

A deferrable rayslice task starts in the triggerer (Airflow 3.3's ``start_from_trigger``): the
scheduler moves it from ``scheduled`` straight to ``deferred`` with a `RayStepStartTrigger`, which
builds the step there (the operator's own code: request, program, kwargs rendered with the task's
context, the `ray` connection), submits it under the same submission id a worker would use (same
reattach, same "stop earlier tries"), follows it and relays its log like `RayStepTrigger`, and ends
the task with ``TaskSuccessEvent()``, its XComs (``return_value``, ``ray_submission_id``, the link)
pushed through the Task SDK first, as a worker pushes them (the event's own ``xcoms`` are stored
JSON-encoded twice in Airflow 3.3.2: a downstream task would read a string).

A failed step resumes on a worker (``execute_complete``) to raise there: Airflow's ``TaskFailedEvent``
applies ``retries``, but not the task's exception (callbacks read `RayStepFailed`'s fields) nor
"fail without retrying" (`NOT_RETRIED`). What cannot be built in the triggerer resumes on a worker
too (event ``start_on_worker``), which runs the worker path and logs why.

What the trigger starts from:

- an unmapped task: its start arguments, set per instance at parse time (`step_arguments`):
  the operator's arguments, a DAG-file function pickled by value at parse time
  (`ship_function`), another task's output as a reference (`XCOM_REF`);
- a mapped task: Airflow builds a mapped task's trigger from the class's ``start_trigger_args``
  (it never calls ``expand_start_trigger_args``), so every map index gets the same, empty kwargs. The
  trigger reads the serialized task the triggerer hands it instead: ``partial_kwargs`` and this map
  index's share of the expand input (literal lists, or an unmapped task's output), the same
  arithmetic as the Task SDK's ``DictOfListsExpandInput``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Mapping
from datetime import UTC
from typing import Any

from airflow.triggers.base import StartTriggerArgs, TaskSuccessEvent, TriggerEvent
from rayslice.hooks.ray import RayHook
from rayslice.operators import metrics
from rayslice.operators.links import CLUSTER_KEY, SUBMISSION_ID_KEY, RayJobLink, job_link
from rayslice.operators.triggers import LOG_CHECKPOINT_KEY, RayStepTrigger, logs_delivered

from rayslice.client.submission import submission_id, submit_step
from rayslice.core.exceptions import RaysliceError
from rayslice.core.step import Owner, pickle_function, undefined_names

__all__ = ["START_ON_WORKER", "RayStepStartTrigger", "ship_function", "start_trigger_args"]

#: The event's status when the step must start on a worker after all (its reason in ``reason``).
START_ON_WORKER = "start_on_worker"
#: Another task's output in start arguments: ``{XCOM_REF: {"task_id": ..., "key": ...}}``.
XCOM_REF = "__rayslice_xcom__"
#: The XCom (of the task) holding the deadline the try's first trigger derived from the step's limits.
DEADLINE_KEY = "rayslice_deadline"
#: Seconds before Airflow's own deferral timeout (start + execution_timeout) that the trigger stops the job.
DEADLINE_LEAD_S = 3.0
#: The operator arguments the trigger rebuilds an unmapped operator from (plus its request fields).
STEP_ARGUMENTS = ("callable", "command", "op_kwargs", "runtime_env", "ray_conn_id", "capacity_timeout",
                  "step_timeout", "hang_timeout", "preemption_retries", "checkpoint_root", "poll_interval",
                  "execution_timeout", "shipped_callable", "priority", "team", "preemptible", "notice_signal",
                  "kuberay_cluster")


class CannotStart(Exception):
    """The step cannot start in the triggerer; the message says why (it goes to the task log)."""


def start_trigger_args(step: Mapping[str, Any] | None = None) -> StartTriggerArgs:
    return StartTriggerArgs(trigger_cls=f"{__name__}.RayStepStartTrigger",
                            trigger_kwargs={} if step is None else {"step": dict(step)},
                            next_method="execute_complete", next_kwargs=None, timeout=None)


def ship_function(fn: Any) -> dict[str, Any]:
    """A DAG-file function for the triggerer: pickled by value now (parse time), and its parameters.

    Raises CannotStart when pickling now could differ from pickling on a worker (a name it uses is
    not bound yet) or fails.
    """
    missing = undefined_names(fn)
    if missing:
        raise CannotStart(f"the function {getattr(fn, '__qualname__', fn)!r} uses {', '.join(missing)}, not yet "
                          "defined where it is decorated, so it is pickled on the worker")
    try:
        blob = pickle_function(fn)
        parameters = [[p.name, int(p.kind), p.default is not inspect.Parameter.empty]
                      for p in inspect.signature(fn).parameters.values()]
    except Exception as exc:
        raise CannotStart(f"the function cannot be pickled at parse time ({exc})") from None
    return {"pickled": blob, "parameters": parameters, "name": getattr(fn, "__name__", "step")}


def stand_in(shipped: Mapping[str, Any]) -> Any:
    """A function with the shipped one's parameters (the decorator binds arguments to them); never called."""

    def step(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the stand-in of a shipped step function is never called")

    step.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
        inspect.Parameter(name, inspect._ParameterKind(kind), default=None if has_default else inspect.Parameter.empty)
        for name, kind, has_default in shipped["parameters"]])
    step.__name__ = step.__qualname__ = str(shipped.get("name") or "step")
    return step


def encode_refs(value: Any) -> Any:
    """Arguments as JSON for the trigger's kwargs: another (unmapped) task's output becomes a reference."""
    from airflow.sdk.definitions._internal.expandinput import MappedArgument
    from airflow.sdk.definitions.mappedoperator import MappedOperator
    from airflow.sdk.definitions.xcom_arg import PlainXComArg, XComArg

    if isinstance(value, MappedArgument):
        # A step in a mapped task group: each group index resolves its share of the group's input, and its
        # upstream XComs, as the Task SDK does on a worker (not rebuilt in the triggerer).
        raise CannotStart("an argument is the input of a mapped task group")
    if isinstance(value, PlainXComArg):
        if isinstance(value.operator, MappedOperator):
            raise CannotStart(f"an argument is the output of the mapped task {value.operator.task_id!r}")
        return {XCOM_REF: {"task_id": value.operator.task_id, "key": value.key}}
    if isinstance(value, XComArg):
        raise CannotStart(f"an argument is a {type(value).__name__} (only a task's plain output is read in the "
                          "triggerer)")
    if isinstance(value, Mapping):
        return {k: encode_refs(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode_refs(v) for v in value]
    return value


def xcom_backend() -> Any:
    """The configured XCom backend (``[core] xcom_backend``), resolved as a worker's Task SDK resolves it."""
    from airflow.sdk.execution_time.xcom import resolve_xcom_backend

    return resolve_xcom_backend()


def is_mapped(task: Any) -> bool:
    """Whether a serialized task is a mapped one."""
    return bool(getattr(task, "_is_mapped", False) or hasattr(task, "partial_kwargs"))


def object_ids(value: Any, into: set[int]) -> set[int]:
    """The ids of `value` and of every container and string inside it (what rendering must leave alone)."""
    into.add(id(value))
    if isinstance(value, Mapping):
        for item in value.values():
            object_ids(item, into)
    elif isinstance(value, list | tuple | set):
        for item in value:
            object_ids(item, into)
    return into


def local_folders_here(runtime_env: Mapping[str, Any] | None) -> None:
    """Raise CannotStart for a local `working_dir` / `py_modules` path the triggerer cannot read as a worker would.

    A worker zips those folders from its own disk, a relative path from its own working directory:
    a relative path, or one missing on the triggerer's host, is left to a worker.
    """
    from pathlib import Path

    env = runtime_env or {}
    modules = env.get("py_modules") if isinstance(env.get("py_modules"), list) else []
    for what, path in [("working_dir", env.get("working_dir")), *(("py_modules", m) for m in modules)]:
        if not isinstance(path, str) or "://" in path:
            continue
        local = Path(path).expanduser()
        if not local.is_absolute():
            raise CannotStart(f"runtime_env {what} {path!r} is relative: a worker resolves it from its own folder")
        if not local.exists():
            raise CannotStart(f"runtime_env {what} {path!r} is not on the triggerer's host")


class RayStepStartTrigger(RayStepTrigger):
    """Start a step in the triggerer, follow it, end the task (see the module's docstring)."""

    def __init__(self, step: Mapping[str, Any] | None = None, **_: Any) -> None:
        # Never fails to inflate (a trigger that cannot be built would leave its task deferred).
        super().__init__(ray_conn_id=RayHook.default_conn_name, submission_id="")
        self.step = dict(step or {})
        self._context: Any = None
        # Other tasks' outputs read for this step: kept alive, and their ids left out of rendering (a worker
        # never renders an XCom value as a template: `Templater.render_template` returns `resolve()` as it is).
        self._xcom_values: list[Any] = []
        self._literals: set[int] = set()
        self._restarted = True  # until `_build` finds otherwise: an earlier trigger of this try may have relayed

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {"step": self.step}

    def render_template_fields(self, context: Any, jinja_env: Any = None) -> None:
        """Keep the task's context: the operator renders its own fields with it in `run`."""
        self._context = context

    async def run(self) -> AsyncIterator[TriggerEvent]:
        async for event in self._start():
            await logs_delivered()  # every line logged before the event is in the task's log (see there)
            yield event

    async def _start(self) -> AsyncIterator[TriggerEvent]:
        try:
            operator, spec = await self._build()
        except CannotStart as exc:
            self.log.info("[rayslice] this step starts on a worker: %s", exc)
            yield TriggerEvent({"status": START_ON_WORKER, "reason": str(exc)})
            return
        except Exception as exc:  # what the worker path fails with at the same point: the task fails there
            from airflow.sdk.exceptions import AirflowFailException

            error_type = "InvalidRequestError" if isinstance(exc, AirflowFailException) else type(exc).__name__
            yield self._event("error", 0, log_complete=True, error_type=error_type, message=str(exc))
            return
        async for event in self._submit_and_follow(operator, spec):
            yield event

    # ---- building the step, as the operator would on a worker

    async def _build(self) -> tuple[Any, Any]:
        ti, context = self.task_instance, self._context
        if ti is None or context is None or self.task is None:
            raise CannotStart("the triggerer gave the trigger no task context")
        # The earlier try's XComs (this task's) are deleted while the step's arguments (upstream tasks' XComs) are
        # read: independent round trips to Airflow, each otherwise a triggerer loop of its own (issue 52).
        clearing = asyncio.ensure_future(self._clear_earlier_try())
        try:
            operator = await self._operator()
        except BaseException:
            with contextlib.suppress(Exception):
                await clearing  # its deletes end before the event that sends the step elsewhere
            raise
        restarted = self._restarted = await clearing
        if not operator.deferrable:
            raise CannotStart("deferrable=False: the step runs (and waits) on a worker")
        if (clusters := await asyncio.to_thread(RayHook(operator.ray_conn_id).cluster_set)) is not None:
            members = ", ".join(clusters.members)
            raise CannotStart(f"its connection {operator.ray_conn_id!r} is a cluster set ({members}): the step is "
                              "followed on every member cluster at once, from a worker")
        # The templated fields as a worker renders them: the values read from XCom stay as they are.
        try:
            operator._do_render_template_fields(operator, operator.template_fields, context,
                                                operator.get_template_env(), set(self._literals))
        except Exception as exc:  # a worker renders again as the task resumes, and fails with Airflow's own error
            raise CannotStart(f"its templated fields do not render here ({type(exc).__name__}: {exc})") from None
        # Off the event loop: a first step may wait for the deployment's Variable; a per-run cluster is named by it.
        deployment = await asyncio.to_thread(RayHook(operator.ray_conn_id).deployment)
        hook = await asyncio.to_thread(operator.cluster_hook, context, deployment)
        operator._settings = await hook.asettings()
        self.ray_conn_id, self.poll_interval = operator.ray_conn_id, float(operator.poll_interval)
        self.kuberay_cluster, self.kuberay_owner = operator._cluster, operator._cluster_owner
        request = operator.build_request()
        if note := getattr(request, "programs_note", None):
            self.log.info("[rayslice] %s", note)
        operator._check_checkpoint_root(operator.checkpoint_root)
        local_folders_here(operator.runtime_env)
        # The zone check as on a worker (`execute`): the connection's `cloud_tpu` extra, read off the loop.
        await asyncio.to_thread(operator._check_zone_offers, RayHook(operator.ray_conn_id), request)
        owner = operator._owner(context, deployment)
        operator._submission_id = self.submission_id = owner.submission_id
        spec = operator._spec(request, owner, context)
        limit, reason = operator.deferral_limit()
        self.deadline = None if limit is None else await self._first_deadline(time.time() + limit, restarted)
        self.deadline_reason = reason or "execution_timeout"
        timeout_after = getattr(self, "timeout_after", None)  # Airflow's: the deferral's start + execution_timeout
        if reason == "execution_timeout" and timeout_after is not None:
            if timeout_after.tzinfo is None:
                timeout_after = timeout_after.replace(tzinfo=UTC)
            # The triggerer cancels the trigger at that moment itself (no event, no on_kill; the task then
            # fails on a worker, which stops the job): the trigger stops the job a little before, waits for
            # its end and reports the timeout.
            self.deadline = timeout_after.timestamp() - DEADLINE_LEAD_S
        return operator, spec

    async def _operator(self) -> Any:
        """The task's operator, rebuilt from its start arguments (unmapped) or its serialized partial + expand."""
        from airflow._shared.module_loading import import_string

        task = self.task
        module = getattr(task, "_task_module", None) or getattr(task, "task_module", None)
        cls = import_string(f"{module}.{task.task_type}")
        if is_mapped(task):
            kwargs = dict(task.partial_kwargs)
            mapped = await self._expand(task)
            if getattr(task, "_expand_input_attr", "expand_input") == "op_kwargs_expand_input":
                kwargs["op_kwargs"] = {**(kwargs.get("op_kwargs") or {}), **mapped}
            else:
                kwargs.update(mapped)
        elif self.step:
            kwargs = dict(self.step)
        else:
            raise CannotStart("the task has no start arguments (serialized by an older rayslice)")
        kwargs = {k: await self._resolve(v) for k, v in kwargs.items()}
        # What the serialized task holds that is no operator argument (MappedOperator.unmap pops these too;
        # callbacks are Airflow's to run, not the step's).
        for name in ("task_id", "dag", "task_group", "start_date", "end_date", "is_setup", "is_teardown",
                     "on_failure_fail_dagrun", *(k for k in kwargs if k.startswith("has_on_") or
                                                 (k.startswith("on_") and k.endswith("_callback")))):
            kwargs.pop(name, None)
        from airflow.sdk.bases.decorator import DecoratedOperator

        decorated = issubclass(cls, DecoratedOperator)
        if decorated or all(kwargs.get(name) is None for name in ("callable", "command")):
            shipped = kwargs.get("shipped_callable")
            if not shipped:
                raise CannotStart("the step's function is not pickled at parse time (python_callable= of a "
                                  "mapped operator): it is pickled on a worker")
            kwargs["python_callable"] = stand_in(shipped)
        operator = cls(task_id=task.task_id, **kwargs)
        operator._in_triggerer = True
        return operator

    async def _expand(self, task: Any) -> dict[str, Any]:
        """This map index's share of a mapped task's expand input."""
        from airflow.models.expandinput import SchedulerDictOfListsExpandInput, SchedulerListOfDictsExpandInput

        index = self.task_instance.map_index
        expand_input = task._get_specified_expand_input()
        if isinstance(expand_input, SchedulerListOfDictsExpandInput):
            values = await self._resolve(expand_input.value)
            if not isinstance(values, list) or not isinstance(values[index], Mapping):
                raise CannotStart("expand_kwargs() needs a list of dicts")
            return dict(values[index])
        if not isinstance(expand_input, SchedulerDictOfListsExpandInput):
            raise CannotStart(f"unknown expand input {type(expand_input).__name__}")
        resolved = {k: await self._resolve(v) for k, v in expand_input.value.items()}
        lengths = {k: len(v) for k, v in resolved.items()}
        data = {}
        for key, value in resolved.items():
            position, rest = -1, index
            for mapped_key in reversed(list(expand_input.value)):  # the Task SDK's _find_index_for_this_field
                if mapped_key == key:
                    position = rest % lengths[mapped_key]
                    break
                rest //= lengths[mapped_key]
            data[key] = list(value.items())[position] if isinstance(value, Mapping) else value[position]
        return data

    async def _resolve(self, value: Any) -> Any:
        """Another task's output (a reference, or a serialized XComArg) read now; anything else as it is."""
        from airflow.serialization.definitions.xcom_arg import SchedulerPlainXComArg, SchedulerXComArg

        ref: dict[str, Any] | None = None
        if isinstance(value, SchedulerPlainXComArg):
            if getattr(value.operator, "_is_mapped", False) or hasattr(value.operator, "partial_kwargs"):
                raise CannotStart(f"an argument is the output of the mapped task {value.operator.task_id!r}")
            ref = {"task_id": value.operator.task_id, "key": value.key}
        elif isinstance(value, SchedulerXComArg):
            raise CannotStart(f"an argument is a {type(value).__name__}")
        elif isinstance(value, Mapping) and set(value) == {XCOM_REF}:
            ref = value[XCOM_REF]
        elif isinstance(value, Mapping):
            return {k: await self._resolve(v) for k, v in value.items()}
        elif isinstance(value, list):
            return [await self._resolve(v) for v in value]
        if ref is None:
            return value
        ti = self.task_instance
        value = await asyncio.to_thread(xcom_backend().get_one, key=ref["key"], dag_id=ti.dag_id, run_id=ti.run_id,
                                        task_id=ref["task_id"], map_index=-1)
        if value is None and ref["key"] != "return_value":  # a worker raises XComNotFound (PlainXComArg.resolve)
            raise CannotStart(f"the task {ref['task_id']!r} pushed no XCom {ref['key']!r}")
        self._xcom_values.append(value)
        object_ids(value, self._literals)
        return value

    async def _clear_earlier_try(self) -> bool:
        """Delete the XComs an earlier try of this task left, as a worker does when a try starts.

        A worker deletes every XCom of its task instance at a try's start: the execution API's
        ``ti_run`` lists their keys (``xcom_keys_to_clear``) and the Task SDK's ``run`` deletes each
        through the XCom backend. A try started in the triggerer gets no ``ti_run`` (the scheduler's
        ``TaskInstance.defer_task`` moves it to ``deferred`` itself), a trigger cannot read the
        metadata DB (the triggerer's runner blocks the ORM) and its channel to the supervisor asks
        for XComs by key only. So the trigger deletes every key a try of a step can push, whatever
        that try recorded (its submission id push may have failed): its result and
        ``multiple_outputs`` keys, submission id, link, log checkpoint and deadline. Keys that other
        code pushed to the task (a callback's ``xcom_push``) stay: docs/concepts.md says so. A first
        try has nothing to clear; a trigger of this same try (moved, restarted) finds its own
        submission id, or, where that push was lost, its own log checkpoint or deadline
        (`_own_records`), deletes nothing, and returns True.
        """
        ti = self.task_instance
        map_index = ti.map_index if ti.map_index is not None else -1
        where = {"dag_id": ti.dag_id, "run_id": ti.run_id, "task_id": ti.task_id, "map_index": map_index}
        own = submission_id(Owner(dag_id=ti.dag_id, run_id=ti.run_id, task_id=ti.task_id, map_index=map_index,
                                  try_number=ti.try_number, ti_id=str(ti.id)))
        backend = xcom_backend()
        recorded = await asyncio.to_thread(backend.get_one, key=SUBMISSION_ID_KEY, **where)
        if recorded == own:
            return True
        if recorded is None and int(ti.try_number or 1) <= 1:
            return False  # the task's first try: no earlier one pushed anything
        if recorded is None and await self._own_records(own, where):
            return True  # this try's earlier trigger ran (it cleared the try before), and its id's push was lost
        keys = ["return_value", SUBMISSION_ID_KEY, RayJobLink().xcom_key, CLUSTER_KEY, LOG_CHECKPOINT_KEY,
                DEADLINE_KEY]
        earlier = await asyncio.to_thread(backend.get_one, key="return_value", **where)
        if isinstance(earlier, Mapping):  # multiple_outputs keys (the DAG may have changed since: any dict's)
            keys += [str(k) for k in earlier if str(k) not in keys]
        self.log.info("[rayslice] a new try: deleting the XComs of the earlier one (%s)", ", ".join(keys))
        for key in keys:
            await asyncio.to_thread(backend.delete, key=key, **where)
        return False

    async def _own_records(self, own: str, where: Mapping[str, Any]) -> bool:
        """Whether the log checkpoint or the deadline recorded for the task names this try's submission id.

        A try's first trigger clears the earlier try's XComs, then pushes its id: when that push failed
        and the trigger moved, the next one finds no id, as a new try's first trigger does. Its own
        records tell them apart; deleting them would re-relay the whole log and move the deadline on.
        """
        from airflow.sdk import BaseXCom

        records = await asyncio.gather(*(asyncio.to_thread(BaseXCom.get_one, key=key, **where)
                                         for key in (LOG_CHECKPOINT_KEY, DEADLINE_KEY)))
        return any(isinstance(record, Mapping) and record.get("submission_id") == own for record in records)

    def _reattached(self, job: Any) -> None:
        """The job existed already (an earlier trigger of this try submitted it): its log may be relayed in part."""
        self._restarted = True

    async def _checkpoint(self) -> dict[str, Any]:
        """Where relaying starts: a trigger that submitted its job itself starts at the log's start, unread.

        Only a trigger following this submission id records a checkpoint, so a trigger that found no
        earlier push of its id (`_clear_earlier_try`) and created the job itself (no reattach) has no
        record to read, and saves that round trip to Airflow (issue 52). A restarted or moved one reads it.
        """
        if not self._restarted:
            return {"offset": self.log_offset}
        return await super()._checkpoint()

    async def _first_deadline(self, deadline: float, restarted: bool) -> float:
        """The deadline this try's first trigger set (a moved or restarted one keeps it), else `deadline`, recorded.

        Airflow keeps a trigger's kwargs as they were at the deferral, so the deadline a step started in
        the triggerer derives from its limits is kept in an XCom of its task (`DEADLINE_KEY`).
        """
        from airflow.sdk import BaseXCom

        ti = self.task_instance
        where = {"dag_id": ti.dag_id, "run_id": ti.run_id, "task_id": ti.task_id, "map_index": ti.map_index}
        if restarted:
            record = await asyncio.to_thread(BaseXCom.get_one, key=DEADLINE_KEY, **where)
            if isinstance(record, Mapping) and record.get("submission_id") == self.submission_id:
                return float(record["deadline"])
        await self._push(DEADLINE_KEY, {"submission_id": self.submission_id, "deadline": deadline})
        return deadline

    # ---- submitting and following

    async def _submit_and_follow(self, operator: Any, spec: Any) -> AsyncIterator[TriggerEvent]:
        sid = self.submission_id
        link = job_link(sid, operator.ray_conn_id)  # never the dashboard's URL: see `rayslice.operators.links`
        # The "Ray job" link works while the step runs: Airflow 3 reads a link from its XCom, which a
        # worker pushes (to the metadata DB, not the XCom backend) when its task ends; no worker runs here.
        # Both before the submission, together: one wait on Airflow instead of two (issue 52).
        await asyncio.gather(self._push(SUBMISSION_ID_KEY, sid, backend=xcom_backend()),
                             self._push(RayJobLink().xcom_key, link))
        try:
            async with operator._settings.async_client() as client:
                if spec.owner.try_number > 1:
                    await operator._stop_earlier_tries(client, spec.owner)
                await submit_step(client, spec, emit=self.log.info, on_reattach=self._reattached)
        except RaysliceError as exc:
            yield self._event("error", 0, log_complete=True, error_type=type(exc).__name__, message=str(exc))
            return
        metrics.submitted("triggerer")
        metrics.deferred("triggerer")  # its wait is in the triggerer from the start
        self.log.info("[rayslice] Ray job %s: %s", sid, link)
        async for event in self._follow():
            payload = event.payload
            if payload.get("status") != "success":
                yield event  # resumes on a worker, which raises the step's error (retries, callbacks)
                return
            self.log.info("[rayslice] Ray job %s succeeded", sid)
            if getattr(self.task, "has_on_success_callback", False):
                # Airflow 3.3 runs no success callback for a task a trigger ends (`TaskSuccessEvent`'s callback
                # request reaches the DAG processor, whose `_execute_task_callbacks` runs failure callbacks
                # only): the task ends on a worker, which pushes the result and runs the callback.
                yield event
                return
            if not await self._push_result(operator, payload.get("result")):
                yield event  # a worker pushes it, and fails as it does (see `_push_result`)
                return
            yield TaskSuccessEvent()
            return

    async def _push_result(self, operator: Any, result: Any) -> bool:
        """Push the result as the Task SDK's ``_push_xcom_if_needed`` does on a worker; False: a worker must.

        Through the XCom backend; ``multiple_outputs`` keys first; the length of a list or dict that a
        downstream task maps over goes with it (``mapped_length``: the execution API writes the
        TaskMap row the scheduler expands that task from). What a worker refuses (nothing to map
        over, an unmappable value, ``multiple_outputs`` of a non-dict) the trigger leaves to a worker
        (the success event resumes the task there), which fails with Airflow's own error.
        Not `TaskSuccessEvent(xcoms=...)`: Airflow 3.3.2 stores each such value JSON-encoded once more.
        """
        from airflow.sdk.definitions.mappedoperator import is_mappable_value

        task = self.task
        value = result if getattr(task, "do_xcom_push", operator.do_xcom_push) else None
        maps_over_it = not is_mapped(task) and next(iter(task.iter_mapped_dependants()), None) is not None
        if value is None:
            return not maps_over_it
        mapped_length = None
        if maps_over_it:
            if not is_mappable_value(value):
                return False
            mapped_length = len(value)
        xcoms: list[tuple[str, Any, int | None]] = []
        if getattr(task, "multiple_outputs", None) or getattr(operator, "multiple_outputs", False):
            if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
                return False
            xcoms += [(key, item, None) for key, item in value.items()]
        xcoms.append(("return_value", value, mapped_length))
        backend = xcom_backend()
        for key, item, length in xcoms:
            await self._push(key, item, backend=backend, mapped_length=length, required=True)
        return True

    async def _push(self, key: str, value: Any, *, backend: Any = None, mapped_length: int | None = None,
                    required: bool = False) -> None:
        """One XCom of this task; `backend` None: straight to the metadata DB (`BaseXCom`), as links are."""
        from airflow.sdk import BaseXCom

        ti = self.task_instance
        try:
            await asyncio.to_thread((backend or BaseXCom).set, key, value, dag_id=ti.dag_id, run_id=ti.run_id,
                                    task_id=ti.task_id, map_index=ti.map_index,
                                    dag_result=bool(getattr(self.task, "returns_dag_result", False)),
                                    _mapped_length=mapped_length)
        except Exception as exc:
            if required:
                raise
            self.log.warning("[rayslice] could not record the XCom %s: %s", key, exc)
