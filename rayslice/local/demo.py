"""`rayslice demo`: the whole product on this machine, start to finish.

Starts the local simulated cluster (two v6e-16, a v6e-4, three GPUs), runs the launcher
examples as real Ray jobs, runs the scheduled training pipeline DAG with real Airflow
(`dag.test()`), prints every result and the capacity before and after, then stops the cluster;
with `--ui` it leaves the cluster running under a real Airflow UI instead (`rayslice airflow up`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.rule import Rule

from rayslice.client import capacity
from rayslice.client.submission import run_step_job
from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster

DEMO_SPEC = local_cluster.DEMO_SPEC
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


#: One line of Airflow's console log: time, level, event, logger, key=value pairs.
AIRFLOW_LINE = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z \[(?P<level>\w+)\s*\] (?P<event>.*?)\s+\[(?P<logger>[\w.]+)\]"
                          r"(?: \S+=.*)?$")


def shown(line: str) -> str | None:
    """What the demo shows of one line of Airflow's log (None: only in the log file).

    rayslice's own lines, each task's start, every error, and any line that is not Airflow's log
    (a traceback, a library's own print): not Airflow's ~200 lines of set-up and bookkeeping.
    """
    line = line.rstrip("\n")
    match = AIRFLOW_LINE.match(line)
    if match is None:
        return line if line.strip() else None
    event = match["event"]
    if match["level"] in ("error", "critical", "exception"):
        return line
    if event.startswith("[rayslice] "):
        return f"  {event}"
    if event.startswith("[DAG TEST] starting task_id="):
        return f"  task {event.split('task_id=', 1)[1].split()[0]}"
    return None


def same_on_every_host(value: object) -> object:
    """A slice step's per-host list, once when every host returned the same."""
    if isinstance(value, list) and len(value) > 1 and all(item == value[0] for item in value):
        return f"{value[0]} (the same from all {len(value)} hosts)"
    return value


@contextlib.contextmanager
def airflow_output(log: Path) -> Iterator[None]:
    """Inside the block this process's stdout and stderr go to `log`; a thread shows what `shown` keeps."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    done = threading.Event()
    out = os.fdopen(os.dup(saved[0]), "w", buffering=1)

    def relay() -> None:
        with open(log) as lines:
            while True:
                line = lines.readline()
                if line.endswith("\n") or (line and done.is_set()):
                    if (text := shown(line)) is not None:
                        out.write(text + "\n")
                elif done.is_set():
                    return
                else:
                    time.sleep(0.1)

    with open(log, "ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    thread = threading.Thread(target=relay, name="rayslice-demo-log", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        done.set()
        thread.join(timeout=10)
        out.close()
        for fd in saved:
            os.close(fd)


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

    log = home / "airflow-console.log"
    with airflow_output(log):  # Airflow's own log is ~200 lines per run: the file has them, the screen what matters
        db.initdb()
        pipeline = DagBag(dag_folder=str(dags), safe_mode=False).dags["rayslice_training_pipeline"]
        run = pipeline.test(run_conf={"slice_type": "v6e-16", "learning_rate": 0.1})
    console.print(f"DAG run {run.run_id}: [bold]{run.state}[/] (Airflow's whole log: {log})")
    if run.state != "success":  # everything Airflow said at the end, host lines included
        console.print("".join(log.read_text().splitlines(keepends=True)[-80:]), markup=False, highlight=False)
    order = {task_id: index for index, task_id in enumerate(pipeline.task_ids)}
    with create_session() as session:
        for ti in sorted(run.get_task_instances(session=session), key=lambda ti: order.get(ti.task_id, len(order))):
            rows = session.scalars(
                XComModel.get_many(run_id=run.run_id, dag_ids=run.dag_id, task_ids=ti.task_id, key="return_value")
            ).all()
            value = [XComModel.deserialize_value(row) for row in rows]
            console.print(f"  {ti.task_id}: {ti.state} -> {same_on_every_host(value[0] if len(value) == 1 else value)}")
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
        console.print("[bold red]the training pipeline failed: its errors and the end of its log are above[/]")
        return 1
    if ui_port is not None and start_ui(name, ui_port) != 0:
        local_cluster.down(name)
        return 1
    return 0
