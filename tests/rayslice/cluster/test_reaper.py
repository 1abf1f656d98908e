"""Orphaned reservations, as they really happen, and `rayslice reap`.

What a real experiment on the local cluster showed (Ray 2.60), and the first test keeps checking:
SIGKILL of a rayslice job's driver makes Ray itself remove the driver's placement groups and host
actors within about a second (they are not detached), and the Jobs API marks the job FAILED. So a
dead *driver* leaves no orphan. The orphan that does happen is the opposite: the Airflow worker
dies hard, `on_kill` never runs, and the Ray job (independent of the worker) keeps the slice for as
long as the step runs. The second test builds exactly that with a real Airflow and a real worker kill.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import psutil
import pytest

from rayslice.client import capacity
from rayslice.client.jobs_client import RayJobsClient
from rayslice.client.submission import jobs_of_task, submit_step
from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.step import Owner, StepSpec
from rayslice.local import processes
from tests.conftest import wait_until

RAYSLICE = str(Path(sys.executable).with_name("rayslice"))  # the installed console script


def wait_for_flag(folder: str, name: str):
    """Marks that the step holds its capacity, then runs until the test drops a `release` file."""
    import pathlib
    import time

    pathlib.Path(folder, name).touch()
    while not pathlib.Path(folder, "release").exists():
        time.sleep(0.2)
    return name


def submit(cluster, request, folder: str, name: str, dag_id: str = "reaper_test") -> str:
    owner = Owner(dag_id=dag_id, run_id=f"r{time.time_ns()}", task_id=name, try_number=1)
    spec = StepSpec.for_function(wait_for_flag, request=request, kwargs={"folder": folder, "name": name},
                                 owner=owner, capacity_timeout=120)

    async def go() -> str:
        from rayslice.client.jobs_client import AsyncRayJobsClient

        async with AsyncRayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
            return await submit_step(client, spec)

    return asyncio.run(go())


def task_job_id(cluster, dag_id: str, run_id: str, task_id: str) -> str:
    """The submission id of a task's one Ray job, found by metadata (ids hold each try's task-instance id)."""
    with RayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
        found = jobs_of_task(client.list_jobs(), Owner(dag_id=dag_id, run_id=run_id, task_id=task_id))
    assert len(found) == 1, f"{dag_id}/{run_id}/{task_id}: expected one Ray job, found {found}"
    return found[0].submission_id


def v6e4_free(cluster) -> bool:
    return all(s.state == "free" for s in capacity.snapshot(cluster.dashboard_url).slices if s.pod_type == "v6e-4")


def job_status(cluster, sid: str) -> str:
    with RayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
        return client.get(sid).status.value


def reap_cli(cluster, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([RAYSLICE, "reap", "--address", cluster.dashboard_url, *args],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.timeout(300)
def test_a_killed_driver_leaves_nothing_and_reap_spares_live_steps(cluster, tmp_path):
    """SIGKILL the driver of a real step job: Ray frees its slice; `rayslice reap` then touches no live step."""
    folder = str(tmp_path)
    victim = submit(cluster, TpuSliceRequest(tpu="v6e-4"), folder, "victim")
    live = submit(cluster, AcceleratorRequest(resource="GPU", count=0.25), folder, "live")
    try:
        assert wait_until(lambda: {"victim", "live"} <= set(os.listdir(folder)), timeout=180), os.listdir(folder)
        assert not v6e4_free(cluster)
        with RayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
            driver = int(client.get(victim).model_extra["driver_info"]["pid"])
        os.kill(driver, signal.SIGKILL)
        assert wait_until(lambda: v6e4_free(cluster), timeout=10), "Ray did not free the dead driver's slice"
        assert wait_until(lambda: job_status(cluster, victim) == "FAILED", timeout=10)

        done = reap_cli(cluster)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "0 leftover(s) removed" in done.stdout, done.stdout
        assert job_status(cluster, live) == "RUNNING"
        holders = [s.holder.submission_id for n in capacity.snapshot(cluster.dashboard_url).gpu_nodes
                   for s in n.shares]
        assert live in holders, holders
    finally:
        Path(folder, "release").touch()
    assert wait_until(lambda: job_status(cluster, live) == "SUCCEEDED", timeout=60)


ORPHAN_DAG = '''
import pendulum
from airflow.sdk import dag, task

FOLDER = {folder!r}


@dag(dag_id="reaper_orphan", schedule=None, start_date=pendulum.datetime(2025, 1, 1), catchup=False)
def reaper_orphan():
    # On a worker (not deferred): the orphan this test makes is a killed worker's.
    @task.tpu_slice(tpu="v6e-4", retries=0, deferrable=False)
    def hold():
        import pathlib, time
        pathlib.Path({folder!r}, "hold").touch()
        while not pathlib.Path({folder!r}, "release").exists():
            time.sleep(0.2)

    @task.ray_accelerator(accelerator="GPU", count=0.25, retries=0, deferrable=False)
    def live():
        import pathlib, time
        pathlib.Path({folder!r}, "live").touch()
        while not pathlib.Path({folder!r}, "release").exists():
            time.sleep(0.2)
        return "done"

    hold()
    live()


reaper_orphan()
'''


def _kill_worker_of(ti_id: str) -> list[int]:
    """SIGKILL the task process titled `airflow worker -- <ti id>` and its supervisor: a worker lost hard."""
    for proc in psutil.process_iter():
        try:
            if " ".join(proc.cmdline()).startswith(f"airflow worker -- {ti_id}"):
                victims = [proc.ppid(), proc.pid]
                for pid in victims:
                    processes.send_signal(pid, signal.SIGKILL)
                return victims
        except psutil.Error:
            continue
    raise AssertionError(f"no task process for task instance {ti_id}")


@pytest.mark.timeout(600)
def test_reap_frees_the_slice_of_a_killed_airflow_worker(cluster, airflow, tmp_path):
    folder = tmp_path / "flags"
    folder.mkdir()
    # The session's Airflow picks the DAG up within seconds.
    (airflow.dags_folder / "reaper_orphan.py").write_text(textwrap.dedent(ORPHAN_DAG.format(folder=str(folder))))
    stranger = None
    token = airflow.api_token()
    api = httpx.Client(base_url=f"{airflow.url}/api/v2", timeout=60, headers={"Authorization": f"Bearer {token}"})
    try:
        assert wait_until(lambda: api.get("/dags/reaper_orphan").status_code == 200, timeout=180)
        run = api.post("/dags/reaper_orphan/dagRuns", json={"logical_date": None})
        assert run.status_code == 200, run.text
        run_id = run.json()["dag_run_id"]
        # A live step of no Airflow at all (another team's, a test's): the reaper must not touch it either.
        stranger = submit(cluster, AcceleratorRequest(resource="GPU", count=0.25), str(folder), "stranger",
                          dag_id="not_in_this_airflow")
        assert wait_until(lambda: {"hold", "live", "stranger"} <= set(os.listdir(folder)), timeout=300), \
            os.listdir(folder)
        sids = {t: task_job_id(cluster, "reaper_orphan", run_id, t) for t in ("hold", "live")}
        ti = api.get(f"/dags/reaper_orphan/dagRuns/{run_id}/taskInstances/hold").json()
        killed = _kill_worker_of(ti["id"])
        assert wait_until(lambda: not any(processes.alive(pid) for pid in killed), timeout=10), killed
        # Airflow's scheduler marks the task failed once its dead worker's heartbeat times out
        # (HEARTBEAT_TIMEOUT_S); the reaper reads nothing but that state. Marked failed at once through the
        # API, as an operator would, the test need not wait the timeout out. The worker is dead either way:
        # nobody runs `on_kill`, so the Ray job keeps the slice.
        marked = api.patch(f"/dags/reaper_orphan/dagRuns/{run_id}/taskInstances/hold", json={"new_state": "failed"})
        assert marked.status_code == 200, marked.text

        def hold_state() -> str:
            return api.get(f"/dags/reaper_orphan/dagRuns/{run_id}/taskInstances/hold").json()["state"]

        assert wait_until(lambda: hold_state() == "failed", timeout=120, interval=1), hold_state()
        # The orphan is real: Airflow gave up on the task, the Ray job still holds the slice.
        assert job_status(cluster, sids["hold"]) == "RUNNING" and not v6e4_free(cluster)

        started = time.monotonic()
        reaper = subprocess.Popen(
            [RAYSLICE, "reap", "--address", cluster.dashboard_url,
             "--airflow-url", airflow.url], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "RAYSLICE_AIRFLOW_TOKEN": token})
        assert wait_until(lambda: v6e4_free(cluster), timeout=30, interval=0.2), "slice still held after 30 s"
        freed_after = time.monotonic() - started
        out, _ = reaper.communicate(timeout=120)
        assert reaper.returncode == 0, out
        assert freed_after < 30
        assert f"stopping Ray job {sids['hold']}" in out, out
        assert sids["live"] not in out and stranger not in out, out
        assert job_status(cluster, sids["hold"]) == "STOPPED"
        assert job_status(cluster, sids["live"]) == "RUNNING" and job_status(cluster, stranger) == "RUNNING"
        assert api.get(f"/dags/reaper_orphan/dagRuns/{run_id}/taskInstances/live").json()["state"] == "running"
    finally:
        (folder / "release").touch()
    assert wait_until(lambda: api.get(f"/dags/reaper_orphan/dagRuns/{run_id}/taskInstances/live")
                      .json()["state"] == "success", timeout=120, interval=1)
    assert wait_until(lambda: job_status(cluster, stranger) == "SUCCEEDED", timeout=60)


LEAVE_A_DETACHED_GROUP = """
import sys
import ray
from ray.util.placement_group import placement_group

