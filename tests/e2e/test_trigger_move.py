"""A deferred step whose trigger moves to another triggerer runs on (issue 26, item 4).

Airflow 3.3's triggerer cancels every trigger it no longer owns (`update_triggers`: running minus
requested) through the same "user action" path that calls `on_kill()`. A triggerer that missed its
heartbeat (here: SIGSTOPped past `triggerer_health_check_threshold`) loses its triggers to another
one, and once it runs again it cancels them that way. Two real triggerers on the session's Airflow:
the step must finish on its Ray job, and its result must reach XCom.

A trigger moved after the step's result line and before its event (issue 36, item 3): the job's
supervisor is held (SIGSTOP) once its driver printed the result and exited, so Ray still reports the
job running while the holder records how far it relayed, past the result line; the holder is frozen,
the other triggerer takes the trigger over, the supervisor is let go. The step must end with its
result, from its one Ray job.

The trigger that takes over resumes relaying the job's log where its predecessor last recorded it
(an XCom of the task, item 8): the step prints a numbered line every 0.5 s, and no line is lost
while at most the last `CHECKPOINT_S` of them are relayed twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import signal
import sqlite3
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import httpx
import psutil
import pytest
from rayslice.operators.triggers import CHECKPOINT_S, LOG_CHECKPOINT_KEY

from rayslice.client.jobs_client import JobStatus, RayJobsClient
from rayslice.client.submission import jobs_of_task
from rayslice.core.step import Owner
from rayslice.local import processes
from rayslice.local.airflow_stack import _airflow_bin
from rayslice.local.local_cluster import free_port
from tests.airflow_cli import get_json as _get
from tests.conftest import end_sessions, wait_until
from tests.e2e.xcom_backend import parity_xcom

DAG_ID = "sc_moved_trigger"
#: The second triggerer takes over triggers whose triggerer's heartbeat is older than this (default 30 s).
THRESHOLD_S = 10
#: A generous bound for a deferred step to start on a loaded two-core machine (a guard, not a budget).
STEP_START_S = 420

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture
def api(airflow):
    with httpx.Client(base_url=f"{airflow.url}/api/v2", timeout=60,
                      headers={"Authorization": f"Bearer {airflow.api_token()}"}) as client:
        assert wait_until(lambda: _get(client, f"/dags/{DAG_ID}") is not None, timeout=180, interval=1), \
            f"the DAG processor did not register {DAG_ID}"
        yield client


@dataclasses.dataclass
class Moving:
    """A deferred step running on its Ray job, the trigger on one of two triggerers (see `_step_on_two_triggerers`)."""

    run: str
    release: Path  # the step returns once this exists
    sid: str  # its Ray job
    holder: int  # the triggerer job that holds its trigger
    sessions: dict[int, int]  # triggerer job id -> the pid of its process group's leader
    stopped: set[int] = dataclasses.field(default_factory=set)  # pids held with SIGSTOP, let go at the end

    def freeze_holder(self, db: Path) -> None:
        """SIGSTOP the holder's processes, then wait until the other triggerer has taken the trigger over."""
        self.hold(processes.session_members({self.sessions[self.holder]}))
        moved = wait_until(lambda: _holder(db, self.run) not in (None, self.holder), timeout=THRESHOLD_S + 120,
                           interval=0.5)
        assert moved, f"the trigger stayed on triggerer {self.holder}"

    def hold(self, pids: set[int]) -> None:
        self.stopped |= pids
        for pid in pids:
            processes.send_signal(pid, signal.SIGSTOP)

    def let_go(self, pids: set[int] | None = None) -> None:
        pids = set(self.stopped if pids is None else pids)
        _continue(pids)
        self.stopped -= pids


@contextlib.contextmanager
def _step_on_two_triggerers(airflow, api: httpx.Client, jobs: RayJobsClient, tmp_path: Path,
                            prefix: str) -> Iterator[Moving]:
    """A run of the holding step, deferred with its Ray job running, and a second triggerer started.

    At the end, whatever the test did: every held process let go, the step released, the second
    triggerer ended.
    """
    db = Path(airflow.home) / "airflow.db"
    release = tmp_path / "release"
    run = f"{prefix}-{uuid.uuid4().hex[:8]}"
    resp = api.post(f"/dags/{DAG_ID}/dagRuns", json={"dag_run_id": run, "logical_date": None,
                                                      "conf": {"release": str(release)}})
    assert resp.status_code == 200, resp.text
    first = airflow.record.sessions["triggerer"]
    second: subprocess.Popen | None = None
    moving: Moving | None = None
    try:
        holder = wait_until(lambda: _state(api, run) == "deferred" and _holder(db, run), timeout=STEP_START_S,
                            interval=0.5)
        assert holder, f"{run}: not deferred on a triggerer (task {_state(api, run)}, log {_log(airflow, run)})"
        sid = wait_until(lambda: _running_sid(jobs, run), timeout=STEP_START_S, interval=0.5)
        assert sid, f"{run}: no running Ray job"
        before = _triggerers(db)
        second = _start_second_triggerer(first, tmp_path / "triggerer-2.log")
        others = wait_until(lambda: _triggerers(db) - before, timeout=120, interval=0.5)
        assert others, f"the second triggerer did not start:\n{_tail(tmp_path / 'triggerer-2.log')}"
        moving = Moving(run=run, release=release, sid=sid, holder=holder,
                        sessions={holder: first, next(iter(others)): second.pid})
        yield moving
    finally:
        if moving is not None:
            moving.let_go()
        release.touch()
        if second is not None:
            _end(second)


