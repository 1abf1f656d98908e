"""Faults from outside, on real processes: a killed host, a killed coordinator, a dashboard that goes away
(at submit time and while a step runs), a crashed triggerer, and a token-auth cluster end to end.

Every scenario checks what the issue asks of a fault: the step ends (or the follower gives up with an
error naming the job) within 30 s of the fault, every chip and GPU is free again, and no placement group,
actor or running job of ours is left. Killed and cut are real: SIGKILL of the host's own worker process,
a TCP proxy (`proxy.py`) whose listener closes, a triggerer whose whole process session is SIGKILLed.

Already covered elsewhere and not repeated: a host's step raising or exiting, preemption, step and
capacity timeouts (tests/rayslice/launcher), task kills and execution_timeout (tests/e2e).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest

from rayslice.client import capacity
from rayslice.client.jobs_client import AsyncRayJobsClient, JobStatus, RayJobsClient
from rayslice.client.submission import JobFollow, submission_id, submit_step, wait_for_step
from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.exceptions import (
    HostLostError,
    JobNotFoundError,
    RayAuthError,
    RayUnreachableError,
    StepFailedError,
)
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster
from rayslice.local.airflow_stack import AirflowStack
from tests.airflow_env import ray_connection_json
from tests.conftest import TOTAL_TPU_CHIPS, rayslice_home, wait_until
from tests.faults.http_proxy import NoWebsocketProxy
from tests.faults.proxy import FaultProxy

FAULT_BOUND_S = 30.0  # the must-hold: the step ends, and everything is free, this soon after the fault
STEP_START_S = 180  # a generous deadline for a step to start on a loaded two-core machine
DAGS = Path(__file__).parents[1] / "e2e" / "dags"

pytestmark = pytest.mark.timeout(420)


# ---------------------------------------------------------------- steps (run on the cluster)


def allgather_until_killed(folder: str):
    """Every host joins the JAX group, says its PID, then runs collectives until a peer is killed."""
    import os
    import pathlib
    import time

    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    multihost_utils.process_allgather(jnp.ones(1))  # the whole group is up
    pathlib.Path(folder, f"host{os.environ['TPU_WORKER_ID']}.pid").write_text(str(os.getpid()))
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        multihost_utils.process_allgather(jnp.ones(1))
        time.sleep(0.05)
    return "never killed"


def hold_until_released(folder: str, name: str):
    import pathlib
    import time

    pathlib.Path(folder, name).touch()
    deadline = time.monotonic() + 240
    while not pathlib.Path(folder, f"{name}.release").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("never released")
        time.sleep(0.1)
    return f"{name} released"


# ---------------------------------------------------------------- helpers


def _owner(task_id: str) -> Owner:
    """An Airflow-like try (its own task-instance id), with the submission id it will get."""
    owner = Owner(dag_id="faults", run_id=f"r{time.time_ns()}", task_id=task_id, try_number=1,
                  ti_id=str(uuid.uuid4()))
    return owner.model_copy(update={"submission_id": submission_id(owner)})


def _state(url: str, token: str | None, kind: str) -> list[dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    resp = httpx.get(f"{url}/api/v0/{kind}", params={"detail": "1", "limit": "10000"}, headers=headers, timeout=30)
    resp.raise_for_status()
    return resp.json()["data"]["result"]["result"]


def leftovers(url: str, token: str | None, sid: str) -> list[str]:
    """Placement groups and actors named after our job that Ray still holds, and the job if it still runs."""
    prefix = f"rayslice:{sid}"
    found = [f"placement group {g['name']} {g['state']}" for g in _state(url, token, "placement_groups")
             if g["name"].startswith(prefix) and g["state"] != "REMOVED"]
    found += [f"actor {a['name']} {a['state']}" for a in _state(url, token, "actors")
              if (a.get("name") or "").startswith(prefix) and a["state"] != "DEAD"]
    with RayJobsClient(url, token=token) as client:
        found += [f"job {j.submission_id} {j.status}" for j in client.list_jobs()
                  if j.submission_id == sid and not j.is_terminal]
    return found


def all_free(ray_driver) -> bool:
    free = ray_driver.available_resources()
    return free.get("TPU", 0) == TOTAL_TPU_CHIPS and free.get("GPU", 0) == 3.0


def jobs_named(url: str, token: str | None, sid: str) -> list:
    with RayJobsClient(url, token=token) as client:
        return [j for j in client.list_jobs() if j.submission_id == sid]


async def _wait_files(folder: Path, names: list[str], client: AsyncRayJobsClient, sid: str) -> None:
    """Wait for the step to write `names`, failing at once (with the job's log) if the job ends first."""
    deadline = time.monotonic() + STEP_START_S
    while not all((folder / name).exists() for name in names):
        job = await client.get(sid)
        if job.is_terminal or time.monotonic() > deadline:
            raise AssertionError(f"job {sid} is {job.status} before {names} appeared:\n{await client.logs(sid)}")
        await asyncio.sleep(0.2)


async def _stop_if_running(client: AsyncRayJobsClient, sid: str) -> None:
    """A failed test must not leave its job holding capacity for the next one."""
    try:
        if not (await client.get(sid)).is_terminal:
            await client.stop(sid)
    except JobNotFoundError:
        pass


def _ray_worker(pid: int) -> bool:
    """Only a Ray worker process is ever killed here (its title is `ray::...`)."""
    try:
        return " ".join(psutil.Process(pid).cmdline()).startswith("ray::")
    except psutil.Error:
        return False


# ---------------------------------------------------------------- 1, 2: a host killed from outside


@pytest.mark.parametrize("victim", [2, 0], ids=["host2", "coordinator-host0"])
async def test_a_host_killed_mid_collective_fails_the_step_and_frees_the_slice(cluster, ray_driver, tmp_path,
                                                                               victim):
    """SIGKILL one host's process of a v6e-16 while the gang is in collectives (worker 0 is JAX's coordinator)."""
    owner = _owner(f"kill-host{victim}")
    sid = owner.submission_id
    spec = StepSpec.for_function(allgather_until_killed, request=TpuSliceRequest(tpu="v6e-16"),
                                 kwargs={"folder": str(tmp_path)}, owner=owner, capacity_timeout=STEP_START_S)
    lines: list[str] = []
    async with AsyncRayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
        try:
            await submit_step(client, spec)
            await _wait_files(tmp_path, [f"host{w}.pid" for w in range(4)], client, sid)
            pid = int((tmp_path / f"host{victim}.pid").read_text())
            assert _ray_worker(pid), f"PID {pid} is not a Ray worker"
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(StepFailedError) as info:
                await wait_for_step(client, sid, emit=lines.append, poll=0.2)
            ended = time.monotonic() - killed
        finally:
            await _stop_if_running(client, sid)
    clean = wait_until(lambda: all_free(ray_driver) and not leftovers(cluster.dashboard_url, cluster.token, sid),
                       timeout=max(0.5, FAULT_BOUND_S - (time.monotonic() - killed)), interval=0.2)
    freed = time.monotonic() - killed
    first_line = str(info.value).splitlines()[0]
    print(f"\n[faults] SIGKILL host{victim} -> step failed {ended:.1f} s, all free {freed:.1f} s: "
          f"{type(info.value).__name__}: {first_line}")
    assert ended <= FAULT_BOUND_S, f"the step ended {ended:.1f} s after the kill"
    assert clean, (f"{freed:.1f} s after the kill: TPU {ray_driver.available_resources().get('TPU')}, "
                   f"left: {leftovers(cluster.dashboard_url, cluster.token, sid)}")
    assert [j.status for j in jobs_named(cluster.dashboard_url, cluster.token, sid)] == [JobStatus.FAILED]
    named = isinstance(info.value, HostLostError) and re.search(
        rf"host v6e-16-\w+/host{victim} \(slice 0, worker {victim},", first_line)
    assert named, f"the error must name the killed host{victim}: {type(info.value).__name__}: {first_line[:300]}"


# ---------------------------------------------------------------- 3: the dashboard unreachable at submit time


async def test_submit_waits_out_a_dashboard_outage_and_never_submits_twice(cluster, ray_driver, tmp_path, caplog):
    """Refused for 3 s, then the submission's own answer is lost: retried with backoff, one job, step succeeds."""
    proxy = FaultProxy(cluster.dashboard_url).up()
    proxy.down()
    owner = _owner("submit-outage")
    sid = owner.submission_id
    spec = StepSpec.for_function(hold_until_released, request=AcceleratorRequest(resource="GPU", count=0.25),
                                 kwargs={"folder": str(tmp_path), "name": "outage"}, owner=owner)
    caplog.set_level(logging.WARNING, logger="rayslice.client.jobs_client")
    try:
        # Six attempts, 0.5 s doubling: a 15 s budget, for an outage of 3 s.
        async with AsyncRayJobsClient(proxy.url, retries=6, backoff=0.5) as client:
            submitting = asyncio.ensure_future(submit_step(client, spec))
            await asyncio.sleep(3)
            assert not submitting.done(), "submit gave up (or got through) while the dashboard was unreachable"
            lost = proxy.lose_next_response()
            proxy.up()
            assert await asyncio.wait_for(submitting, 30) == sid
            assert lost.is_set(), "the proxy never saw the submission"
            await _wait_files(tmp_path, ["outage"], client, sid)
            (tmp_path / "outage.release").touch()
            assert await asyncio.wait_for(wait_for_step(client, sid, emit=lambda _: None, poll=0.2), 60) == \
                "outage released"
    finally:
        proxy.down()
        (tmp_path / "outage.release").touch()
    delays = [float(d) for d in re.findall(r"retrying in ([\d.]+)s", caplog.text)]
    assert len(delays) >= 3 and delays[:3] == [0.5, 1.0, 2.0], caplog.text  # backoff while refused
    assert "failed (ConnectError" in caplog.text and "failed (RemoteProtocolError" in caplog.text, caplog.text
    assert [j.status for j in jobs_named(cluster.dashboard_url, cluster.token, sid)] == [JobStatus.SUCCEEDED]
    assert wait_until(lambda: all_free(ray_driver) and not leftovers(cluster.dashboard_url, cluster.token, sid),
                      timeout=FAULT_BOUND_S)


async def test_submit_to_a_dashboard_that_stays_down_names_it_and_submits_nothing(cluster, tmp_path):
    proxy = FaultProxy(cluster.dashboard_url).up()
    proxy.down()
    owner = _owner("submit-down")
    spec = StepSpec.for_function(hold_until_released, request=AcceleratorRequest(resource="GPU", count=0.25),
                                 kwargs={"folder": str(tmp_path), "name": "never"}, owner=owner)
    started = time.monotonic()
    async with AsyncRayJobsClient(proxy.url) as client:  # the defaults: 3 attempts, 0.5 s then 1 s apart
        with pytest.raises(RayUnreachableError) as info:
            await submit_step(client, spec)
    took = time.monotonic() - started
    assert f"could not reach the Ray dashboard at {proxy.url} after 3 attempts" in str(info.value)
    assert "ConnectError" in str(info.value) and "check the `ray` connection's host" in str(info.value)
    assert 1.5 <= took <= FAULT_BOUND_S, f"gave up after {took:.1f} s"
    with RayJobsClient(cluster.dashboard_url, token=cluster.token) as direct, pytest.raises(JobNotFoundError):
        direct.get(owner.submission_id)


# ---------------------------------------------------------------- 4: the dashboard unreachable while the step runs


def _held_step_behind_a_proxy(cluster, monkeypatch, tmp_path, name: str) -> tuple[FaultProxy, str, StepSpec]:
    """A quarter-GPU step that holds until released, and a `ray_faults_proxy` connection through a cuttable proxy."""
    proxy = FaultProxy(cluster.dashboard_url).up()
    monkeypatch.setenv("AIRFLOW_CONN_RAY_FAULTS_PROXY", json.dumps({"conn_type": "ray", "host": proxy.url}))
    owner = _owner(name)
    spec = StepSpec.for_function(hold_until_released, request=AcceleratorRequest(resource="GPU", count=0.25),
                                 kwargs={"folder": str(tmp_path), "name": "step"}, owner=owner)
    return proxy, owner.submission_id, spec


async def test_followers_wait_out_a_dashboard_outage_during_the_step(cluster, ray_driver, tmp_path, monkeypatch):
    """The Airflow trigger and `wait_for_step` both follow one job through a proxy cut for several of their polls."""
    from rayslice.operators.triggers import RayStepTrigger

    refused: dict[int, int] = {}  # follower -> status polls the cut dashboard did not answer
    real_get = JobFollow._get

    async def counted_get(self):
        job = await real_get(self)
        if job is None:
            refused[id(self)] = refused.get(id(self), 0) + 1
        return job

    monkeypatch.setattr(JobFollow, "_get", counted_get)

    async def both_refused(times: int) -> None:
        while len(refused) < 2 or min(refused.values()) < times:
            await asyncio.sleep(0.1)

    proxy, sid, spec = _held_step_behind_a_proxy(cluster, monkeypatch, tmp_path, "follow-outage")
    try:
        async with AsyncRayJobsClient(proxy.url) as client:
            await submit_step(client, spec)
            trigger = RayStepTrigger(ray_conn_id="ray_faults_proxy", submission_id=sid, poll_interval=0.5)
            by_trigger = asyncio.ensure_future(anext(trigger.run()))
            by_waiter = asyncio.ensure_future(wait_for_step(client, sid, emit=lambda _: None, poll=0.5))
            await _wait_files(tmp_path, ["step"], client, sid)
            proxy.down()
            refused.clear()
            await asyncio.wait_for(both_refused(2), FAULT_BOUND_S)  # several polls of each, all refused
            assert not by_trigger.done() and not by_waiter.done(), (by_trigger, by_waiter)
            proxy.up()
            (tmp_path / "step.release").touch()
            released = time.monotonic()
            event = await asyncio.wait_for(by_trigger, FAULT_BOUND_S)
            result = await asyncio.wait_for(by_waiter, FAULT_BOUND_S)
            took = time.monotonic() - released
    finally:
        proxy.down()
        (tmp_path / "step.release").touch()
    assert event.payload["status"] == "success" and event.payload["result"] == "step released", event.payload
    assert result == "step released"
    assert took <= FAULT_BOUND_S
    assert [j.status for j in jobs_named(cluster.dashboard_url, cluster.token, sid)] == [JobStatus.SUCCEEDED]
    assert wait_until(lambda: all_free(ray_driver) and not leftovers(cluster.dashboard_url, cluster.token, sid),
                      timeout=FAULT_BOUND_S)


async def test_followers_give_up_on_a_dashboard_that_stays_down_naming_the_job(cluster, ray_driver, tmp_path,
                                                                               monkeypatch):
    """Past their grace (shortened to 4 s here) both followers fail with the job's id and the URL; the job runs on."""
    from rayslice.operators import triggers

    monkeypatch.setattr(triggers, "UNREACHABLE_GRACE_S", 4.0)
    proxy, sid, spec = _held_step_behind_a_proxy(cluster, monkeypatch, tmp_path, "follow-down")
    try:
        async with AsyncRayJobsClient(proxy.url) as client:
            await submit_step(client, spec)
            trigger = triggers.RayStepTrigger(ray_conn_id="ray_faults_proxy", submission_id=sid, poll_interval=0.5)
            by_trigger = asyncio.ensure_future(anext(trigger.run()))
            by_waiter = asyncio.ensure_future(
                wait_for_step(client, sid, emit=lambda _: None, poll=0.5, unreachable_grace=4.0))
            await _wait_files(tmp_path, ["step"], client, sid)
            proxy.down()
            cut = time.monotonic()
            event = await asyncio.wait_for(by_trigger, FAULT_BOUND_S)
            with pytest.raises(RayUnreachableError) as info:
                await asyncio.wait_for(by_waiter, FAULT_BOUND_S)
            took = time.monotonic() - cut
        # The job is accounted for: one job under its id, still running, and ours to stop.
        assert [j.status for j in jobs_named(cluster.dashboard_url, cluster.token, sid)] == [JobStatus.RUNNING]
    finally:
        proxy.down()
        with RayJobsClient(cluster.dashboard_url, token=cluster.token) as direct:
            direct.stop(sid)  # the job's end frees its GPU share
    assert took <= FAULT_BOUND_S, f"the followers gave up {took:.1f} s after the cut"
    assert event.payload["status"] == "error" and event.payload["error_type"] == "RayUnreachableError", event.payload
    for message in (event.payload["message"], str(info.value)):
        assert sid in message and proxy.url in message, message
    assert "may still be running" in str(info.value)
    assert wait_until(lambda: all_free(ray_driver) and not leftovers(cluster.dashboard_url, cluster.token, sid),
                      timeout=FAULT_BOUND_S)
    assert [j.status for j in jobs_named(cluster.dashboard_url, cluster.token, sid)] == [JobStatus.STOPPED]


# ---------------------------------------------------------------- a proxy that does not pass websockets


async def test_the_trigger_completes_behind_a_proxy_that_refuses_websockets(cluster, monkeypatch):
    """The log tail's upgrade answered 400: the trigger follows by polling; the result and every line come back."""
    from rayslice.operators.triggers import RayStepTrigger

    from tests.operators.test_triggers import _relayed_by
    from tests.rayslice.client.test_log_stream import chatty_job, expected, payload

    with NoWebsocketProxy(cluster.dashboard_url, websockets="400") as proxy:
        monkeypatch.setenv("AIRFLOW_CONN_RAY_NO_WEBSOCKETS", ray_connection_json(proxy.url, cluster.token))
        async with AsyncRayJobsClient(proxy.url, token=cluster.token) as client:
            sid = await client.submit(chatty_job(), submission_id=f"rsls-nows-trigger-{uuid.uuid4().hex[:8]}")
        trigger = RayStepTrigger(ray_conn_id="ray_no_websockets", submission_id=sid, poll_interval=0.5)
        relayed = _relayed_by(trigger)
        event = await asyncio.wait_for(anext(trigger.run()), 300)
    assert event.payload["status"] == "success", event.payload
    assert event.payload["result"] == 42 and event.payload["log_complete"] is True
    assert payload(relayed.lines) == expected()
    assert proxy.bytes_of(f"/api/jobs/{sid}/logs") == 0  # never the whole log
    assert any(path.startswith("/api/v0/logs/") for path in proxy.sent)


# ---------------------------------------------------------------- 5, 6: real Airflow on a token-auth cluster


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory):
    """A head and one v6e-4 host with Ray token auth, under its own RAYSLICE_HOME; stopped by PID at the end."""
    home = tmp_path_factory.mktemp("rayslice-token-home")
    name = f"faults-token-{os.getpid()}"
    with rayslice_home(home):
        record = local_cluster.up(local_cluster.ClusterSpec(tpus=("v6e-4",)), name=name,
                                  token=f"rs-faults-{uuid.uuid4().hex}")
    try:
        yield record
    finally:
        with rayslice_home(home):
            local_cluster.down(name)


