"""A trigger's last log lines reach its task's log: Airflow 3.3.2's triggerer can drop them (no cluster).

The triggerer's runner subprocess writes every trigger's records, as JSON lines, to one logs socket;
its supervisor reads that socket 4096 bytes per loop iteration, between database round trips, and
writes each record into the log file of the record's trigger. When it handles the runner's report
that a trigger finished, it drops that trigger's file logger: records still queued in the socket go
to the triggerer's own log instead. Seen in tests/e2e/test_trigger_parity.py under load: a host's
`@@ echo` line, relayed just before the step's event, missing from the task log. Here the real
Airflow code (the supervisor's reader, `make_buffered_socket_reader`, `_handle_request`) is fed by
a trigger whose logger writes to the socket as the runner's does, with other triggers' records
queued ahead: the report is handled once the event is out, as the runner reports it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import socket
import subprocess
import sys
import types
from collections import deque

import pytest
import structlog
from airflow.jobs.triggerer_job_runner import TriggerLoggingFactory, TriggerRunnerSupervisor, messages
from airflow.sdk._shared.logging.structlog import LoggerFactory, NamedBytesLogger
from airflow.sdk.execution_time.supervisor import make_buffered_socket_reader
from airflow.triggers.base import TaskSuccessEvent, TriggerEvent
from rayslice.operators.start_trigger import RayStepStartTrigger
from rayslice.operators.triggers import RayStepTrigger, logs_delivered

HOST_LINE = "(echo/host0 pid=123) @@ echo 2-from-conf"
OURS, OTHER = 7, 8


class _Supervisor(TriggerRunnerSupervisor):
    """The triggerer's supervisor without its process and database: its log routing only."""

    def send_msg(self, *args, **kwargs) -> None:  # the reply to the runner: not needed here
        pass


def _supervisor(tmp_path) -> _Supervisor:
    sup = object.__new__(_Supervisor)
    fields = {"running_triggers": {OURS, OTHER}, "cancelling_triggers": set(), "creating_triggers": deque(),
              "events": deque(), "persisted_event_seqs": deque(), "failed_triggers": deque(), "logger_cache": {},
              "_last_runner_comms": 0.0}
    for name, value in fields.items():
        object.__setattr__(sup, name, value)
    for trigger_id in (OURS, OTHER):
        sup.logger_cache[trigger_id] = TriggerLoggingFactory(
            log_path=str(tmp_path / f"task{trigger_id}.log.trigger.1.log"), ti=types.SimpleNamespace())
    return sup


class _HostLineTrigger(RayStepTrigger):
    """Relays a host's line, then the step's end: what `_follow_job` does last (the Ray job itself is not needed)."""

    async def _follow_job(self):
        self.log.info(HOST_LINE)
        yield self._event("success", len(HOST_LINE) + 1, log_complete=True, result=["x", "2-from-conf"])


class _HostLineStartTrigger(RayStepStartTrigger):
    """The same for a step started in the triggerer (the default): built, submitted, followed, the task ended."""

    async def _build(self):
        return None, None

    async def _submit_and_follow(self, operator, spec):
        self.log.info(HOST_LINE)
        self.log.info("[rayslice] Ray job sid-1 succeeded")
        yield TaskSuccessEvent()


def _other_records(count: int) -> bytes:
    """Another trigger's records, as the runner writes them (~400 bytes each with their context)."""
    return b"".join((json.dumps({"timestamp": "2026-12-06T19:00:00Z", "level": "info", "trigger_id": OTHER,
                                 "event": f"(double/host0 pid=1) line {i}", "dag_id": "tp_trigger",
                                 "run_id": "tp-trigger-1796583867642225015", "task_id": "group.double",
                                 "map_index": 0, "try_number": 1, "ti_id": "01a24cbe-a39e-7304-b574-95bde4cb5606",
                                 "logger": "rayslice.operators.start_trigger.RayStepStartTrigger"}) + "\n").encode()
                    for i in range(count))


@pytest.mark.parametrize("make", [lambda: _HostLineTrigger(ray_conn_id="ray_default", submission_id="sid-1"),
                                  lambda: _HostLineStartTrigger()], ids=["deferred", "started_in_triggerer"])
