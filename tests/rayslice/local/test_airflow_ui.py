"""`rayslice airflow up --team-connection`: one `ray` connection per team to the local cluster (issue 49).

Cluster-free: the connections' environment, and bad ids or teams refused before anything starts.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rayslice.cli import app
from rayslice.core.exceptions import RaysliceError
from rayslice.local import airflow_ui, local_cluster


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



def _record(name: str) -> local_cluster.ClusterRecord:
    return local_cluster.ClusterRecord(name=name, gcs_address="127.0.0.1:1", dashboard_url=f"http://{name}:8265",
                                       temp_dir="/tmp", token=f"tok-{name}")


def test_a_cluster_set_is_a_connection_per_local_cluster_and_the_set_of_them_with_a_shared_root(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYSLICE_HOME", str(tmp_path))
    env = airflow_ui.cluster_set_env({"tpus": ["a", "set-b"]}, load=_record)
    a, b = json.loads(env["AIRFLOW_CONN_RAY_A"]), json.loads(env["AIRFLOW_CONN_RAY_SET_B"])
    assert (a["host"], a["password"], a["extra"]["launcher"]) == ("http://a:8265", "tok-a", "installed")
    assert b["host"] == "http://set-b:8265"
    tpus = json.loads(env["AIRFLOW_CONN_TPUS"])
    assert tpus["conn_type"] == "ray" and tpus["extra"]["clusters"] == ["ray_a", "ray_set_b"]
    assert tpus["extra"]["shared_root"] is True
    assert tpus["extra"]["checkpoint_root"] == f"file://{tmp_path / 'checkpoints' / 'tpus'}"
    # what the operator reads from it: a set of those two connections, in that order
    from airflow.models.connection import Connection
    from rayslice.hooks.ray import cluster_set_of

    conn = Connection.from_json(env["AIRFLOW_CONN_TPUS"], conn_id="tpus")
    assert cluster_set_of(conn).members == ("ray_a", "ray_set_b")


@pytest.mark.parametrize(("sets", "says"), [
    ({"Tpus": ["a", "b"]}, "connection id"),
    ({"ray_default": ["a", "b"]}, "not ray_default"),
    ({"tpus": ["a", "a"]}, "name each local cluster once"),
    ({"tpus": ["a", ""]}, "name each local cluster once"),
    ({"ray_a": ["a", "b"]}, "also the connection id of cluster 'a'"),
])
def test_a_bad_cluster_set_is_refused_naming_the_flag(sets, says):
    with pytest.raises(RaysliceError, match=says) as caught:
        airflow_ui.cluster_set_env(sets)
    assert "--cluster-set" in str(caught.value)


def test_a_cluster_set_over_a_cluster_not_up_says_how_to_start_it(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYSLICE_HOME", str(tmp_path))
    with pytest.raises(RaysliceError, match=r"no local cluster 'b' is recorded; .*rayslice local up --name b"):
        airflow_ui.cluster_set_env({"tpus": ["a", "b"]},
                                   load=lambda n: _record(n) if n == "a" else local_cluster.ClusterRecord.load(n))


def test_the_cli_refuses_a_bad_cluster_set_before_starting_anything(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYSLICE_HOME", str(tmp_path))
    started = []
    monkeypatch.setattr(airflow_ui, "_cluster", lambda *a, **k: started.append(1))
    result = CliRunner().invoke(app, ["airflow", "up", "--cluster-set", "tpus"])
    assert result.exit_code != 0 and "CONN_ID=A,B" in result.output, result.output
    result = CliRunner().invoke(app, ["airflow", "up", "--cluster-set", "tpus=a,b"])
    assert result.exit_code != 0 and "rayslice local up --name a" in result.output, result.output
    assert not started
