"""The trigger that follows a deferred step's Ray job from the triggerer.

It polls the job's small status and streams its log over the dashboard's log-tail websocket
(`rayslice.client.submission.JobFollow`): every call is awaited on the async Jobs client, each bounded
by a timeout, so one slow dashboard cannot stall the triggerer's event loop. Job log lines go
to the trigger's logger, which Airflow 3 routes to the task's log.

`log_offset` (characters of the job's log) is where relaying starts. Airflow keeps a trigger's
kwargs as they were at the deferral, so the trigger also records how far it relayed in an XCom
of its task (`LOG_CHECKPOINT_KEY`: the offset and digests of the last lines, every
`CHECKPOINT_S` and when it is cancelled); a trigger restarted with the triggerer, or moved to
another one, resumes there and skips what was relayed without holding it (a triggerer killed
outright re-relays at most the last `CHECKPOINT_S` of lines). Events carry the offset relayed up
to and `log_complete`, so `execute_complete` reads the log again only when the trigger could not
finish it.

`cleanup()` runs on every trigger exit, triggerer restarts included, so it never
touches the job. `on_kill()` runs when a triggerer cancels the trigger "by user action", which
in Airflow 3.3 means either the user marked the deferred task failed, success or cleared it, or
the trigger moved to another triggerer (`update_triggers` cancels whatever a triggerer no longer
owns, e.g. after it missed its heartbeat, through the same path). So `on_kill()` first asks
Airflow (the triggerer's execution API, `GetTaskStates`) whether the task is still deferred: then
the trigger only moved and the job is left to the triggerer that now follows it; anything else
(failed, success, cleared) stops the job, whose end releases all its capacity. A user's action
changes the task's state before Airflow deletes the trigger, so a cancelled trigger of a task
that is still deferred is always a move. Outside a triggerer (no one to ask) the job is stopped,
as a kill asks; inside one, a state that cannot be read leaves the job (a moved trigger's job is
still followed; the task's next try, or `rayslice reap`, stops one whose task ended). A job not
found yet is waited for a little (`SUBMIT_GRACE_S`): a kill during submission stops it too.

`resume_not_before` works around a race in Airflow's scheduler (3.3.2 and earlier; apache/airflow
#67287, #72716): the worker process that deferred exits, and the executor reports that exit as
"success" for the same try. If the trigger fires, and the scheduler queues or starts the resumed
task, before the scheduler has read that report, it takes the report for the resumed task's end
and fails the task ("finished with state success, but the task instance's state attribute is
queued") while the step itself succeeded: with retries, the step runs again. The report arrived
up to 6 s after the deferral here (`min_deferral` on the operators, default 15 s), so the trigger
holds its event until then; it never holds capacity (the job has already ended and released it).

`deadline` carries the task's `execution_timeout` into the deferral: Airflow 3 does not
apply it to deferred time (the execution API leaves a TODO there), so without it a deferred
step would hold its slice past the timeout. Without an `execution_timeout`, the operator derives
the deadline from the step's own limits (`deadline_reason` says which). At the deadline the
trigger stops the job, waits for its end, and reports `EXECUTION_TIMEOUT` (or `DEFERRAL_TIMEOUT`).
Whenever the trigger gives up following a job that may still run, it asks Ray to stop it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.sdk import BaseXCom
from airflow.triggers.base import BaseTrigger, TriggerEvent
from rayslice.hooks.ray import RayHook
from rayslice.operators import metrics

from rayslice.client.submission import UNREACHABLE_GRACE_S, JobFollow, LogFollower
from rayslice.core.exceptions import JobNotFoundError, RaysliceError, error_fields

__all__ = ["RayStepTrigger"]
#: The event's error_type when the trigger stopped the job at the task's execution_timeout.
EXECUTION_TIMEOUT = "ExecutionTimeout"
#: The event's error_type when it stopped the job at the deadline derived from the step's limits.
DEFERRAL_TIMEOUT = "DeferralTimeout"
#: The XCom (of the deferred task) where the trigger records how far it relayed the job's log.
LOG_CHECKPOINT_KEY = "rayslice_log_checkpoint"
#: Seconds between two such records while lines are relayed.
CHECKPOINT_S = 5.0
#: `task_state`'s answer when Airflow was asked but did not answer (not even after retries).
UNKNOWN_STATE = "unknown"
#: How long a kill waits for a job it does not find yet (a kill during submission) before deciding none was made.
SUBMIT_GRACE_S = 10.0
#: The longest a trigger's event waits for the triggerer to have read the trigger's log records (`logs_delivered`).
LOG_DELIVERY_S = 10.0


class RayStepTrigger(BaseTrigger):
    """Follow one Ray job to its end; yield ``{"status": "success"|"error", ...}`` once."""

    def __init__(
        self,
        *,
        ray_conn_id: str,
        submission_id: str,
        poll_interval: float = 2.0,
        log_offset: int = 0,
        call_timeout: float = 30.0,
        deadline: float | None = None,
        resume_not_before: float | None = None,
        deadline_reason: str = "execution_timeout",
        kuberay_cluster: str | None = None,
        kuberay_owner: str | None = None,
        **newer: Any,  # arguments a newer worker added: this triggerer follows the job without them
    ) -> None:
        super().__init__()
        self.ray_conn_id = ray_conn_id
        self.kuberay_cluster = kuberay_cluster  # the step's RayCluster, resolved (a run's own), else the extra's
        self.kuberay_owner = kuberay_owner  # a run's own cluster: the owner mark it must carry
        self.submission_id = submission_id
        self.poll_interval = float(poll_interval)
        self.log_offset = int(log_offset)
        self.call_timeout = float(call_timeout)
        self.deadline = None if deadline is None else float(deadline)  # Unix time: stop the job then
        self.deadline_reason = deadline_reason  # what set the deadline, in the user's words
        # Unix time: no event before then (see the module's docstring)
        self.resume_not_before = None if resume_not_before is None else float(resume_not_before)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "ray_conn_id": self.ray_conn_id,
                "submission_id": self.submission_id,
                "poll_interval": self.poll_interval,
                "log_offset": self.log_offset,
                "call_timeout": self.call_timeout,
                "deadline": self.deadline,
                "resume_not_before": self.resume_not_before,
                "deadline_reason": self.deadline_reason,
                "kuberay_cluster": self.kuberay_cluster,
                "kuberay_owner": self.kuberay_owner,
            },
        )

    def _hook(self) -> RayHook:
        # Each attempt is bounded by the client's timeout; the whole poll by call_timeout.
        return RayHook(self.ray_conn_id, timeout=min(10.0, self.call_timeout), retries=2, cluster=self.kuberay_cluster,
                       cluster_owner=self.kuberay_owner)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        async for event in self._follow():
            wait = (self.resume_not_before or 0.0) - time.time()
            if wait > 0:
                self.log.info("[rayslice] Ray job %s ended; resuming the task in %.1f s (min_deferral)",
                              self.submission_id, wait)
                await asyncio.sleep(wait)
            await logs_delivered()
            yield event

    async def _follow(self) -> AsyncIterator[TriggerEvent]:
        """Follow the job to its end (`_follow_job`), timing the wait for Airflow's metrics."""
        waiting = time.monotonic()
        async for event in self._follow_job():
            metrics.waited(time.monotonic() - waiting, where="triggerer", outcome=str(event.payload.get("status")))
            yield event

    async def _follow_job(self) -> AsyncIterator[TriggerEvent]:
        lines = LogFollower(self.log.info, **await self._checkpoint())
        sid = self.submission_id
        follow: JobFollow | None = None
        try:
            settings = await self._hook().asettings()
            async with settings.async_client() as client:
                follow = JobFollow(client, sid, lines, poll=self.poll_interval, call_timeout=self.call_timeout,
                                   unreachable_grace=UNREACHABLE_GRACE_S,
                                   warn=lambda message: self.log.warning("%s", message))
                timed_out = False
                saved, saved_at = lines.offset, time.monotonic()
                try:
                    async with contextlib.aclosing(follow.statuses()) as statuses:
                        async for job in statuses:
                            if not job.is_terminal and self.deadline is not None and time.time() >= self.deadline:
                                timed_out = True
                                break
                            if lines.offset != saved and time.monotonic() - saved_at >= CHECKPOINT_S:
                                saved, saved_at = lines.offset, time.monotonic()
                                await self._record(lines)
                except asyncio.CancelledError:  # the triggerer stops or hands this trigger on: note where it was
                    await self._record(lines)
                    raise
                if timed_out:
                    await self._stop_at_deadline(client)
            if timed_out:
                error_type = EXECUTION_TIMEOUT if self.deadline_reason == "execution_timeout" else DEFERRAL_TIMEOUT
                yield self._event("error", lines.offset, error_type=error_type,
                                  message=f"Ray job {sid} stopped: the task's {self.deadline_reason} passed")
                return
            try:
                result = follow.outcome()
            except RaysliceError as exc:
                yield self._event("error", lines.offset, log_complete=True, error_type=type(exc).__name__,
                                  message=str(exc), error_fields=error_fields(exc))
                return
            yield self._event("success", lines.offset, log_complete=True, result=result)
        except (RaysliceError, TimeoutError) as exc:
            gone = isinstance(exc, JobNotFoundError)
            what = "is unknown to the dashboard" if gone else "could not be followed"
            if not gone and not (follow is not None and follow.job is not None and follow.job.is_terminal):
                await self._stop_given_up()
            yield self._event("error", lines.offset, error_type=type(exc).__name__,
                              message=f"Ray job {sid} {what}: {exc}")

    async def _checkpoint(self) -> dict[str, Any]:
        """Where relaying starts: the kwargs' offset, or the record of an earlier run of this trigger past it."""
        start: dict[str, Any] = {"offset": self.log_offset}
        ti = getattr(self, "task_instance", None)
        if ti is None:  # run outside a triggerer (tests, `dag.test()`): nothing recorded
            return start
        try:
            record = await asyncio.wait_for(BaseXCom.aget_one(
                key=LOG_CHECKPOINT_KEY, dag_id=ti.dag_id, run_id=ti.run_id, task_id=ti.task_id,
                map_index=ti.map_index), self.call_timeout)
        except Exception as exc:  # a record is an optimisation: relaying from the kwargs' offset is correct too
            self.log.debug("no log checkpoint for Ray job %s: %s", self.submission_id, exc)
            return start
        if (isinstance(record, dict) and record.get("submission_id") == self.submission_id
                and int(record.get("offset") or 0) > self.log_offset):
            self.log.info("[rayslice] resuming the log of Ray job %s at character %d, where it was relayed up to",
                          self.submission_id, record["offset"])
            markers = record.get("markers") if isinstance(record.get("markers"), dict) else {}
            return {"offset": int(record["offset"]), "recent": [str(d) for d in record.get("recent") or []],
                    "markers": {str(k): str(v) for k, v in markers.items()}}
        return start

    async def _record(self, lines: LogFollower) -> None:
        """Note how far the log was relayed (see `_checkpoint`); best effort, bounded by `call_timeout`."""
        ti = getattr(self, "task_instance", None)
        if ti is None:
            return
        try:
            await asyncio.wait_for(BaseXCom.aset(
                LOG_CHECKPOINT_KEY, {"submission_id": self.submission_id, **lines.state()},
                dag_id=ti.dag_id, run_id=ti.run_id, task_id=ti.task_id, map_index=ti.map_index), self.call_timeout)
        except Exception as exc:
            self.log.debug("could not record the log offset of Ray job %s: %s", self.submission_id, exc)

    async def _stop_given_up(self) -> None:
        """The task gives up on a job that may still run: ask Ray to stop it (best effort: Ray may be unreachable)."""
        try:
            settings = await self._hook().asettings()
            async with settings.async_client() as client:
                stopped = await asyncio.wait_for(client.stop(self.submission_id), self.call_timeout)
        except (RaysliceError, TimeoutError) as exc:
            self.log.warning("[rayslice] could not stop Ray job %s: %s", self.submission_id, exc)
            return
        if stopped:
            self.log.warning("[rayslice] stopped Ray job %s: its task no longer follows it", self.submission_id)

    async def _stop_at_deadline(self, client: Any) -> None:
        """Stop the job and wait (bounded) for its end, so its capacity is free when the task fails."""
        self.log.error("Ray job %s: execution_timeout passed, stopping it", self.submission_id)
        await asyncio.wait_for(client.stop(self.submission_id), self.call_timeout)
        until = time.monotonic() + self.call_timeout
        while time.monotonic() < until:
            job = await asyncio.wait_for(client.get(self.submission_id), self.call_timeout)
            if job.status.is_terminal:
                self.log.info("Ray job %s is %s", self.submission_id, job.status.value)
                return
            await asyncio.sleep(0.2)
        self.log.warning("Ray job %s did not end within %.0f s of being stopped", self.submission_id,
                         self.call_timeout)

    def _event(self, status: str, log_offset: int, *, log_complete: bool = False, **fields: Any) -> TriggerEvent:
        return TriggerEvent({"status": status, "submission_id": self.submission_id,
                             "log_offset": log_offset, "log_complete": log_complete, **fields})

    async def cleanup(self) -> None:
        """Nothing to release: run() closes its client, and the job must outlive triggerer restarts."""

    async def on_kill(self) -> None:
        """The user killed the deferred task: stop the Ray job (its end frees the slice); a moved trigger: nothing.

        Shielded from the triggerer's repeated cancels (`shielded`); each call is bounded by `call_timeout`.
        """
        await shielded(self._kill())

    async def _kill(self) -> None:
        state = await task_state(self, self.call_timeout, about=self.submission_id)
        if state == "deferred":
            self.log.info("[rayslice] the trigger of Ray job %s moved to another triggerer (the task is still "
                          "deferred): leaving the job to it", self.submission_id)
            return
        if state == UNKNOWN_STATE:
            self.log.warning("[rayslice] Airflow did not say whether the task of Ray job %s was stopped or its trigger "
                             "moved: leaving the job (the task's next try stops it, as `rayslice reap` does once "
                             "the task has ended)", self.submission_id)
            return
        settings = await self._hook().asettings()
        async with settings.async_client() as client:
            until = time.monotonic() + SUBMIT_GRACE_S
            while True:
                try:
                    stopped = await asyncio.wait_for(client.stop(self.submission_id), self.call_timeout)
                    break
                except JobNotFoundError:
                    # A kill during submission: the job Ray is creating may show up a moment later.
                    if time.monotonic() >= until:
                        self.log.info("Ray job %s: never submitted", self.submission_id)
                        return
                    await asyncio.sleep(0.5)
        self.log.info("Ray job %s: %s", self.submission_id,
                      "stop requested" if stopped else "was not running")


