"""DAGs for tests/faults/test_faults.py: a triggerer crash mid-step, and a run against a token-auth cluster.

Both use a single-host `v6e-4` (the lightest slice) and `retries=0`, so a second Ray job could
only come from a bug, never from a retry.
"""

from datetime import datetime

from airflow.sdk import DAG
from rayslice.operators.tpu_slice import TpuSliceOperator

START = datetime(2026, 1, 1)


def hold_until_released(folder: str):
    """Says it holds the slice, then keeps it until the test drops a `release` file."""
    import pathlib
    import time

    pathlib.Path(folder, "started").touch()
    print("holding the slice until released", flush=True)
    deadline = time.monotonic() + 300
    while not pathlib.Path(folder, "release").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("never released")
        time.sleep(0.2)
    return "released"


def count_devices(where: str):
    import jax

    print(f"asked from {where}", flush=True)
    return [jax.device_count(), where]


with DAG("faults_triggerer_restart", schedule=None, start_date=START, catchup=False):
    TpuSliceOperator(task_id="step", tpu="v6e-4", python_callable=hold_until_released, deferrable=True,
                     poll_interval=0.5, retries=0, op_kwargs={"folder": "{{ dag_run.conf['folder'] }}"})

with DAG("faults_token", schedule=None, start_date=START, catchup=False):
    # Deferred (the trigger polls with the token), then in the worker (the operator polls with it).
    kwargs = {"where": "{{ conn.ray_default.host }}"}  # a rendered field that comes from the connection
    deferred = TpuSliceOperator(task_id="deferred", tpu="v6e-4", python_callable=count_devices, deferrable=True,
                                poll_interval=0.5, retries=0, op_kwargs=kwargs)
    running = TpuSliceOperator(task_id="running", tpu="v6e-4", python_callable=count_devices, deferrable=False,
                               poll_interval=0.5, retries=0, op_kwargs=kwargs)
    deferred >> running
