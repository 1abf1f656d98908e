"""The training pipeline's checkpoints: resumed after a preemption notice and after an Airflow retry, exactly.

The notice test drains one host's node of a v6e-16 in the middle of training (after a checkpoint),
kills it at the deadline as the platform would, and starts it again afterwards, so the session
cluster keeps its two slices. (A node lost without notice: tests/rayslice/cluster/test_preemption.py.)
"""

from __future__ import annotations

import textwrap
import threading
import time
from pathlib import Path

import pytest

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.context import checkpoint_dir_for
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster
from tests.airflow_env import deployment, load_dag_file, task_instance, task_states, write_dag_file, xcom_values
from tests.conftest import wait_until
from tests.rayslice.cluster.test_launcher import assert_all_released
from tests.training_reference import assert_matches, reference_fit

pytestmark = pytest.mark.timeout(600)

DATASET = {"features": 4, "rows_per_device": 8, "seed": 7}


def _node_of(cluster, slice_name: str, worker_id: int) -> int:
    return next(i for i, n in enumerate(cluster.nodes) if n.slice_name == slice_name and n.worker_id == worker_id)


def _checkpointed_slice(folder: Path, hosts_group: str, ray) -> str | None:
    """Once a complete checkpoint exists, the slice the training runs on (from its hosts' placement group)."""
    from ray.util.placement_group import placement_group_table

    if not any(p.name.isdigit() for p in folder.glob("*")):
        return None
    groups = [g for g in placement_group_table().values() if g["name"] == hosts_group and g["state"] == "CREATED"]
    if not groups:
        return None
    nodes = {n["NodeID"]: n["Labels"] for n in ray.nodes()}
    return nodes[groups[0]["bundles_to_node_id"][0]]["ray.io/tpu-slice-name"]


NOTICE_DAG = textwrap.dedent(
    '''
    """A v6e-16 training step that heeds preemption notices; the test drains one of its hosts."""
    from datetime import datetime

    from airflow.sdk import DAG

    from rayslice.dags.training_pipeline import fit
    from rayslice.operators.tpu_slice import TpuSliceOperator

    with DAG("tp_notice", schedule=None, start_date=datetime(2026, 1, 1)):
        TpuSliceOperator(task_id="train", tpu="v6e-16", python_callable=fit, preemption_retries=1, retries=0,
                         op_kwargs={"dataset": DATASET, "learning_rate": 0.05, "steps": STEPS,
                                    "checkpoint_every": 4, "seconds_per_step": SECONDS})
    '''
)


def _running_slice(ray) -> str | None:
    """The slice under the only rayslice hosts placement group placed now (this test's step)."""
    from ray.util.placement_group import placement_group_table

    groups = [g for g in placement_group_table().values()
              if g["name"].startswith("rayslice:") and g["name"].endswith("/hosts") and g["state"] == "CREATED"]
    if len(groups) != 1:
        return None
    nodes = {n["NodeID"]: n["Labels"] for n in ray.nodes()}
    return nodes[groups[0]["bundles_to_node_id"][0]]["ray.io/tpu-slice-name"]


