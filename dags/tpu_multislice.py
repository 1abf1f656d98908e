"""Two v6e-16 slices as one multislice JAX job: 8 host processes, 32 devices in one group.

XCom: ``[32] * 8`` (every host sees all 32 chips of both slices).
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import dag, task


@dag(
    dag_id="rayslice_tpu_multislice",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["rayslice", "tpu", "multislice"],
)
def tpu_multislice():
    @task.tpu_slice(tpu="v6e-16", num_slices=2, multislice=True)
    def global_devices() -> int:
        import jax

        print(f"process {jax.process_index()} of {jax.process_count()}: "
              f"{jax.local_device_count()} local, {jax.device_count()} global devices", flush=True)
        return jax.device_count()

    global_devices()


tpu_multislice()
