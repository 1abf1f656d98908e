"""DAGs for tests/e2e/test_trigger_parity.py: the same DAG twice, steps started in the triggerer or on a worker.

`tp_trigger` has default steps (start, run and end in the triggerer); `tp_worker` the same steps with
`deferrable=False`. What DAG authors write around a step: mapping over its output (`.expand()` over a
list and over a dict, `.expand_kwargs()`), `multiple_outputs`, a step mapped over an upstream output,
a task group mapped over steps, upstream strings holding `{{ }}` and `{% %}`, arguments templated
from `params` and `dag_run.conf`, callbacks, retries, and `all_done` / `none_failed` tasks after a
step that fails once it is cleared (the run's conf names a file that makes it fail). Every step
prints `@@` lines, which must reach its task log both ways. The session Airflow keeps these DAGs'
XComs elsewhere (tests/e2e/xcom_backend/parity_xcom.py, a custom XCom backend). As few steps as
cover the patterns (one step's output serves several): each is a Ray job on a two-core CI machine.
"""

from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import dag, task, task_group

START = datetime(2026, 1, 1)
TEXT = "{{ 6 * 7 }} and {{ ds }}"
BLOCK = "{% for i in range(2) %}x{% endfor %}"


def _mark(kind: str, context) -> None:
    """Record a callback: a file named after the task instance, try and callback, in the run's `marks` folder."""
    ti = context["ti"]
    folder = (context["dag_run"].conf or {}).get("marks")
    if folder:
        Path(folder, f"{ti.dag_id}.{ti.task_id}.{ti.map_index}.{ti.try_number}.{kind}").touch()


def on_success(context) -> None:
    _mark("success", context)


def on_failure(context) -> None:
    _mark("failure", context)


def on_retry(context) -> None:
    _mark("retry", context)


def parity(mode: str):
    step = {"accelerator": "GPU", "count": 0.25, "poll_interval": 0.5,
            **({"deferrable": False} if mode == "worker" else {})}
    # Callbacks on some steps only: a step with an on_success_callback ends on a worker (Airflow forces it).
    callbacks = {"on_success_callback": on_success, "on_failure_callback": on_failure}

    @dag(dag_id=f"tp_{mode}", schedule=None, start_date=START, catchup=False, max_active_tasks=16,
         params={"n": 2})
    def tp():
        # One step's list of dicts is mapped over both ways: `.expand()` (a dict per index) and `.expand_kwargs()`.
        @task.ray_accelerator(**step)
        def shards() -> list:
            print("@@ shards", flush=True)
            return [{"x": 2}, {"x": 3}]

        @task
        def square(x: dict) -> int:
            return x["x"] * x["x"]

        @task
        def total(values: list) -> list:
            return sorted(values)

        @task
        def add(x: int) -> int:
            return x + 10

        listed = shards()
        total(square.expand(x=listed))
        add.expand_kwargs(listed)

        @task.ray_accelerator(**step, multiple_outputs=True)
        def pair() -> dict:
            print("@@ pair", flush=True)
            return {"a": 1, "b": "two"}

        @task
        def read_pair(a, b) -> list:
            return [a, b]

        @task
        def item(entry) -> list:  # mapped over a dict: one (key, value) per index
            return list(entry)

        outputs = pair()
        read_pair(outputs["a"], outputs["b"])
        item.expand(entry=outputs)

        @task
        def texts() -> list:
            return [TEXT, BLOCK]

        @task.ray_accelerator(**step, **callbacks)
        def echo(value, tag: str) -> list:
            print(f"@@ echo {tag}", flush=True)
            return [value, tag]

        upstream = texts()
        echo.partial(tag="{{ params.n }}-{{ dag_run.conf.get('c') }}").expand(value=upstream)

        @task_group  # the step's own output is the group's: `total_doubles` reads it per group index
        def group(x: int):
            @task.ray_accelerator(**step)
            def double(x: int) -> int:
                print(f"@@ double {x}", flush=True)
                return 2 * x

            return double(x)

        @task
        def total_doubles(values: list) -> list:
            return sorted(values)

        total_doubles(group.expand(x=[1, 2]))

        # Unmapped, it takes the upstream list (templates inside) whole, and a path from the run's conf.
        @task.ray_accelerator(**step, **callbacks, retries=1, retry_delay=timedelta(0), on_retry_callback=on_retry)
        def flip(marker: str, value) -> list:
            import os

            print("@@ flip", flush=True)
            if os.path.exists(marker):
                raise RuntimeError("flip fails on purpose")
            return [value, "flipped"]

        @task(trigger_rule="all_done")
        def after_all_done(value) -> list:
            return [value]

        @task(trigger_rule="none_failed")
        def after_none_failed(value) -> list:
            return [value]

        flipped = flip(marker="{{ dag_run.conf['marker'] }}", value=upstream)
        after_all_done(flipped)
        after_none_failed(flipped)

    return tp()


parity("trigger")
parity("worker")