def test_a_preemption_notice_suspends_the_step_and_airflow_shows_one_try_that_succeeded_as_an_uninterrupted_run(
    airflow_db, ray_default, ray_driver, tmp_path, capfd
):
    """Issue 39: a drain with a 30 s deadline reaches a host of the running v6e-16 step in a real Airflow.

    The step checkpoints, frees its slice before the deadline (the node is then killed, as the
    platform would), resumes on the other v6e-16, and Airflow shows one try that succeeded, with
    the result of an uninterrupted run.
    """
    steps, seconds = 8, 2.0
    source = NOTICE_DAG.replace("DATASET", repr(DATASET)).replace("STEPS", str(steps)).replace("SECONDS", str(seconds))
    dags, errors = load_dag_file(write_dag_file("tp_notice", source))
    assert not errors
    root = Path(ray_default.checkpoint_root.removeprefix("file://")) / deployment() / "tp_notice"
    seen: dict = {}

    def platform_drains_host_2_after_a_checkpoint() -> None:
        name = wait_until(lambda: any(p.name.isdigit() for p in root.glob("*/train/*")) and _running_slice(ray_driver),
                          timeout=300, interval=0.2)
        if not name:
            return
        nodes = local_cluster.slice_nodes(ray_default, name, [2])
        seen["index"], seen["slice"] = next(iter(nodes)), name
        seen["deadline"] = local_cluster.drain(ray_default, list(nodes.values()), 30)
        while time.time() < seen["deadline"]:
            time.sleep(0.1)
        seen["free_before_deadline"] = _running_slice(ray_driver) != name
        local_cluster.kill_node(ray_default, seen["index"])

    platform = threading.Thread(target=platform_drains_host_2_after_a_checkpoint)
    platform.start()
    try:
        dr = dags["tp_notice"].test()
    finally:
        platform.join()
        if "index" in seen:
            local_cluster.restart_node(ray_default, seen["index"])
    out = capfd.readouterr().out
    assert "slice" in seen, "the step ended before its first checkpoint"
    assert task_states(dr) == {"train": "success"}
    assert task_instance(dr, "train").try_number == 1  # a suspension is no Airflow retry
    assert "no Airflow retry" in out and "resumes from the checkpoint of step" in out, out
    assert seen["free_before_deadline"]
    [resumed] = xcom_values(dr, "train")
    assert len(resumed) == 4
    assert_matches(resumed, reference_fit(DATASET, 0.05, steps, hosts=4))  # where an uninterrupted run ends
    assert wait_until(lambda: ray_driver.available_resources().get("TPU-v6e-16-head") == 2, timeout=120)
    assert_all_released(ray_driver)


RETRY_DAG = textwrap.dedent(
    '''
    """A step that checkpoints, then crashes on try 1; try 2 must find that checkpoint."""
    from datetime import datetime, timedelta

    from airflow.sdk import DAG

    from rayslice.operators.accelerator import AcceleratorOperator


    def checkpoint_then_crash_on_try_1():
        import jax.numpy as jnp
        import orbax.checkpoint as ocp

        from rayslice import get_step_context

        context = get_step_context()
        manager = ocp.CheckpointManager(context.checkpoint_path,
                                        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))
        if context.try_number == 1:
            manager.save(3, args=ocp.args.StandardSave({"w": jnp.arange(4.0)}))
            manager.wait_until_finished()
            raise RuntimeError("crashed after the checkpoint of step 3")
        step = manager.latest_step()
        w = manager.restore(step, args=ocp.args.StandardRestore({"w": jnp.zeros(4)}))["w"]
        return {"resumed_from": step, "w": [float(v) for v in w], "try": context.try_number,
                "checkpoint_dir": context.checkpoint_dir}


    with DAG("ckpt_retry", schedule=None, start_date=datetime(2026, 1, 1)):
        AcceleratorOperator(task_id="train", accelerator="GPU", count=0.25,
                            python_callable=checkpoint_then_crash_on_try_1, retries=1, retry_delay=timedelta(0))
    '''
)


def test_a_step_that_fails_after_a_checkpoint_resumes_from_it_on_the_next_airflow_try(airflow_db, ray_default,
                                                                                         capfd):
    dags, errors = load_dag_file(write_dag_file("ckpt_retry", RETRY_DAG))
    assert not errors
    dr = dags["ckpt_retry"].test()
    out = capfd.readouterr().out
    assert task_states(dr) == {"train": "success"}
    [result] = xcom_values(dr, "train")
    folder = checkpoint_dir_for(ray_default.checkpoint_root, Owner(dag_id="ckpt_retry", run_id=dr.run_id,
                                                                   task_id="train", deployment=deployment()))
    assert result == {"resumed_from": 3, "w": [0.0, 1.0, 2.0, 3.0], "try": 2, "checkpoint_dir": folder}
    assert "crashed after the checkpoint of step 3" in out
    assert "holds no checkpoint: the step starts fresh" in out  # try 1
    assert f"resuming: checkpoint_dir {folder} holds checkpoints of step(s) 3" in out and "by try 1" in out
    assert task_instance(dr, "train").try_number == 2


