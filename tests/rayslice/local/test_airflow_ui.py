"""`rayslice airflow up --team-connection`: one `ray` connection per team to the local cluster (issue 49).

Cluster-free: the connections' environment, and bad ids or teams refused before anything starts.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rayslice.cli import app
from rayslice.core.exceptions import RaysliceError
from rayslice.local import airflow_ui


def test_each_team_connection_is_a_ray_connection_to_the_cluster_in_its_team():
    env = airflow_ui.team_connection_env({"ray_research": "research", "ray_oncall": "oncall/pager"},
                                         "http://127.0.0.1:8265", "tok")
    research = json.loads(env["AIRFLOW_CONN_RAY_RESEARCH"])
    assert research["conn_type"] == "ray" and research["host"] == "http://127.0.0.1:8265"
    assert research["password"] == "tok" and research["extra"]["team"] == "research"
    assert json.loads(env["AIRFLOW_CONN_RAY_ONCALL"])["extra"]["team"] == "oncall/pager"


@pytest.mark.parametrize(("conn_id", "team", "says"), [
    ("Ray-Research", "research", "connection id"),
    ("ray_default", "research", "not ray_default"),
    ("ray_research", "re search", "the team"),
    ("ray_research", "x" * 65, "the team"),
])
def test_a_bad_id_or_team_is_refused_naming_the_flag(conn_id, team, says):
    with pytest.raises(RaysliceError, match=says) as caught:
        airflow_ui.team_connection_env({conn_id: team}, None, None)
    assert "--team-connection" in str(caught.value)


def test_the_cli_refuses_a_malformed_team_connection_before_starting_anything(monkeypatch):
    started = []
    monkeypatch.setattr(airflow_ui, "_cluster", lambda *a, **k: started.append(1))
    result = CliRunner().invoke(app, ["airflow", "up", "--team-connection", "ray_research"])
    assert result.exit_code != 0 and "CONN_ID=TEAM" in result.output, result.output
    result = CliRunner().invoke(app, ["airflow", "up", "--team-connection", "ray_research=bad team"])
    assert result.exit_code != 0 and "the team must be" in result.output, result.output
    assert not started


def _started_env(monkeypatch, tmp_path) -> dict:
    """The settings `up` starts its Airflow with (the cluster and the stack stand-ins: nothing starts)."""
    from types import SimpleNamespace

    monkeypatch.setenv("RAYSLICE_HOME", str(tmp_path))
    monkeypatch.setattr(airflow_ui, "_cluster",
                        lambda name, emit: (SimpleNamespace(dashboard_url="http://127.0.0.1:8265", token=None), False))
    seen = []

    class Stack:
        def __init__(self, *args, extra_env=None, **kwargs):
            seen.append(dict(extra_env or {}))

        def start(self):
            raise RuntimeError("not started in this test")

    monkeypatch.setattr(airflow_ui, "AirflowStack", Stack)
    with pytest.raises(RuntimeError, match="not started"):
        airflow_ui.up("settings", port=0, emit=lambda _: None)
    return seen[-1]


def test_up_shortens_the_idle_scheduler_sleep_so_a_chain_step_is_scheduled_sooner(monkeypatch, tmp_path):
    """Issue 52: the scheduler sleeps up to `scheduler_idle_sleep_time` before a chain's next step is scheduled."""
    monkeypatch.delenv("AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME", raising=False)
    env = _started_env(monkeypatch, tmp_path)
    assert float(env["AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME"]) < 1  # Airflow's default is 1 s


def test_a_setting_from_the_callers_environment_wins_over_ups_own(monkeypatch, tmp_path):
    monkeypatch.setenv("AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME", "2")
    env = _started_env(monkeypatch, tmp_path)
    assert "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME" not in env  # the stack inherits the caller's 2 s
