"""DAGs for tests/e2e/test_trigger_move.py and test_two_airflows.py: steps that hold capacity until released.

A step holds its slice until the file `release` exists (the test creates it when it has seen
what it came for), so no scenario depends on how long anything takes.
"""

from datetime import datetime, timedelta

from airflow.sdk import DAG
from rayslice.operators.accelerator import AcceleratorOperator
from rayslice.operators.kuberay import CreateRayClusterOperator, DeleteRayClusterOperator

START = datetime(2026, 1, 1)


def hold_until_released(release: str, value: str):
    """Hold the slice until `release` exists (at most 10 min), printing `tick <n>` every 0.5 s; return
    `value` and the checkpoint folder."""
    import os
    import time

    import rayslice

    print("holding the slice until released", flush=True)
    deadline = time.monotonic() + 600
    ticks = 0
    while not os.path.exists(release):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{release} was not created within 10 min")
        ticks += 1
        print(f"tick {ticks}", flush=True)
        time.sleep(0.5)
    return {"value": value, "checkpoint_dir": rayslice.get_step_context().checkpoint_dir}


def twin(mode: str, release: str, try_number: str):
    """`hold`: hold until released; `fail_first`: try 1 fails at once, later tries return at once."""
    import rayslice

    if mode == "hold":
        return hold_until_released(release, "held")
    if int(try_number) == 1:
        raise RuntimeError("try 1 fails on purpose")
    return {"value": f"try {try_number}", "checkpoint_dir": rayslice.get_step_context().checkpoint_dir}


# A quarter GPU each: one process per step, and two Airflows' steps fit side by side.
with DAG("sc_moved_trigger", schedule=None, start_date=START, catchup=False):
    AcceleratorOperator(task_id="step", accelerator="GPU", count=0.25, python_callable=hold_until_released,
                        deferrable=True, poll_interval=0.5, retries=0,
                        op_kwargs={"release": "{{ dag_run.conf['release'] }}", "value": "{{ run_id }}"})

# Each Airflow also makes a RayCluster through the test's fake Kubernetes API server (connection
# `kuberay_twin`), with the same DAG, run id and cluster name in both: only its own is ever its own.
with DAG("sc_twin", schedule=None, start_date=START, catchup=False):
    create = CreateRayClusterOperator(task_id="cluster_create", ray_conn_id="kuberay_twin", tpus=["v6e-4"],
                                      head_service_type="LoadBalancer", deferrable=False, poll_interval=0.05,
                                      ready_timeout=60)
    step = AcceleratorOperator(task_id="step", accelerator="GPU", count=0.25, python_callable=twin, deferrable=False,
                               poll_interval=0.5, retries=1, retry_delay=timedelta(0), trigger_rule="all_done",
                               op_kwargs={"mode": "{{ dag_run.conf['mode'] }}",
                                          "release": "{{ dag_run.conf.get('release', '') }}",
                                          "try_number": "{{ ti.try_number }}"})
    delete = DeleteRayClusterOperator(task_id="cluster_delete", ray_conn_id="kuberay_twin", poll_interval=0.05,
                                      trigger_rule="all_done")
    create >> step >> delete
