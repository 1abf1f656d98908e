"""DAG for tests/e2e/test_cluster_set_drain.py: a training step on a cluster set, drained in the middle (issue 53).

`set_train.train` names the connection `pair_set`, which the test creates: the set of `pair_a` and
`pair_b`, two real local clusters (tests/cluster_pair.py), with a checkpoint root both read. The step
counts `steps` steps of `seconds_per_step`, saving after each one; a notice makes it save and suspend
(`StepSuspended`), and it resumes from the saved step wherever it is admitted next. It records which
cluster each body ran on (`bodies.jsonl`) and each step it did (`done.jsonl`) in its checkpoint folder.
"""

from datetime import datetime

from airflow.sdk import DAG, task


def train(steps: int | str, seconds_per_step: float | str) -> dict:
    """Steps `start..steps-1`, `start` read from the checkpoint; saves after each step, suspends on a notice."""
    import json
    import time
    from pathlib import Path

    import ray

    from rayslice import StepSuspended, get_step_context

    context = get_step_context()
    folder = Path(context.checkpoint_dir.removeprefix("file://"))
    folder.mkdir(parents=True, exist_ok=True)
    saved = folder / "step.json"
    start = json.loads(saved.read_text())["step"] if saved.exists() else 0
    gcs = ray.get_runtime_context().gcs_address
    with open(folder / "bodies.jsonl", "a") as out:
        out.write(json.dumps({"gcs": gcs, "from": start, "at": time.time()}) + "\n")
    for i in range(start, int(steps)):
        time.sleep(float(seconds_per_step))
        with open(folder / "done.jsonl", "a") as out:
            out.write(json.dumps({"step": i, "gcs": gcs}) + "\n")
        saved.write_text(json.dumps({"step": i + 1}))
        if context.preempted:
            raise StepSuspended(f"saved step {i + 1}")
    return {"gcs": gcs, "resumed_from": start}


with DAG("set_train", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         default_args={"retries": 1}):
    task.tpu_slice(tpu="v6e-4", ray_conn_id="pair_set", preemption_retries=2, poll_interval=0.5)(train)(
        steps="{{ dag_run.conf['steps'] }}", seconds_per_step="{{ dag_run.conf['seconds_per_step'] }}")
