"""`rayslice demo`: the whole product on this machine, start to finish.

Starts the local simulated cluster (two v6e-16, a v6e-4, three GPUs), runs the launcher
examples as real Ray jobs, runs the scheduled training pipeline DAG with real Airflow
(`dag.test()`), prints every result and the capacity before and after, then stops the cluster;
with `--ui` it leaves the cluster running under a real Airflow UI instead (`rayslice airflow up`).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from rich.console import Console
from rich.rule import Rule

from rayslice.client import capacity
from rayslice.client.submission import run_step_job
from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster

DEMO_SPEC = local_cluster.ClusterSpec(tpus=("v6e-16", "v6e-16", "v6e-4"), gpus=3)
console = Console()


def device_count() -> list[int]:
    """What every host sees, plus a real cross-host collective (sum of JAX process ids)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(jnp.array([jax.process_index()]))
    return [jax.device_count(), int(np.asarray(gathered).sum())]


def gpu_share() -> str:
    import os

    return f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}"


EXAMPLES = [
    ("v6e-4, single host", TpuSliceRequest(tpu="v6e-4"), device_count),
    ("v6e-16, 4 hosts", TpuSliceRequest(tpu="v6e-16"), device_count),
    ("2 x v6e-16, multislice", TpuSliceRequest(tpu="v6e-16", num_slices=2, multislice=True), device_count),
    ("2 x v6e-16, independent", TpuSliceRequest(tpu="v6e-16", num_slices=2), device_count),
    ("a quarter of a GPU", AcceleratorRequest(resource="GPU", count=0.25), gpu_share),
]


def show_capacity(record: local_cluster.ClusterRecord, when: str) -> None:
    console.print(Rule(f"capacity {when}"))
    console.print(capacity.render(capacity.snapshot(record.dashboard_url, token=record.token)))


def run_examples(record: local_cluster.ClusterRecord) -> None:
    for title, request, fn in EXAMPLES:
        console.print(Rule(f"{title}: {request}"))
        spec = StepSpec.for_function(fn, request=request, owner=Owner(dag_id="demo", run_id=uuid.uuid4().hex),
                                     launcher="installed")  # the local cluster runs this environment
        started = time.monotonic()
        result = asyncio.run(
            run_step_job(record.dashboard_url, spec, token=record.token, emit=lambda line: console.print(f"  {line}"))
        )
        console.print(f"[bold green]result[/] {result}  ({time.monotonic() - started:.1f} s)")


def run_pipeline(record: local_cluster.ClusterRecord) -> bool:
    """The scheduled training pipeline through real Airflow: `dag.test()` on a throwaway AIRFLOW_HOME.

    Airflow reads its configuration once, at import, so everything is set before the first import.
    """
    import rayslice.dags

    dags = Path(rayslice.dags.__file__).parent
    home = Path(tempfile.mkdtemp(prefix="rayslice-demo-airflow-"))
    bundle = {
        "name": "rayslice-examples",
        "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
        "kwargs": {"path": str(dags)},
    }
    os.environ.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
            "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps([bundle]),
            "AIRFLOW_CONN_RAY_DEFAULT": json.dumps(local_cluster.ray_connection(record.dashboard_url, record.token)),
        }
    )
    console.print(Rule("Airflow: rayslice_training_pipeline (prepare -> train on a slice -> evaluate -> report)"))
    from airflow.dag_processing.dagbag import DagBag
    from airflow.models.xcom import XComModel
    from airflow.utils import db
    from airflow.utils.session import create_session

    db.initdb()
    pipeline = DagBag(dag_folder=str(dags), safe_mode=False).dags["rayslice_training_pipeline"]
    run = pipeline.test(run_conf={"slice_type": "v6e-16", "learning_rate": 0.1})
    console.print(f"DAG run {run.run_id}: [bold]{run.state}[/]")
    order = {task_id: index for index, task_id in enumerate(pipeline.task_ids)}
    with create_session() as session:
        for ti in sorted(run.get_task_instances(session=session), key=lambda ti: order.get(ti.task_id, len(order))):
            rows = session.scalars(
                XComModel.get_many(run_id=run.run_id, dag_ids=run.dag_id, task_ids=ti.task_id, key="return_value")
            ).all()
            value = [XComModel.deserialize_value(row) for row in rows]
            console.print(f"  {ti.task_id}: {ti.state} -> {value[0] if len(value) == 1 else value}")
    return run.state == "success"


def start_ui(name: str, port: int) -> int:
    """`rayslice airflow up` on the demo's cluster, in a fresh process (this one's Airflow config is the demo's).

    The UI adopts the cluster: `rayslice airflow down` stops both.
    """
    console.print(Rule("the Airflow UI, on the demo's cluster"))
    cli = Path(sys.executable).with_name("rayslice")
    return subprocess.run([str(cli), "airflow", "up", "--cluster", name, "--port", str(port), "--adopt-cluster"],
                          env={k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}).returncode


def run_demo(name: str = "demo", ui_port: int | None = None) -> int:
    from rayslice.local import airflow_ui

    ui = airflow_ui.UiRecord.load("default")
    if ui is not None and ui.cluster == name:
        airflow_ui.down("default")  # a previous `demo --ui`: its UI runs on the cluster we are about to replace
    if (local_cluster.state_dir() / f"{name}.json").exists():
        local_cluster.down(name)  # a previous demo's cluster; it is ours by name
    console.print(Rule("starting the local cluster: head + 9 TPU hosts + a 3-GPU node"))
    started = time.monotonic()
    record = local_cluster.up(DEMO_SPEC, name=name)
    console.print(f"up in {time.monotonic() - started:.0f} s, dashboard {record.dashboard_url}")
    keep = False
    try:
        show_capacity(record, "before")
        run_examples(record)
        pipeline_ok = run_pipeline(record)
        show_capacity(record, "after")
        keep = ui_port is not None and pipeline_ok
    finally:
        if not keep:
            stopped = local_cluster.down(name)
            console.print(f"stopped the local cluster ({stopped} processes)")
    if not pipeline_ok:
        console.print("[bold red]the training pipeline failed; its task log is above[/]")
        return 1
    if ui_port is not None and start_ui(name, ui_port) != 0:
        local_cluster.down(name)
        return 1
    return 0
