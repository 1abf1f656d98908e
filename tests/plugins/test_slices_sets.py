"""The Slices plugin over a cluster set, without a cluster: the "Ray job" link of a set's step leads to the member that
ran it (only for users who may read that member's connection), and the usage reads every member.

Members are fake Ray dashboards over real HTTP (tests/set_dashboards.py); Airflow's real API app serves the plugin.
"""

from __future__ import annotations

import pytest

from tests.plugins.conftest import plugin_app
from tests.plugins.test_slices import bearer, jwt
from tests.set_dashboards import pair


@pytest.fixture(scope="module")
def members():
    a, b, accounts = pair()
    with a, b:
        yield a, b


@pytest.fixture(scope="module")
def api(airflow_db, members, tmp_path_factory):
    """Airflow's API app with the plugin, a simple auth manager, and the set `tpus` of `set_a` and `set_b`."""
    from fastapi.testclient import TestClient

    a, b = members
    with plugin_app(tmp_path_factory.mktemp("plugins"), "viewer:viewer,op:op", {
            "set_a": {"conn_type": "ray", "host": a.url}, "set_b": {"conn_type": "ray", "host": b.url},
            "tpus": {"conn_type": "ray", "extra": {"clusters": ["set_a", "set_b"]}}}) as app:
        yield TestClient(app)


def test_a_link_that_names_the_set_leads_to_the_member_that_ran_the_step(api, members):
    a, b = members
    op = bearer(jwt("op", "op"))
    ran = api.get("/rayslice/job/s1?conn_id=tpus", headers=op, follow_redirects=False)
    assert ran.status_code == 307 and ran.headers["location"] == f"{b.url}/#/jobs/s1", ran.text
    # The member's own connection, as the operator's XCom names it once a cluster claimed the step.
    direct = api.get("/rayslice/job/s1?conn_id=set_b", headers=op, follow_redirects=False)
    assert direct.headers["location"] == ran.headers["location"]
    viewer = api.get("/rayslice/job/s1?conn_id=tpus", headers=bearer(jwt("viewer", "viewer")), follow_redirects=False)
    assert viewer.status_code == 403 and a.url not in viewer.text and b.url not in viewer.text


def test_the_member_must_be_readable_too(api, members, monkeypatch):
    """A user who may read the set but not the member that ran the step gets no redirect and no address."""
    from rayslice.plugins import slices

    _, b = members
    monkeypatch.setattr(slices, "may_read_connection", lambda conn_id, user: conn_id != "set_b")
    refused = api.get("/rayslice/job/s1?conn_id=tpus", headers=bearer(jwt("op", "op")), follow_redirects=False)
    assert refused.status_code == 403 and "location" not in refused.headers and b.url not in refused.text


def test_before_any_cluster_claimed_it_the_link_shows_each_members_job(api, members):
    a, b = members
    for fake in (a, b):
        fake.jobs["s3"] = {**fake.jobs["s1"], "submission_id": "s3", "status": "PENDING", "message": ""}
    try:
        page = api.get("/rayslice/job/s3?conn_id=tpus", headers=bearer(jwt("op", "op")), follow_redirects=False)
    finally:
        for fake in (a, b):
            del fake.jobs["s3"]
    assert page.status_code == 200, page.text
    assert "no cluster has claimed the step yet" in page.text
    assert f'href="{a.url}/#/jobs/s3"' in page.text and f'href="{b.url}/#/jobs/s3"' in page.text
    assert page.text.count("pending") == 2


def test_the_usage_of_a_set_reads_every_member_and_names_each_attempts_cluster(api):
    data = api.get("/rayslice/api/usage?conn_id=tpus&hours=6", headers=bearer(jwt("op", "op"))).json()
    rows = {row["task_id"]: row for row in data["by_task"]}
    assert rows["t1"]["clusters"] == {"set_b": 1} and rows["t1"]["steps"] == 1
    assert rows["t2"]["clusters"] == {"set_a": 1, "set_b": 1} and rows["t2"]["steps"] == 1
    assert {bar["cluster"] for bar in data["bars"]} == {"set_a", "set_b"}
    section = api.get("/rayslice/usage?conn_id=tpus&hours=6", headers=bearer(jwt("op", "op")))
    assert section.status_code == 200 and "set_b: v6e-4-a" in section.text, section.text[:500]
    assert "clusters (attempts)" in section.text and "<td>set_a (1), set_b (1)</td>" in section.text
