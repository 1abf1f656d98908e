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