def test_an_unfinished_checkpoint_left_by_a_lost_attempt_never_breaks_the_resume(airflow_db, ray_driver, tmp_path,
                                                                                   capsys):
    """A host lost mid-save leaves orbax's `<step>.orbax-checkpoint-tmp-*`: the next attempt resumes before it."""
    from rayslice.dags.training_pipeline import fit

    from rayslice.cluster import run_step

    owner = Owner(submission_id=f"test-unfinished-{time.time_ns()}")

    def train(steps: int):
        return run_step(StepSpec.for_function(
            fit, request=TpuSliceRequest(tpu="v6e-4"), checkpoint_root=f"file://{tmp_path}", owner=owner,
            kwargs={"dataset": DATASET, "learning_rate": 0.05, "steps": steps, "checkpoint_every": 2},
        ))

    train(4)
    folder = Path(checkpoint_dir_for(f"file://{tmp_path}", owner).removeprefix("file://"))
    unfinished = folder / "6.orbax-checkpoint-tmp-1764540000"
    (unfinished / "default").mkdir(parents=True)
    (unfinished / "default" / "half-written").write_bytes(b"\0" * 10)
    capsys.readouterr()
    [resumed] = train(8)
    out = capsys.readouterr().out
    assert "holds checkpoints of step(s) 2, 4; the newest, step 4," in out
    [without] = run_step(StepSpec.for_function(
        fit, request=TpuSliceRequest(tpu="v6e-4"), checkpoint_root=f"file://{tmp_path / 'fresh'}",
        kwargs={"dataset": DATASET, "learning_rate": 0.05, "steps": 8, "checkpoint_every": 2},
        owner=Owner(submission_id=f"test-fresh-{time.time_ns()}")))
    assert resumed["weights"] == pytest.approx(without["weights"], abs=1e-6)
    assert resumed["checkpoint"].endswith("/8")


ROOTS_DAG = '''
"""Where checkpoint roots come from: the task's (templated) argument first, then the connection."""
from datetime import datetime

from airflow.sdk import DAG

from rayslice.operators.accelerator import AcceleratorOperator


def where():
    from rayslice import get_step_context

    return get_step_context().checkpoint_dir


with DAG("ckpt_roots", schedule=None, start_date=datetime(2026, 1, 1)):
    AcceleratorOperator(task_id="from_task", accelerator="GPU", count=0.25, python_callable=where,
                        checkpoint_root="file://__TMP__/task-root/{{ dag.dag_id }}")
    AcceleratorOperator(task_id="from_connection", accelerator="GPU", count=0.25, python_callable=where)
'''


def test_the_tasks_templated_root_wins_then_the_connections_extra(airflow_db, ray_default, tmp_path, monkeypatch):
    import json

    from tests.airflow_env import ray_connection_json

    conn = json.loads(ray_connection_json(ray_default.dashboard_url, ray_default.token))
    conn["extra"] = {"checkpoint_root": f"file://{tmp_path}/connection-root", "deployment": "roots-test"}
    monkeypatch.setenv("AIRFLOW_CONN_RAY_DEFAULT", json.dumps(conn))
    dags, errors = load_dag_file(write_dag_file("ckpt_roots", ROOTS_DAG.replace("__TMP__", str(tmp_path))))
    assert not errors
    dr = dags["ckpt_roots"].test()
    assert set(task_states(dr).values()) == {"success"}
    [from_task] = xcom_values(dr, "from_task")
    [from_connection] = xcom_values(dr, "from_connection")
    for task_id, root in (("from_task", f"file://{tmp_path}/task-root/ckpt_roots"),
                          ("from_connection", f"file://{tmp_path}/connection-root")):
        assert {"from_task": from_task, "from_connection": from_connection}[task_id] == checkpoint_dir_for(
            root, Owner(dag_id="ckpt_roots", run_id=dr.run_id, task_id=task_id, deployment="roots-test"))
    assert "/connection-root/roots-test/ckpt_roots/" in from_connection  # the connection's deployment extra
