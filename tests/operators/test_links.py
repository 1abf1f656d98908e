"""The "Ray job" link's target (rayslice/operators/links.py): a set's step names the member that ran it, a step on one
cluster its connection, and only a set's link reads the extra XCom (the link is computed as every task ends)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from rayslice.operators.links import CLUSTER_KEY, SUBMISSION_ID_KEY, RayJobLink, ran_on


@pytest.fixture
def xcoms(monkeypatch):
    """The XComs the link reads, and which keys it asked for."""
    from airflow.sdk.execution_time import xcom

    stored: dict[str, object] = {SUBMISSION_ID_KEY: "rayslice-d-t-1"}
    asked: list[str] = []

    def get_value(*, ti_key, key):
        asked.append(key)
        return stored.get(key)

    monkeypatch.setattr(xcom.XCom, "get_value", staticmethod(get_value))
    return stored, asked


def op(**fields) -> SimpleNamespace:
    return SimpleNamespace(**{"ray_conn_id": "tpus", "_set": None, "_ran_on": None, "_submission_id": None, **fields})


def test_a_sets_link_names_the_member_its_operator_or_its_xcom_says(xcoms):
    stored, asked = xcoms
    link = RayJobLink()
    ran = op(_set=object(), _ran_on="ray_b", _submission_id="rayslice-d-t-1")
    assert link.get_link(ran, ti_key=None).endswith("/rayslice/job/rayslice-d-t-1?conn_id=ray_b")
    assert asked == [SUBMISSION_ID_KEY]  # the operator that ran the try knew
    stored[CLUSTER_KEY] = {"submission_id": "rayslice-d-t-1", "cluster": "ray_a"}
    assert link.get_link(op(_set=object()), ti_key=None).endswith("?conn_id=ray_a")
    stored[CLUSTER_KEY] = {"submission_id": "rayslice-d-t-0", "cluster": "ray_a"}  # an earlier try's: not this one
    assert link.get_link(op(_set=object()), ti_key=None).endswith("?conn_id=tpus")


def test_a_step_on_one_cluster_reads_no_more_than_its_submission_id(xcoms):
    stored, asked = xcoms
    stored[CLUSTER_KEY] = {"submission_id": "rayslice-d-t-1", "cluster": "ray_a"}
    assert RayJobLink().get_link(op(ray_conn_id="ray_default"), ti_key=None).endswith("?conn_id=ray_default")
    assert asked == [SUBMISSION_ID_KEY]


def test_ran_on_takes_only_a_record_of_this_submission():
    assert ran_on({"submission_id": "s", "cluster": "a"}, "s") == "a"
    assert ran_on({"submission_id": "s", "cluster": "a"}, "t") is None
    assert ran_on("a", "s") is None and ran_on(None, "s") is None