ray.init(address=sys.argv[2], logging_level="ERROR")
group = placement_group([{"CPU": 0.01}], name=sys.argv[1], lifetime="detached")
ray.get(group.ready(), timeout=120)
"""


def test_the_sweep_keys_on_the_creating_driver_never_on_a_name_a_caller_chose(cluster, ray_driver, tmp_path):
    """Live reservations named after an ended job (an id with '/', a re-run spec.json) stay; a dead driver's go."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from rayslice.cluster import reaper

    with RayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
        ended = client.submit("true", submission_id=f"test-reaper-ended-{time.time_ns()}")
        assert wait_until(lambda: client.get(ended).is_terminal, timeout=180, interval=0.5)
    rerun = placement_group([{"CPU": 0.01}], name=f"rayslice:{ended}/heads")  # an old spec.json run by hand
    slashed = placement_group([{"CPU": 0.01}], name=f"rayslice:{ended}/forged-part/hosts")  # an id with a '/'
    actor = ray_driver.remote(num_cpus=0)(type("Holder", (), {"ping": lambda self: 1})).options(
        name=f"rayslice:{ended}/v6e-4/host0").remote()
    dead_driver = f"rayslice:test-reaper-dead-driver-{time.time_ns()}/heads"
    env = {**os.environ, **cluster.ray_env()}
    done = subprocess.run([sys.executable, "-c", LEAVE_A_DETACHED_GROUP, dead_driver, cluster.gcs_address], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    # a live group named like the dead driver's (issue 38 (10): the sweep removed by name, the last one listed)
    twin = placement_group([{"CPU": 0.01}], name=dead_driver)
    try:
        ray_driver.get([rerun.ready(), slashed.ready(), twin.ready(), actor.ping.remote()], timeout=120)
        # A dry run reads the dashboard only: no sweep job is submitted, and it names what the sweep removes.
        with RayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
            jobs_before = {job.submission_id or job.job_id for job in client.list_jobs()}
            dry = reap_cli(cluster, "--dry-run")
            jobs_after = {job.submission_id or job.job_id for job in client.list_jobs()}
        assert dry.returncode == 0, dry.stdout + dry.stderr
        assert jobs_after == jobs_before, jobs_after - jobs_before
        assert f"would reap placement_group {dead_driver} " in " ".join(dry.stdout.split()), dry.stdout
        reaped = {orphan.name for orphan in reaper.reap()}
        assert not any(f"{live} " in " ".join(dry.stdout.split()) for live in (
            f"rayslice:{ended}/heads", f"rayslice:{ended}/forged-part/hosts", f"rayslice:{ended}/v6e-4/host0"))
        assert dead_driver in reaped, reaped  # no Jobs API record, but its driver has exited
        live = {rerun: f"rayslice:{ended}/heads", slashed: f"rayslice:{ended}/forged-part/hosts", twin: dead_driver}
        dead = [id for id, g in ray_driver.util.placement_group_table().items()
                if g["name"] == dead_driver and id != twin.id.hex()]
        assert dead and wait_until(lambda: all(
            ray_driver.util.placement_group_table()[id]["state"] == "REMOVED" for id in dead), timeout=10)
        assert not reaped & {*list(live.values())[:2], f"rayslice:{ended}/v6e-4/host0"}, reaped
        assert all(ray_driver.util.placement_group_table(group)["state"] == "CREATED" for group in live)
        assert ray_driver.get(actor.ping.remote(), timeout=30) == 1
    finally:
        remove_placement_group(rerun)
        remove_placement_group(slashed)
        remove_placement_group(twin)
        ray_driver.kill(actor)
        reaper.reap()  # the dead driver's group, if the assertion above failed before the sweep


def test_phase_keys_of_ended_jobs_are_swept_as_a_step_starts(monkeypatch):
    """Ray's KV belongs to no job: a driver killed before it forgot its hosts' phase keys (a dead Airflow worker's
    job stopped, a SIGKILL) leaves them forever, unlike its groups and actors. The next step's sweep forgets them;
    a live job's (and the calling step's own) stay."""
    import rayslice.cluster as launcher
    from rayslice.cluster import phases, reaper
    from rayslice.cluster.notices import internal_kv

    store = {f"{phases.attempt_key(sid, 0, 'abcd1234')}v6e-16-a/host0".encode(): b"{}"
             for sid in ("ended:with:colons", "live", "mine")}
    monkeypatch.setattr(internal_kv, "_internal_kv_list",
                        lambda prefix, namespace=None: [k for k in store if k.startswith(
                            prefix.encode() if isinstance(prefix, str) else prefix)])
    monkeypatch.setattr(internal_kv, "_internal_kv_del",
                        lambda k, namespace=None, **kw: store.pop(k.encode() if isinstance(k, str) else k, None))
    monkeypatch.setattr(reaper, "reap", lambda **kw: [])
    monkeypatch.setattr(reaper, "job_status", {"ended:with:colons": "STOPPED", "live": "RUNNING",
                                               "mine": "RUNNING"}.get)
    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-8"), command=["true"], owner=Owner(submission_id="mine"))
    launcher._reap_orphans(spec)
    assert sorted(k.decode().split(":")[1] for k in store) == ["live", "mine"]
