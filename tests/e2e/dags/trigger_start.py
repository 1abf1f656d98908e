"""A DAG for tests/e2e/test_trigger_start.py: a step that fails once, then starts in the triggerer again."""

from datetime import datetime, timedelta

from airflow.sdk import dag, task

START = datetime(2026, 1, 1)


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


ts_retry()