def _unread_log_bytes() -> int | None:
    """Bytes this process wrote to the triggerer's logs socket that the triggerer has not read; None: no such socket.

    A triggerer's runner process sends its records to the supervisor over a socket, the output of
    its structlog configuration (the Task SDK's `configure_logging(output=...)`); the socket's send
    queue (`SIOCOUTQ`, Linux) holds what the other end has not read yet. Anywhere else (a test, `dag.test()`,
    a platform without the ioctl) there is nothing to wait for.
    """
    try:
        import fcntl
        import termios

        import structlog

        output = getattr(structlog.get_config().get("logger_factory"), "io", None)
        fd = output.fileno() if output is not None else -1
        if fd < 0 or not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return None
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0])
    except Exception:
        return None


async def logs_delivered(timeout: float = LOG_DELIVERY_S) -> bool:
    """Wait (at most `timeout` s) until the triggerer has read every log record this trigger wrote; False if not.

    Airflow 3.3.2's triggerer writes a trigger's records into its task's log only while it knows the
    trigger: its supervisor reads the runner's logs socket 4096 bytes per loop iteration, between
    database round trips (`make_buffered_socket_reader`, `run_once`), and on the runner's report that
    a trigger finished it drops the trigger's file logger (`_handle_request`: `logger_cache.pop`).
    Records still queued then go to the triggerer's own log, not the task's: under load, the lines a
    trigger relayed last (a host's output, printed just before the step's result) were missing from
    the task log. Called before each event: once the queue is empty, everything logged so far is in
    the task's log file. Costs nothing when the triggerer keeps up; one that cannot (its queue never
    empties: other triggers' records count too, the socket tells no more) holds each event `timeout` s.
    """
    until = time.monotonic() + timeout
    while (unread := _unread_log_bytes()):
        if time.monotonic() >= until:
            return False
        await asyncio.sleep(0.05)
    return unread is not None


