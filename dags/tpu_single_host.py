"""The smallest TPU step: one single-host v6e-4 slice, returning what JAX sees there.

XCom: ``[4]`` (one item per host; JAX sees the host's 4 chips).
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import dag, task


@dag(
    dag_id="rayslice_tpu_single_host",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["rayslice", "tpu"],
)
def tpu_single_host():
    @task.tpu_slice(tpu="v6e-4")
    def device_count() -> int:
        import jax  # on the cluster only: DAG parsing never imports JAX

        return jax.device_count()

    device_count()


tpu_single_host()