async def test_a_host_line_logged_just_before_the_event_is_in_the_task_log(tmp_path, make):
    runner_end, supervisor_end = socket.socketpair()
    channel = os.fdopen(os.dup(runner_end.fileno()), "wb", buffering=0)  # the runner's logs channel
    saved, root_handlers, root_level = structlog.get_config(), logging.root.handlers[:], logging.root.level
    sup = _supervisor(tmp_path)  # its reader configures logging for the supervisor's process: first
    reader, _ = make_buffered_socket_reader(sup._process_log_messages_from_subprocess(), on_close=lambda s: None)
    supervisor_config = structlog.get_config()  # where its own records go (`fallback_log`)
    structlog.configure(  # as the runner's `configure_logging(json_output=True, output=channel)`, in short
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer(serializer=lambda obj, **kw: json.dumps(obj).encode())],
        logger_factory=LoggerFactory(NamedBytesLogger, io=channel), cache_logger_on_first_use=False)
    try:
        channel.write(_other_records(40))  # queued ahead, as other triggers' lines are under load
        trigger = make()

        async def run() -> TriggerEvent:
            structlog.contextvars.bind_contextvars(trigger_id=OURS)  # as the runner's `run_trigger` binds it
            return await anext(trigger.run())

        running = asyncio.ensure_future(run())
        while not running.done():  # the supervisor's iterations: one read of the logs socket each
            await asyncio.sleep(0.01)
            if select.select([supervisor_end], [], [], 0)[0]:
                reader(supervisor_end)
        event = running.result()
        structlog.configure(**supervisor_config)  # the two processes' logging, apart again
        # The runner reports the trigger finished at its next sync, after the event.
        sup._handle_request(messages.TriggerStateChanges(events=None, finished=[OURS]), log=structlog.get_logger(),
                            req_id=1)
        channel.close()
        runner_end.close()
        while reader(supervisor_end):  # later iterations read what is left
            pass
    finally:
        structlog.configure(**saved)
        logging.root.handlers[:], logging.root.level = root_handlers, root_level
        supervisor_end.close()
    assert isinstance(event, TaskSuccessEvent) or event.payload["status"] == "success"
    task_log = tmp_path / f"task{OURS}.log.trigger.1.log"
    relayed = [json.loads(line)["event"] for line in task_log.read_text().splitlines()] if task_log.exists() else []
    assert HOST_LINE in relayed, relayed


async def test_outside_a_triggerer_nothing_is_waited_for():
    """No logs socket (tests, `dag.test()`): an event is not held."""
    assert await logs_delivered(timeout=30) is False


async def test_a_triggerer_that_reads_nothing_holds_the_event_no_longer_than_the_bound():
    runner_end, supervisor_end = socket.socketpair()
    channel = os.fdopen(os.dup(runner_end.fileno()), "wb", buffering=0)
    saved = structlog.get_config()
    structlog.configure(logger_factory=LoggerFactory(NamedBytesLogger, io=channel), cache_logger_on_first_use=False)
    try:
        channel.write(_other_records(3))
        assert await logs_delivered(timeout=0.2) is False  # unread: given up after the bound
        supervisor_end.recv(1 << 20)
        assert await logs_delivered(timeout=30) is True  # read: at once
    finally:
        structlog.configure(**saved)
        channel.close()
        runner_end.close()
        supervisor_end.close()


def test_the_triggerer_runners_log_channel_is_found(tmp_path):
    """Set up as Airflow's triggerer runner process sets up its logging (in a process of its own)."""
    script = tmp_path / "runner.py"
    script.write_text(
        "import asyncio, os, socket\n"
        "from airflow.sdk.execution_time.supervisor import _configure_logs_over_json_channel\n"
        "child, parent = socket.socketpair()\n"
        "_configure_logs_over_json_channel(os.dup(child.fileno()))\n"
        "import structlog\n"
        "from rayslice.operators.triggers import _unread_log_bytes, logs_delivered\n"
        "structlog.get_logger('t').info('@@ echo')\n"
        "queued = _unread_log_bytes()\n"
        "assert queued and asyncio.run(logs_delivered(timeout=0.2)) is False, queued\n"
        "assert b'@@ echo' in parent.recv(1 << 20)\n"
        "assert _unread_log_bytes() == 0 and asyncio.run(logs_delivered(timeout=30)) is True\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
