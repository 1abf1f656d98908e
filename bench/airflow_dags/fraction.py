"""The DAG of `bench/fraction_throughput.py --mode airflow`: N quarter-GPU steps by dynamic task mapping."""

from __future__ import annotations

import os
from datetime import datetime

from airflow.sdk import DAG, task

STEPS = int(os.environ.get("RAYSLICE_BENCH_STEPS", "32"))
STEP_S = float(os.environ.get("RAYSLICE_BENCH_STEP_S", "0.5"))

with DAG("bench_fraction_mapping", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         max_active_tasks=STEPS + 8):

    @task.ray_accelerator(accelerator="GPU", count=0.25, deferrable=True, poll_interval=1, retries=0)
    def gpu_step(i: int, seconds: float) -> dict:
        import os
        import time

        start = time.time()
        time.sleep(seconds)
        return {"start": start, "end": time.time(), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "i": i}

    gpu_step.partial(seconds=STEP_S).expand(i=list(range(STEPS)))
