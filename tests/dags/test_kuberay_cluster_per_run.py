"""dags/kuberay_cluster_per_run.py: two overlapping runs each create, use and delete a RayCluster of their own.

Real Airflow (`dag.test()`), the real `kubernetes` client and a real step on the local Ray cluster; the
Kubernetes API server is the HTTP fake of tests/fake_kubernetes.py (checked against KubeRay's CRDs),
whose head Services point at the local Ray dashboard. The runs overlap as two real ones do: run A
creates its cluster and runs its step, and its teardown waits (run later, in the same run) while run B
creates, uses and deletes its own.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime

import httpx
import pytest

from rayslice.cloud.cluster_names import per_run_name
from rayslice.cloud.kuberay_client import OWNER_ANNOTATION
from tests.airflow_env import EXAMPLE_DAGS, load_dag_file, task_states, xcom_values
from tests.fake_kubernetes import FakeKubernetes

pytestmark = pytest.mark.timeout(600)

DAG_ID = "rayslice_kuberay_cluster_per_run"
RUN_A, RUN_B = datetime(2026, 3, 1, tzinfo=UTC), datetime(2026, 3, 2, tzinfo=UTC)


@pytest.fixture
def fake(monkeypatch, tmp_path, reference_crds, ray_default):
    url = httpx.URL(ray_default.dashboard_url)
    # Every head Service's cluster IP and dashboard port lead to the local Ray cluster; each run's
    # cluster is told apart by the Kubernetes requests the tasks make.
    with FakeKubernetes(crds=reference_crds, ready_after_gets=1, gone_after_gets=0, cluster_ip=url.host,
                        service_ports={"dashboard": url.port}) as server:
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        conn = {"conn_type": "ray", "extra": {"kuberay": {"namespace": "ml", "name": "rayslice",
                                                          "kubeconfig": str(kubeconfig), "address": "cluster-ip"}}}
        if ray_default.token:  # a token-auth test cluster: the connection carries it
            conn["password"] = ray_default.token
        monkeypatch.setenv("AIRFLOW_CONN_RAY_KUBERAY", json.dumps(conn))
        yield server


def _names(requests: list) -> set[str]:
    """The RayClusters (and their Services and token Secrets) the requests were about."""
    names = set()
    for _, path, body in requests:
        if m := re.search(r"/(?:rayclusters|services|secrets)/([a-z0-9-]+)", path):
            names.add(re.sub(r"-(head-svc|ray-token)$", "", m[1]))
        elif isinstance(body, dict) and body.get("metadata", {}).get("name"):
            names.add(re.sub(r"-ray-token$", "", body["metadata"]["name"]))
    return names


def test_two_overlapping_runs_each_create_use_and_delete_their_own_cluster(fake, airflow_db, capfd):
    from airflow.models import Variable

    dags, errors = load_dag_file(EXAMPLE_DAGS / "kuberay_cluster_per_run.py")
    assert not errors
    dag = dags[DAG_ID]

    # Run A: its cluster is made and its step runs there; its teardown has not run yet.
    dr_a = dag.test(run_after=RUN_A, logical_date=RUN_A, mark_success_pattern="delete_cluster")
    out_a = capfd.readouterr().out
    assert task_states(dr_a) == {"create_cluster": "success", "train": "success", "delete_cluster": "success"}, \
        out_a[-5000:]
    deployment, run_a = Variable.get("rayslice_deployment"), dr_a.run_id
    name_a = per_run_name(DAG_ID, dr_a.run_id, deployment)
    assert xcom_values(dr_a, "create_cluster")[0]["name"] == name_a
    assert [h["processes"] for h in xcom_values(dr_a, "train")[0]] == [4] * 4  # a real 4-host step
    assert f"on RayCluster {name_a} (kuberay_cluster='per-run')" in out_a
    assert fake.cluster("ml", name_a)["metadata"]["annotations"][OWNER_ANNOTATION] == \
        f"{deployment}/{DAG_ID}/{dr_a.run_id}"
    assert _names(fake.requests) == {name_a}

    # Run B, while A's cluster exists: a cluster of its own, its step there, and only its own deleted.
    seen = len(fake.requests)
    dr_b = dag.test(run_after=RUN_B, logical_date=RUN_B)
    out_b = capfd.readouterr().out
    assert task_states(dr_b) == {"create_cluster": "success", "train": "success", "delete_cluster": "success"}, \
        out_b[-3000:]
    name_b = per_run_name(DAG_ID, dr_b.run_id, deployment)
    assert name_b != name_a and len(name_b) <= 40
    assert f"on RayCluster {name_b} (kuberay_cluster='per-run')" in out_b
    assert _names(fake.requests[seen:]) == {name_b}  # B's tasks never touched A's cluster or Secret
    assert xcom_values(dr_b, "delete_cluster") == ["deleted"]
    assert fake.cluster("ml", name_b) is None and fake.cluster("ml", name_a) is not None
    assert set(fake.secrets) == {("ml", f"{name_a}-ray-token")}

    # Run A's teardown, later: it deletes A's cluster and token Secret.
    seen = len(fake.requests)
    dr_a = dag.test(run_after=RUN_A, logical_date=RUN_A, mark_success_pattern="create_cluster|train")
    assert dr_a.run_id == run_a  # the same run as above, its teardown now
    assert xcom_values(dr_a, "delete_cluster") == ["deleted"]
    assert _names(fake.requests[seen:]) == {name_a}
    assert not fake.clusters and not fake.secrets