def _ends_with_its_result_from_one_job(airflow, api: httpx.Client, jobs: RayJobsClient, moving: Moving) -> None:
    """The step succeeded with its result, and ran as its one Ray job."""
    run, sid = moving.run, moving.sid
    done = wait_until(lambda: _state(api, run) in ("success", "failed"), timeout=240, interval=1)
    assert done and _state(api, run) == "success", f"task {_state(api, run)}:\n{_log(airflow, run)[-3000:]}"
    assert _xcom(api, run)["value"] == run
    assert jobs.get(sid).status == JobStatus.SUCCEEDED
    ran = jobs_of_task(jobs.list_jobs(), Owner(dag_id=DAG_ID, run_id=run, task_id="step"))
    assert [j.submission_id for j in ran] == [sid], "the step ran as more than one Ray job"
    assert jobs.logs(sid).count("holding the slice until released") == 1


def test_a_trigger_moved_to_another_triggerer_leaves_its_job_running(airflow, api, cluster, tmp_path):
    db = Path(airflow.home) / "airflow.db"
    with RayJobsClient(cluster.dashboard_url, token=cluster.token) as jobs, \
            _step_on_two_triggerers(airflow, api, jobs, tmp_path, "mv") as moving:
        run, sid = moving.run, moving.sid
        status = jobs.get(sid).status
        assert status == JobStatus.RUNNING, f"Ray job {sid} is {status} already:\n{_log(airflow, run)[-3000:]}"
        # Past one checkpoint interval of lines relayed before the move, so a restart from the start shows.
        ticks = int(2 * CHECKPOINT_S / 0.5) + 2
        assert wait_until(lambda: f"tick {ticks}" in _log(airflow, run), timeout=120, interval=0.5), _log(airflow, run)
        # The holder misses its heartbeats until the other triggerer has taken the trigger over.
        moving.freeze_holder(db)
        moving.let_go()
        # Back, the old triggerer cancels the trigger it no longer owns, "by user action".
        cancelled = wait_until(lambda: "Trigger cancelled by user action" in _log(airflow, run), timeout=120,
                               interval=0.5)
        assert cancelled, f"the old triggerer did not cancel its trigger:\n{_log(airflow, run)[-3000:]}"
        assert wait_until(lambda: "trigger completed" in _log(airflow, run), timeout=60, interval=0.5)
        assert f"Ray job {sid}: stop requested" not in _log(airflow, run), "on_kill stopped the job"
        status = jobs.get(sid).status
        assert status == JobStatus.RUNNING, f"Ray job {sid} is {status} after the trigger moved"

        moving.release.touch()
        _ends_with_its_result_from_one_job(airflow, api, jobs, moving)
        assert "moved to another triggerer" in _log(airflow, run)
        _assert_relayed_once(_log(airflow, run))


def test_a_trigger_moved_after_the_result_line_ends_the_step_with_its_result(airflow, api, cluster, tmp_path):
    db = Path(airflow.home) / "airflow.db"
    with RayJobsClient(cluster.dashboard_url, token=cluster.token) as jobs, \
            _step_on_two_triggerers(airflow, api, jobs, tmp_path, "mr") as moving:
        run, sid = moving.run, moving.sid
        # The driver prints the result and exits; its supervisor, held, cannot report the end.
        supervisor = psutil.Process(_supervisor(cluster, sid))
        held = {supervisor.pid}
        moving.hold(held)
        moving.release.touch()
        assert wait_until(lambda: _driver_exited(supervisor), timeout=120, interval=0.5), \
            "the step's driver did not exit"
        assert jobs.get(sid).status == JobStatus.RUNNING
        size = len(jobs.logs(sid))
        # The holder recorded how far it relayed: past the result line, the driver's last.
        assert wait_until(lambda: _recorded_offset(db, run) >= size, timeout=120, interval=0.5), \
            f"no record past the result line ({_recorded_offset(db, run)} < {size}):\n{_log(airflow, run)[-3000:]}"
        moving.freeze_holder(db)
        assert wait_until(lambda: re.search(r"resuming the log of Ray job \S+ at character", _log(airflow, run)),
                          timeout=120, interval=0.5), _log(airflow, run)[-3000:]
        moving.let_go(moving.stopped - held)
        # Back, the old triggerer cancels its trigger before the job's end could reach it.
        assert wait_until(lambda: "Trigger cancelled by user action" in _log(airflow, run), timeout=120,
                          interval=0.5), f"no cancel by the old triggerer:\n{_log(airflow, run)[-3000:]}"
        moving.let_go(held)
        _ends_with_its_result_from_one_job(airflow, api, jobs, moving)


