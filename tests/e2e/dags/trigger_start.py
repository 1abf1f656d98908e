"""DAGs for tests/e2e/test_trigger_start.py: steps that start, run and end in the triggerer."""

from datetime import datetime, timedelta

from airflow.sdk import dag, task

START = datetime(2026, 1, 1)
ITEMS = 6


def work(item: int) -> dict:
    import os

    for line in range(3):
        print(f"item {item} line {line}", flush=True)
    return {"item": item, "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")}


@dag(dag_id="ts_mapped", schedule=None, start_date=START, catchup=False, max_active_tasks=ITEMS)
def ts_mapped():
    @task
    def items() -> list[int]:  # mapped over an upstream task's output: the trigger reads that XCom
        return list(range(ITEMS))

    @task.ray_accelerator(accelerator="GPU", count=0.25, poll_interval=0.5)
    def step(item: int, scale: int) -> dict:
        return {**work(item), "scale": scale}

    @task
    def total(results: list) -> int:  # on a worker: reads the steps' XComs as a downstream task does
        assert all(isinstance(r, dict) for r in results), [type(r).__name__ for r in results]
        return sum(r["item"] for r in results)

    total(step.partial(scale=10).expand(item=items()))


@dag(dag_id="ts_retry", schedule=None, start_date=START, catchup=False)
def ts_retry():
    @task.ray_accelerator(accelerator="GPU", count=0.25, poll_interval=0.5, retries=1, retry_delay=timedelta(0))
    def flaky(try_number: str) -> str:
        if int(try_number) == 1:
            raise RuntimeError("try 1 fails on purpose")
        return f"try {try_number}"

    @task
    def echo(value: str) -> str:
        assert value == "try 2", repr(value)
        return value

    echo(flaky(try_number="{{ ti.try_number }}"))


ts_mapped()
ts_retry()
