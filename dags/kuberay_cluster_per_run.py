"""A KubeRay cluster per DAG run: create it, run a step on a v6e-16 slice there, delete it, even on failure.

Each run gets a RayCluster of its own, ``rs-<dag>-<hash of the run>`` (``name="per-run"``), so two
runs of this DAG may overlap: each creates, uses and deletes only its own. The step reaches the
same cluster with ``kuberay_cluster="per-run"`` (the name is computed from the run, no XCom
needed). The teardown runs when the step fails too, and deletes only a cluster this run made.

The `ray` connection ``ray_kuberay`` names the Kubernetes API and namespace in its ``kuberay``
extra, e.g. ``{"namespace": "ml-runs", "name": "rayslice", "in_cluster": true}`` (the name is
replaced per run here; a namespace holding per-run clusters only). docs/deploying-gke.md step 10 sets
it up, with the RBAC and the admission policy the operators need.
The step's XCom is one item per host: ``{"process": i, "processes": 4, "devices": 16}``.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import dag, task
from rayslice.operators.kuberay import CreateRayClusterOperator, DeleteRayClusterOperator

from rayslice.cloud.cluster_names import PER_RUN
from rayslice.cloud.kuberay import PodSettings

RAY_CONN = "ray_kuberay"
#: The image docker/Dockerfile.tpu builds, pushed where your nodes pull from (docs/deploying-gke.md, step 3).
IMAGE = "us-docker.pkg.dev/my-project/ml/rayslice-cluster:0.1.0-tpu"
#: The Ray pods' Kubernetes service account, which Workload Identity maps to the checkpoint bucket (step 4).
PODS = PodSettings(service_account="ray-ksa")


@dag(schedule=None, start_date=datetime(2026, 1, 1), catchup=False, tags=["rayslice", "kuberay"])
def rayslice_kuberay_cluster_per_run():
    create = CreateRayClusterOperator(task_id="create_cluster", ray_conn_id=RAY_CONN, name=PER_RUN,
                                      tpus=["v6e-16"], image=IMAGE, pods=PODS)

    # The run's cluster starts with no TPU node: scaling a slice from zero can take longer than 600 s.
    @task.tpu_slice(tpu="v6e-16", ray_conn_id=RAY_CONN, kuberay_cluster=PER_RUN, capacity_timeout=1800)
    def train():
        import jax

        return {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count()}

    delete = DeleteRayClusterOperator(task_id="delete_cluster", ray_conn_id=RAY_CONN, name=PER_RUN)
    create >> train() >> delete.as_teardown(setups=create)


rayslice_kuberay_cluster_per_run()