@pytest.fixture(scope="module")
def airflow(token_cluster):
    """One Airflow stack whose `ray_default` is the token cluster, with the token as the password.

    The triggerer's health threshold is 15 s (default 30 s): a restarted triggerer adopts a crashed
    one's triggers once the old one's heartbeat is that old.
    """
    old = os.environ.get("AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD")
    os.environ["AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD"] = "15"
    try:
        stack = AirflowStack(token_cluster.dashboard_url, token_cluster.token, dags_folder=DAGS)
        with stack:
            yield stack
    finally:
        if old is None:
            os.environ.pop("AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD", None)
        else:
            os.environ["AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD"] = old
    assert not stack.pids(), f"processes of the Airflow stack left behind: {sorted(stack.pids())}"


@pytest.fixture(scope="module")
def api(airflow):
    with httpx.Client(base_url=f"{airflow.url}/api/v2", timeout=60,
                      headers={"Authorization": f"Bearer {airflow.api_token()}"}) as client:
        deadline = time.monotonic() + 180
        missing = {"faults_triggerer_restart", "faults_token"}
        while missing and time.monotonic() < deadline:
            missing = {d for d in missing if _get(client, f"/dags/{d}") is None}
            time.sleep(1)
        assert not missing, f"the DAG processor did not register {sorted(missing)} from {DAGS}"
        yield client


