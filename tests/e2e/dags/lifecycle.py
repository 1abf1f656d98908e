"""DAGs for tests/e2e/test_task_lifecycle.py: one v6e-4 slice step per lifecycle scenario.

Every step is a single-host `v6e-4` (the lightest slice) so a 2-core machine can run the
module; `retries=0`, so a kill or a timeout is final.
"""

from datetime import datetime, timedelta

from airflow.sdk import DAG
from rayslice.operators.tpu_slice import TpuSliceOperator

START = datetime(2026, 1, 1)
#: The timeout scenarios' execution_timeout: long enough for the step to start and hold its slice first
#: (3.3-3.9 s from execute() on the 2-core machine, 2026-12-01: about 4x that; the test fails, saying so, if it
#: takes longer). Each scenario waits it out, so no longer than that.
TIMEOUT_S = 15


def hello():
    return "done"


def sleep_long():
    import time

    print("holding the slice", flush=True)
    time.sleep(600)


def slice_step(dag_id: str, python_callable, **kwargs) -> DAG:
    with DAG(dag_id, schedule=None, start_date=START, catchup=False) as dag:
        TpuSliceOperator(task_id="step", tpu="v6e-4", python_callable=python_callable, poll_interval=0.5,
                         **{"retries": 0, **kwargs})
    return dag


slice_step("lc_wait", hello, deferrable=True, capacity_timeout=300)
slice_step("lc_kill_running", sleep_long, deferrable=False)
slice_step("lc_kill_deferred", sleep_long, deferrable=True)
slice_step("lc_timeout_running", sleep_long, deferrable=False, execution_timeout=timedelta(seconds=TIMEOUT_S))
slice_step("lc_timeout_deferred", sleep_long, deferrable=True, execution_timeout=timedelta(seconds=TIMEOUT_S))