def test_a_trigger_moved_while_it_pushes_the_result_ends_the_step_with_it_once(airflow, api, cluster, tmp_path):
    """Item 3's third moment: the holder is frozen inside the result's XCom push (the session's XCom
    backend holds a `pt-` run's first `return_value` push until told, `parity_xcom.held_push`)."""
    db = Path(airflow.home) / "airflow.db"
    with RayJobsClient(cluster.dashboard_url, token=cluster.token) as jobs, \
            _step_on_two_triggerers(airflow, api, jobs, tmp_path, parity_xcom.HELD_RUN_PREFIX) as moving:
        run = moving.run
        pushing, go = parity_xcom.held_push_files(run, airflow.home)
        try:
            moving.release.touch()
            assert wait_until(pushing.exists, timeout=180, interval=0.5), \
                f"the result's push did not start:\n{_log(airflow, run)[-3000:]}"
            assert _state(api, run) == "deferred"
            moving.freeze_holder(db)
            # The trigger that took over pushes the result (the backend holds only the first push) and ends the step.
            _ends_with_its_result_from_one_job(airflow, api, jobs, moving)
            ended = _trigger_log(airflow, run, moving.holder).count("trigger completed")
            moving.let_go()
        finally:
            go.touch()  # the frozen push completes (after the step's end: it writes the same value)
        # Let go, the old triggerer either cancels the trigger it no longer owns, or its held push goes on (the
        # same value) and it fires an event for a task that has ended (whichever its loop reaches first): neither
        # may change how the step ended, nor start its job again. Either way its trigger then ends, and says so
        # in that triggerer's own log once whatever it did is done (an event it fired after that only resumes a
        # task still deferred on it: Airflow's `Trigger.submit_event`, and this one has ended).
        assert wait_until(lambda: _trigger_log(airflow, run, moving.holder).count("trigger completed") > ended,
                          timeout=120, interval=0.5), \
            f"the old triggerer's trigger did not end:\n{_trigger_log(airflow, run, moving.holder)[-3000:]}"
        assert _state(api, run) == "success" and _xcom(api, run)["value"] == run, \
            f"the old triggerer changed the step's end:\n{_log(airflow, run)[-3000:]}"
        ran = jobs_of_task(jobs.list_jobs(), Owner(dag_id=DAG_ID, run_id=run, task_id="step"))
        assert [j.submission_id for j in ran] == [moving.sid], "the step ran as more than one Ray job"


# ---------------------------------------------------------------- helpers


def _supervisor(cluster, sid: str) -> int:
    """The pid of the job's supervisor actor (Ray's state API), the parent of its driver."""
    resp = httpx.get(f"{cluster.dashboard_url}/api/v0/actors", timeout=60,
                     headers={"Authorization": f"Bearer {cluster.token}"} if cluster.token else {},
                     params={"detail": 1, "filter_keys": "name", "filter_predicates": "=",
                             "filter_values": f"_ray_internal_job_actor_{sid}"})
    resp.raise_for_status()
    found = resp.json()["data"]["result"]["result"]
    live = [int(a["pid"]) for a in found if a.get("pid") and psutil.pid_exists(int(a["pid"]))]
    assert len(live) == 1, f"Ray job {sid}: supervisors {found}"
    return live[0]


def _driver_exited(supervisor: psutil.Process) -> bool:
    """The job's driver (`python -m rayslice.cluster`, under the supervisor) exited: gone, or a zombie."""
    def driver(proc: psutil.Process) -> bool:
        try:
            return "rayslice.cluster" in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False
    try:
        return not any(driver(child) for child in supervisor.children(recursive=True))
    except psutil.NoSuchProcess:
        return True