def _get(api: httpx.Client, path: str) -> dict | None:
    try:
        resp = api.get(path)
    except httpx.TransportError:
        return None  # the API stalled behind a SQLite lock: poll again
    return resp.json() if resp.status_code == 200 else None


def _trigger(api: httpx.Client, dag_id: str, conf: dict | None = None) -> str:
    run = f"faults-{uuid.uuid4().hex[:8]}"
    resp = api.post(f"/dags/{dag_id}/dagRuns", json={"dag_run_id": run, "logical_date": None, "conf": conf or {}})
    assert resp.status_code == 200, resp.text
    return run


def _ti(api: httpx.Client, dag_id: str, run: str, task_id: str) -> dict:
    return _get(api, f"/dags/{dag_id}/dagRuns/{run}/taskInstances/{task_id}") or {"state": None}


def _wait_state(api, dag_id: str, run: str, task_id: str, states: set[str], timeout: float) -> dict:
    ti = wait_until(lambda: (t := _ti(api, dag_id, run, task_id))["state"] in states and t, timeout=timeout,
                    interval=0.5)
    assert ti, f"{dag_id}/{run}/{task_id} not in {states} within {timeout:.0f} s: {_ti(api, dag_id, run, task_id)}"
    return ti


def _xcom(api: httpx.Client, dag_id: str, run: str, task_id: str):
    entry = _get(api, f"/dags/{dag_id}/dagRuns/{run}/taskInstances/{task_id}/xcomEntries/return_value")
    assert entry is not None, f"no XCom for {dag_id}/{run}/{task_id}"
    try:
        return json.loads(entry["value"]) if isinstance(entry["value"], str) else entry["value"]
    except ValueError:
        return entry["value"]


