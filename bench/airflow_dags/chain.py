"""A chain of four 1 s quarter-GPU steps, each taking the one before's result (bench/fraction_throughput.py)."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import dag, task


def one_second(index: int, previous: dict | None = None) -> dict:
    import time

    start = time.time()
    time.sleep(1)
    return {"index": index, "after": None if previous is None else previous["index"], "start": start,
            "end": time.time()}


@dag(dag_id="rayslice_bench_chain", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def bench_chain():
    @task.ray_accelerator(accelerator="GPU", count=0.25)
    def step(index: int, previous: dict | None = None) -> dict:
        return one_second(index, previous)

    result = None
    for index in range(4):
        result = step.override(task_id=f"step_{index}")(index, result)


bench_chain()