def _recorded_offset(db: Path, run: str) -> int:
    """The offset in the step's log checkpoint XCom (`LOG_CHECKPOINT_KEY`), 0 without one."""
    rows = _query(db, "SELECT value FROM xcom WHERE dag_id = ? AND run_id = ? AND task_id = 'step' AND key = ?",
                  DAG_ID, run, LOG_CHECKPOINT_KEY)
    value = rows[0][0] if rows else None
    while isinstance(value, (str, bytes)):
        value = json.loads(value)
    return int(value.get("offset") or 0) if isinstance(value, dict) else 0



def _assert_relayed_once(log: str) -> None:
    """Every `tick <n>` line is in the task's logs, and few twice: the new trigger resumed at the recorded offset."""
    ticks = [int(n) for n in re.findall(r"\btick (\d+)\b", log)]
    assert ticks and sorted(set(ticks)) == list(range(1, max(ticks) + 1)), "a line of the job's log was lost"
    twice = sorted({n for n in ticks if ticks.count(n) > 1})
    # Lines since the last record before the freeze (one every CHECKPOINT_S) come again, and a few in flight.
    assert len(twice) <= CHECKPOINT_S / 0.5 + 6, f"{len(twice)} lines relayed twice: {twice}"
    assert re.search(r"resuming the log of Ray job \S+ at character \d+", log), \
        "the trigger that took over did not resume from its predecessor's record"


def _start_second_triggerer(first: int, log: Path) -> subprocess.Popen:
    """`airflow triggerer` with the session triggerer's settings, its own log server port, a short threshold."""
    env = psutil.Process(first).environ() | {
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": str(THRESHOLD_S),
    }
    with open(log, "ab") as out:
        return subprocess.Popen([_airflow_bin(), "triggerer"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _end(proc: subprocess.Popen) -> None:
    """SIGTERM (the triggerer ends its job row and hands its triggers back), then whatever is left: SIGKILL."""
    processes.send_signal(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    end_sessions(proc)


def _continue(pids: set[int]) -> None:
    for pid in pids:
        processes.send_signal(pid, signal.SIGCONT)


def _query(db: Path, sql: str, *args) -> list[tuple]:
    """A read of the stack's metadata DB (WAL: never blocks its writers)."""
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as conn:
            return conn.execute(sql, args).fetchall()
    except sqlite3.OperationalError:
        return []


def _holder(db: Path, run: str) -> int | None:
    """The id of the triggerer job that holds the task's trigger."""
    rows = _query(db, "SELECT t.triggerer_id FROM task_instance ti JOIN trigger t ON t.id = ti.trigger_id "
                      "WHERE ti.dag_id = ? AND ti.run_id = ? AND ti.task_id = 'step'", DAG_ID, run)
    return rows[0][0] if rows and rows[0][0] is not None else None


def _triggerers(db: Path) -> set[int]:
    """Ids of the triggerer jobs that have started and not ended (a SIGKILLed one stays here: compare sets)."""
    rows = _query(db, "SELECT id FROM job WHERE job_type = 'TriggererJob' AND end_date IS NULL AND state = 'running'")
    return {row[0] for row in rows}


def _running_sid(jobs: RayJobsClient, run: str) -> str | None:
    found = [j for j in jobs_of_task(jobs.list_jobs(), Owner(dag_id=DAG_ID, run_id=run, task_id="step"))
             if j.status == JobStatus.RUNNING]
    return found[0].submission_id if found else None




def _state(api: httpx.Client, run: str) -> str | None:
    return (_get(api, f"/dags/{DAG_ID}/dagRuns/{run}/taskInstances/step") or {}).get("state")


def _xcom(api: httpx.Client, run: str):
    entry = _get(api, f"/dags/{DAG_ID}/dagRuns/{run}/taskInstances/step/xcomEntries/return_value")
    assert entry is not None, f"no XCom for {DAG_ID}/{run}"
    value = entry["value"]
    return json.loads(value) if isinstance(value, str) else value


def _log(airflow, run: str) -> str:
    """The task's logs: the worker's and each triggerer's (`….log.trigger.<job id>.log`)."""
    files = sorted((Path(airflow.home) / "logs").glob(f"dag_id={DAG_ID}/run_id={run}/task_id=step/*"))
    return "\n".join(f.read_text(errors="replace") for f in files if f.is_file())


def _trigger_log(airflow, run: str, triggerer: int) -> str:
    """The task's log as triggerer job `triggerer` wrote it (`….log.trigger.<job id>.log`), "" before it wrote one."""
    folder = Path(airflow.home) / "logs" / f"dag_id={DAG_ID}" / f"run_id={run}" / "task_id=step"
    files = sorted(folder.glob(f"*.trigger.{triggerer}.log"))
    return "\n".join(f.read_text(errors="replace") for f in files if f.is_file())


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"