def _logs(airflow: AirflowStack) -> dict[Path, str]:
    assert airflow.home is not None
    return {p: p.read_text(errors="replace") for p in (airflow.home / "logs").rglob("*") if p.is_file()}


def _token_chips_free(cluster) -> bool:
    snap = capacity.snapshot(cluster.dashboard_url, cluster.token)
    return all(h.state == "free" for s in snap.slices for h in s.hosts)


def _run_jobs(cluster, run: str) -> list:
    with RayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
        return [j for j in client.list_jobs() if (j.metadata or {}).get("run_id") == run]


@pytest.mark.timeout(600)  # the first Airflow test also pays for the token cluster and the stack (~2-4 min)
def test_a_triggerer_crash_mid_step_neither_resubmits_nor_loses_the_step(token_cluster, airflow, api, tmp_path):
    dag_id = "faults_triggerer_restart"
    run = _trigger(api, dag_id, {"folder": str(tmp_path)})
    held = wait_until(lambda: (tmp_path / "started").exists() and _ti(api, dag_id, run, "step")["state"] == "deferred",
                      timeout=STEP_START_S, interval=0.5)
    assert held, f"step not deferred and holding its slice: {_ti(api, dag_id, run, 'step')}"
    # The trigger records how far it relayed the log (an XCom of the task): the new triggerer resumes there.
    recorded = wait_until(lambda: (_checkpoint(api, dag_id, run) or {}).get("offset", 0) > 0, timeout=60, interval=0.5)
    assert recorded, f"no log checkpoint: {_checkpoint(api, dag_id, run)}"
    old = airflow.sessions["triggerer"]
    new = airflow.restart("triggerer")
    assert new != old
    time.sleep(3)  # the step runs on without any triggerer following it
    assert [j.status for j in _run_jobs(token_cluster, run)] == [JobStatus.RUNNING]
    (tmp_path / "release").touch()
    released = time.monotonic()
    ti = _wait_state(api, dag_id, run, "step", {"success", "failed", "up_for_retry"}, 180)
    took = time.monotonic() - released
    print(f"\n[faults] triggerer SIGKILLed and restarted; step released -> task {ti['state']} in {took:.1f} s")
    assert ti["state"] == "success" and ti["try_number"] == 1, (ti, _task_log(airflow, dag_id, run))
    assert _xcom(api, dag_id, run, "step") == ["released"]  # one entry per host
    ours = [(j.submission_id, j.status) for j in _run_jobs(token_cluster, run)]
    assert len(ours) == 1 and ours[0][1] == JobStatus.SUCCEEDED, ours  # one job: the new triggerer resubmitted nothing
    sid = ours[0][0]
    assert wait_until(lambda: _token_chips_free(token_cluster)
                      and not leftovers(token_cluster.dashboard_url, token_cluster.token, sid), timeout=FAULT_BOUND_S)
    # Relayed once: by the first triggerer; the second one skipped it by the recorded offset.
    relayed = [line for path, text in _logs(airflow).items() if f"run_id={run}" in str(path)
               for line in text.splitlines() if "holding the slice until released" in line]
    assert len(relayed) == 1, relayed


