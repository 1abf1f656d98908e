"""The DAG of bench/airflow_concurrency.py: N deferred slice steps mapped at once, plus a lag probe.

Half the steps ask for a v6e-4, half for a v6e-16; the benchmark holds every slice, so all of
them wait for capacity in the triggerer. The step would be trivial if it ever ran.
"""

from __future__ import annotations

import os
from datetime import datetime

from airflow.sdk import DAG, task
from lag_probe import LagProbeOperator

STEPS = int(os.environ.get("RAYSLICE_BENCH_STEPS", "32"))
POLL_S = float(os.environ.get("RAYSLICE_BENCH_POLL_S", "2"))

with DAG("bench_airflow_concurrency", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         max_active_tasks=STEPS + 8):
    LagProbeOperator(task_id="lag_probe", path="{{ dag_run.conf['probe_path'] }}", retries=0)

    for tpu, count in (("v6e-4", STEPS // 2), ("v6e-16", STEPS - STEPS // 2)):

        @task.tpu_slice(task_id=f"wait_{tpu.replace('-', '_')}", tpu=tpu, deferrable=True, poll_interval=POLL_S,
                        capacity_timeout=1800, retries=0)
        def step(i: int) -> int:
            return i

        step.expand(i=list(range(count)))
