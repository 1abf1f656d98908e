"""`rayslice airflow up --cluster-set` refuses what would break at run time (issue 53, found by review)."""

from __future__ import annotations

import json

from rayslice.core.exceptions import RaysliceError
from rayslice.local import airflow_ui
from rayslice.local.local_cluster import ClusterRecord


def test_cluster_names_that_map_to_one_connection_id_are_refused_at_up():
    def load(name):
        return ClusterRecord(name=name, gcs_address="", dashboard_url=f"http://{name}:8265", temp_dir="")

    try:
        env = airflow_ui.cluster_set_env({"tpus": ["set-a", "set_a"]}, load=load)
    except RaysliceError:
        return  # refused at `up`, in words: fixed
    members = json.loads(env["AIRFLOW_CONN_TPUS"])["extra"]["clusters"]
    assert len(set(members)) == 2, f"the set's member connections collide: {members}"
