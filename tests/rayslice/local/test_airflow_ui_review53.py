"""Review of issue 53 (cluster sets): `rayslice airflow up --cluster-set`, cluster-free. Marked
`xfail(strict=True)`: fails on the code reviewed, passes once the defect is fixed."""

from __future__ import annotations

import json

import pytest

from rayslice.core.exceptions import RaysliceError
from rayslice.local import airflow_ui
from rayslice.local.local_cluster import ClusterRecord


@pytest.mark.xfail(strict=True, reason="defect: two local clusters whose names differ only in '-' vs '_' (or case) "
                   "get the same member connection id: `up` accepts the set, one cluster's connection silently "
                   "replaces the other's, and the set names one connection twice, which every step on it is refused "
                   "for at run time")
def test_cluster_names_that_map_to_one_connection_id_are_refused_at_up():
    def load(name):
        return ClusterRecord(name=name, gcs_address="", dashboard_url=f"http://{name}:8265", temp_dir="")

    try:
        env = airflow_ui.cluster_set_env({"tpus": ["set-a", "set_a"]}, load=load)
    except RaysliceError:
        return  # refused at `up`, in words: fixed
    members = json.loads(env["AIRFLOW_CONN_TPUS"])["extra"]["clusters"]
    assert len(set(members)) == 2, f"the set's member connections collide: {members}"
