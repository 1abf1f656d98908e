"""`rayslice airflow up|down`: what a user runs to get the UI, checked from outside (processes, HTTP).

Uses the session's Airflow, which the fixture started with `rayslice airflow up` on the
session's cluster: a second `up` must say it is already up, `down` must leave no process of
it, and an `up` after that must work again (the rest of the package then uses that one).
"""

from __future__ import annotations

import httpx

from rayslice.local import airflow_ui, local_cluster
from rayslice.local.processes import alive
from tests.airflow_cli import rayslice


def test_up_prints_url_and_login_twice_then_down_leaves_nothing_and_up_works_again(airflow, cluster):
    first = airflow.first_up.stdout
    record = airflow.record
    login = f"{record.username} / {record.password}"
    assert f"Airflow UI:  {record.url}" in first and login in first, first
    assert "reusing the local cluster" in first and not record.started_cluster, first

    again = airflow.up()
    assert "is already up" in again.stdout and record.url in again.stdout and login in again.stdout, again.stdout
    assert airflow.record.sessions == record.sessions  # nothing new started
    status = rayslice("airflow", "status", "--name", airflow.name)
    assert status.returncode == 0 and "healthy, " in status.stdout, status.stdout + status.stderr

    running = airflow_ui.processes(record)
    assert set(record.sessions.values()) <= running and len(running) >= 4, running
    down = airflow.down()
    assert f"stopped Airflow {airflow.name!r}" in down.stdout, down.stdout
    assert not [pid for pid in running if alive(pid)], "processes of `rayslice airflow up` left after down"
    assert airflow_ui.UiRecord.load(airflow.name) is None
    try:
        httpx.get(f"{record.url}/api/v2/monitor/health", timeout=5)
        raise AssertionError(f"something still answers at {record.url} after down")
    except httpx.TransportError:
        pass
    assert local_cluster.alive_nodes(cluster.dashboard_url, cluster.token), "down stopped the cluster it reused"

    airflow.up()  # same port, same home: same URL and password
    assert (airflow.url, airflow.password) == (record.url, record.password)
    assert airflow_ui.healthy(airflow.record)
    resp = httpx.get(f"{airflow.url}/rayslice/api/capacity", timeout=60,
                     headers={"Authorization": f"Bearer {airflow.api_token()}"})
    assert resp.status_code == 200 and resp.json()["dashboard_url"] == cluster.dashboard_url, resp.text[:300]
    # `--dags` served the given folder: its own DAG file (not one of the examples) is listed with the examples'.
    dag_ids = {d["dag_id"] for d in httpx.get(f"{airflow.url}/api/v2/dags", params={"limit": 1000}, timeout=60,
                                              headers={"Authorization": f"Bearer {airflow.api_token()}"}
                                              ).json()["dags"]}
    assert {"lc_wait", "rayslice_training_pipeline"} <= dag_ids, sorted(dag_ids)