def _checkpoint(api: httpx.Client, dag_id: str, run: str) -> dict | None:
    entry = _get(api, f"/dags/{dag_id}/dagRuns/{run}/taskInstances/step/xcomEntries/rayslice_log_checkpoint")
    if entry is None:
        return None
    value = entry["value"]
    try:
        return json.loads(value) if isinstance(value, str) else value
    except ValueError:
        return None


def _task_log(airflow: AirflowStack, dag_id: str, run: str) -> str:
    return "\n".join(text for path, text in _logs(airflow).items() if f"run_id={run}" in str(path))[-3000:]


def test_the_token_works_end_to_end_and_shows_nowhere(token_cluster, airflow, api):
    token, url = token_cluster.token, token_cluster.dashboard_url
    # The cluster refuses a request without the token, and one with a wrong token.
    assert httpx.get(f"{url}/api/jobs/", timeout=30).status_code == 401
    with RayJobsClient(url, token="not-the-token") as wrong, pytest.raises(RayAuthError):
        wrong.list_jobs()

    dag_id = "faults_token"
    run = _trigger(api, dag_id)
    pages: list[str] = []
    slices = httpx.Client(base_url=airflow.url, timeout=60, headers={"Authorization": f"Bearer {airflow.api_token()}"})

    def done() -> bool:
        try:
            resp = slices.get("/rayslice/api/capacity")  # the Slices page's API, while the steps hold the slice
            pages.append(f"{resp.status_code} {resp.text}")
        except httpx.TransportError:
            pass  # the API server stalled behind a SQLite lock: ask again
        return _ti(api, dag_id, run, "running")["state"] in {"success", "failed", "upstream_failed"}

    with slices:
        assert wait_until(done, timeout=STEP_START_S * 2, interval=1.0), _task_log(airflow, dag_id, run)
    states = {t: _ti(api, dag_id, run, t)["state"] for t in ("deferred", "running")}
    assert states == {"deferred": "success", "running": "success"}, (states, _task_log(airflow, dag_id, run))
    assert any('"slices"' in page and page.startswith("200") for page in pages), pages[-1:]

    exposed: dict[str, str] = {}
    for task_id in ("deferred", "running"):
        base = f"/dags/{dag_id}/dagRuns/{run}/taskInstances/{task_id}"
        ti = _get(api, base)
        if task_id == "running":  # a worker stores what it rendered; a triggerer-started step renders in the trigger
            assert ti["rendered_fields"]["op_kwargs"] == {"where": url}, ti["rendered_fields"]
        exposed[f"{task_id} rendered fields"] = json.dumps(ti["rendered_fields"])
        entries = _get(api, f"{base}/xcomEntries")["xcom_entries"]
        assert {e["key"] for e in entries} >= {"return_value", "ray_submission_id"}, entries
        for entry in entries:
            exposed[f"{task_id} xcom {entry['key']}"] = json.dumps(_get(api, f"{base}/xcomEntries/{entry['key']}"))
        assert _xcom(api, dag_id, run, task_id) == [[4, url]]  # one entry per host
    logs = _logs(airflow)
    assert any(f"run_id={run}" in str(p) and "asked from" in t for p, t in logs.items()), "no task log of the run"
    exposed |= {str(path): text for path, text in logs.items()}
    exposed |= {f"slices page response {i}": page for i, page in enumerate(pages)}
    assert [where for where, text in exposed.items() if token in text] == []
    assert [j.status for j in _run_jobs(token_cluster, run)] == [JobStatus.SUCCEEDED] * 2
    assert wait_until(lambda: _token_chips_free(token_cluster), timeout=FAULT_BOUND_S)