async def shielded(work: Any) -> Any:
    """Await `work` (a coroutine) to its end although the triggerer cancels again meanwhile.

    Airflow's triggerer cancels a trigger it no longer runs at every sync until it has ended (its
    `to_cancel` set is re-sent), which would cancel an `on_kill` in the middle of asking Airflow or
    of the cleanup it decided on: the work runs shielded, and those repeated cancels are waited out.
    """
    task = asyncio.ensure_future(work)
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                raise


async def task_state(trigger: BaseTrigger, timeout: float, *, about: str) -> str | None:
    """The trigger's task instance's state as Airflow has it now; None without a triggerer to ask.

    Through the triggerer's channel to its supervisor (the Task SDK's `GetTaskStates`, answered
    by the execution API), the way a trigger's `RuntimeTaskInstance.get_task_states` asks. A
    trigger cancelled while its task is still ``deferred`` only moved to another triggerer. When
    asking fails (three tries within `timeout`), `UNKNOWN_STATE`: the caller must not take that
    for a kill, since a moved trigger's job or cluster is still in use.
    """
    ti = getattr(trigger, "task_instance", None)
    try:
        from airflow.sdk.execution_time import task_runner
        from airflow.sdk.execution_time.comms import GetTaskStates, TaskStatesResult
    except ImportError:
        return None
    comms = getattr(task_runner, "SUPERVISOR_COMMS", None)
    if ti is None or comms is None:
        return None
    map_index = ti.map_index if ti.map_index is not None and ti.map_index >= 0 else -1
    ask = GetTaskStates(dag_id=ti.dag_id, run_ids=[ti.run_id], task_ids=[ti.task_id], map_index=map_index)
    for attempt in range(3):
        try:
            answer = await asyncio.wait_for(comms.asend(ask), timeout / 3)
        except Exception as exc:  # an unreachable Airflow must not keep a kill from deciding
            trigger.log.warning("[rayslice] could not ask Airflow for the state of %s: %s", about, exc)
            await asyncio.sleep(0.5 * (attempt + 1))
            continue
        if not isinstance(answer, TaskStatesResult):
            trigger.log.warning("[rayslice] Airflow did not report the state of %s: %s", about, answer)
            continue
        states = [state for tasks in answer.task_states.values() for state in tasks.values()]
        if len(states) == 1 and states[0] is not None:
            return str(states[0])
    return UNKNOWN_STATE
