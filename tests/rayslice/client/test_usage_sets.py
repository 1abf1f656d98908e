"""`rayslice usage` and goodput over a cluster set: each attempt's cluster, and a member's job that stood by counting
for nothing (rayslice/client/usage.py `merge`, `usage_of_set`; the CLI's `--conn-id <set>`).

Two fake members over real HTTP (tests/set_dashboards.py): `s1` ran on set_b while set_a's job stood by; `s2` held
set_a first, was suspended, and resumed on set_b.
"""

from __future__ import annotations

import json

import pytest

from rayslice.client import usage
from tests.rayslice.test_cli import run
from tests.set_dashboards import H, pair


@pytest.fixture
def members():
    a, b, accounts = pair()
    with a, b:
        yield a, b, accounts


def rows_by_task(found: usage.Usage) -> dict[str, usage.UsageRow]:
    return {row.task_id: row for row in usage.totals(found.bars, found.goodput, found.attempts)[1]}


def test_a_standby_job_on_one_member_is_no_step_no_attempt_no_failure_and_no_chip_hour(members):
    """`--conn-id set_a` alone: set_a's job of s1 stood by (FAILED, RanElsewhereError). It held nothing, so it is no
    bar, no row, no figures; s2's attempt that did hold set_a is counted, as one attempt of its own."""
    a, _, accounts = members
    found = usage.usage(a.url, hours=6)
    assert {bar.submission_id for bar in found.bars} == {"s2"}
    assert set(found.goodput) == {"s2"}
    rows = rows_by_task(found)
    assert set(rows) == {"t2"}, rows
    assert rows["t2"].steps == 1 and rows["t2"].measured == 1
    assert rows["t2"].held_chip_h == pytest.approx(accounts["s2@set_a"].held_chip_s / H, abs=1e-5)
    assert found.goodput["s2"]["attempts"] == 1


def test_a_set_is_read_member_by_member_and_each_attempt_says_its_cluster(members):
    a, b, accounts = members
    found = usage.usage_of_set({"set_a": lambda: usage.usage(a.url, hours=6),
                                "set_b": lambda: usage.usage(b.url, hours=6)})
    # Both members name their slice v6e-4-a: two lanes, each its cluster's.
    assert sorted((lane.key, lane.cluster) for lane in found.lanes) == [
        ("set_a:v6e-4-a", "set_a"), ("set_b:v6e-4-a", "set_b")]
    assert sorted((bar.submission_id, bar.cluster) for bar in found.bars) == [
        ("s1", "set_b"), ("s2", "set_a"), ("s2", "set_b")]
    assert found.attempts == {"s1": {"set_b": 1}, "s2": {"set_a": 1, "set_b": 1}}
    rows = rows_by_task(found)
    # s1: the one cluster that ran it; set_a's standby adds no attempt, no chip-hour and no share of the goodput.
    s1 = accounts["s1@set_b"]
    assert (rows["t1"].steps, rows["t1"].clusters) == (1, {"set_b": 1})
    assert rows["t1"].held_chip_h == pytest.approx(s1.held_chip_s / H, abs=1e-5)
    assert rows["t1"].goodput == pytest.approx(s1.goodput, abs=1e-5)
    assert rows["t1"].tpu_chip_hours == pytest.approx(s1.held_chip_s / H, rel=0.01)
    # s2: one step, an attempt on each cluster, the chip-time both held.
    both = accounts["s2@set_a"].held_chip_s + accounts["s2@set_b"].held_chip_s
    assert (rows["t2"].steps, rows["t2"].clusters) == (1, {"set_a": 1, "set_b": 1})
    assert rows["t2"].held_chip_h == pytest.approx(both / H, abs=1e-5)
    assert found.goodput["s2"]["attempts"] == 2
    assert found.unread == {}


def test_a_member_that_cannot_be_read_is_named_and_the_rest_shown(members):
    _, b, _ = members
    from rayslice.core.exceptions import RayJobsError

    def down():
        raise RayJobsError("the Ray dashboard at http://10.0.0.9:8265 did not answer")

    found = usage.usage_of_set({"set_a": down, "set_b": lambda: usage.usage(b.url, hours=6)})
    assert set(found.unread) == {"set_a"} and "did not answer" in found.unread["set_a"]
    assert {bar.cluster for bar in found.bars} == {"set_b"}
    with pytest.raises(RayJobsError):
        usage.usage_of_set({"set_a": down})


def test_the_usage_command_reads_every_member_of_a_set_connection(members, tmp_path):
    a, b, _ = members
    env = {"AIRFLOW_CONN_SET_A": json.dumps({"conn_type": "ray", "host": a.url}),
           "AIRFLOW_CONN_SET_B": json.dumps({"conn_type": "ray", "host": b.url}),
           "AIRFLOW_CONN_TPUS": json.dumps({"conn_type": "ray", "extra": {"clusters": ["set_a", "set_b"]}})}
    out = run("usage", "--conn-id", "tpus", "--hours", "6", "--json", home=tmp_path, **env)
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout)
    rows = {row["task_id"]: row for row in data["rows"]}
    assert rows["t1"]["clusters"] == {"set_b": 1} and rows["t1"]["steps"] == 1
    assert rows["t2"]["clusters"] == {"set_a": 1, "set_b": 1} and rows["t2"]["steps"] == 1
    assert data["clusters"] == ["set_a", "set_b"] and data["unread"] == {}
    table = run("usage", "--conn-id", "tpus", "--hours", "6", home=tmp_path, **env)
    assert table.returncode == 0 and "clusters (attempts)" in table.stdout, table.stdout + table.stderr
    assert "set_a (1), set_b (1)" in table.stdout and "set_b (1)" in table.stdout, table.stdout


def test_the_usage_command_leaves_out_a_member_whose_connection_does_not_resolve(members, tmp_path):
    """As `rayslice capacity --conn-id <set>` does: the member is named with why, the rest is shown."""
    a, _, _ = members
    env = {"AIRFLOW_CONN_SET_A": json.dumps({"conn_type": "ray", "host": a.url}),
           "AIRFLOW_CONN_TPUS": json.dumps({"conn_type": "ray", "extra": {"clusters": ["set_a", "set_gone"]}})}
    out = run("usage", "--conn-id", "tpus", "--hours", "6", "--json", home=tmp_path, **env)
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout)
    assert data["clusters"] == ["set_a", "set_gone"] and list(data["unread"]) == ["set_gone"], data
    assert {row["task_id"] for row in data["rows"]} >= {"t2"}, data["rows"]
