"""DAGs for tests/e2e/test_shared_day.py: a compressed day on one shared cluster (issue 49).

`day_train`: an elastic (1, 2) x v6e-16 preemptible training of team `research` (connection
`day_research`), beside a sweep of quarter-GPU steps (`.expand`). `day_eval`: an urgent one-slice
evaluation of team `oncall` (connection `day_oncall`), at a higher priority. The test creates both
connections, sets the queue's quotas and `preemption: lower-priority`, and starts the runs.

The training is exactly checkable on any number of slices: its state is an integer, updated each
step from the sum of that step's global batch, a function of (seed, step) only, which every device
sums over its own rows and a `psum` over all devices of all hosts adds up. Whatever the slice
count, and however often it is suspended, the final state is `expected_state(...)`. Its lead
process appends what it did to `steps.log` in the checkpoint folder (`done N attempt A ...`,
`saved N attempt A`), so the test can prove that no step ran twice after its checkpoint.
"""

from datetime import datetime

from airflow.sdk import DAG, task

START = datetime(2026, 1, 1)
#: The global batch's rows: a multiple of 16 and 32, the devices of one and two v6e-16.
GLOBAL_ROWS = 64
MODULUS = 2**31 - 1


def train(steps: int | str, checkpoint_every: int | str, seconds_per_step: float | str, seed: int | str,
          feed: str) -> dict:
    """The integer state after `steps` steps, resumed from the newest checkpoint in the step's checkpoint folder.

    After each step the hosts agree (allgather) whether any of them heard a notice (a drain, a
    higher-priority step, an offer to grow); if so the lead saves that step and every host stops
    with `StepSuspended`, so no completed step is done again.

    Its data arrives as a stream: step N's batch may be read once the file `feed` says at least N+1
    (the test publishes the stream as the day goes on, so each notice reaches a training that is
    running, whatever Airflow's and the machine's latencies). While it waits, it heeds notices too.
    """
    import json
    import os
    import time
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import rayslice

    try:
        from jax import shard_map
    except ImportError:  # older JAX
        from jax.experimental.shard_map import shard_map

    steps, checkpoint_every, seed = int(steps), int(checkpoint_every), int(seed)  # rendered from the run's conf
    seconds_per_step = float(seconds_per_step)
    context = rayslice.get_step_context()
    folder = Path(context.checkpoint_dir.removeprefix("file://"))
    lead = jax.process_index() == 0
    devices, attempt = jax.device_count(), context.preemption_attempt
    where = f"attempt {attempt} devices {devices} slices {context.num_slices}"

    def note(line: str) -> None:
        with open(folder / "steps.log", "a") as log:
            log.write(f"{line} at {time.time():.3f}\n")

    if lead:
        folder.mkdir(parents=True, exist_ok=True)
    multihost_utils.sync_global_devices("folder made")
    if context.worker_id == 0:  # one line per slice: where this attempt runs (the test drains one of them)
        note(f"slice {context.slice_name} {where} submission {context.submission_id}")
    saved = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())
    start = saved[-1] if saved else 0
    state = json.loads((folder / str(start) / "state.json").read_text())["state"] if saved else 0
    # Every process read the same checkpoint: the one the lead read.
    start, state = (int(v) for v in multihost_utils.broadcast_one_to_all(np.array([start, state], dtype=np.int64)))
    if lead:
        note(f"start {start} {where}")

    mesh = Mesh(np.array(jax.devices()), ("d",))
    by_row = NamedSharding(mesh, P("d"))
    total_of = jax.jit(shard_map(lambda rows: jax.lax.psum(jnp.sum(rows), "d"), mesh=mesh, in_specs=P("d"),
                                 out_specs=P()))
    per_process = GLOBAL_ROWS // jax.process_count()
    me = jax.process_index()

    def save(step: int) -> None:
        if lead:
            with context.checkpointing():
                partial = folder / f"{step}.partial"
                partial.mkdir(exist_ok=True)
                (partial / "state.json").write_text(json.dumps({"state": state}))
                os.replace(partial, folder / str(step))  # complete, or not there at all
            note(f"saved {step} {where}")
        multihost_utils.sync_global_devices(f"saved {step}")

    def fed_or_noticed(step: int) -> bool:
        """Whether any host heard a notice, once the feed has published step `step`'s batch (or a notice came).

        Every host takes part in each round (an allgather of the notice flags and the lead's view of the
        feed), so all of them leave the wait at the same round, together.
        """
        while True:
            published = int(Path(feed).read_text() or 0) if lead and Path(feed).exists() else 0
            flags = np.array([int(context.preempted), published], dtype=np.int32)
            gathered = np.asarray(multihost_utils.process_allgather(flags)).reshape(-1, 2)
            if gathered[:, 0].any():
                return True
            if gathered[:, 1].max() > step:
                return False
            time.sleep(0.2)

    last_saved = start
    for step in range(start, steps):
        if fed_or_noticed(step):  # a notice while waiting for the data: the newest step is saved already?
            if step > last_saved:
                save(step)
            raise rayslice.StepSuspended(f"saved step {step} on a notice")
        rows = np.random.default_rng([seed, step]).integers(0, 1000, size=GLOBAL_ROWS, dtype=np.int32)
        block = rows[me * per_process:(me + 1) * per_process]
        total = total_of(jax.make_array_from_process_local_data(by_row, block, (GLOBAL_ROWS,)))
        state = (state * 31 + int(total.addressable_data(0))) % MODULUS
        time.sleep(seconds_per_step)
        if lead:
            note(f"done {step + 1} {where}")
        flag = np.array([int(context.preempted)], dtype=np.int32)
        noticed = bool(np.asarray(multihost_utils.process_allgather(flag)).any())
        if (step + 1) % checkpoint_every == 0 or step + 1 == steps or noticed:
            save(step + 1)
            last_saved = step + 1
        if noticed and step + 1 < steps:
            raise rayslice.StepSuspended(f"saved step {step + 1} on a notice")
    return {"state": state, "devices": devices, "attempt": attempt, "resumed_from": start}


def evaluate(out: str) -> dict:
    """The urgent evaluation: when its body started on this host, and its job; it holds the slice 5 s."""
    import json
    import time
    from pathlib import Path

    import rayslice

    started = time.time()
    context = rayslice.get_step_context()
    record = {"started": started, "submission_id": context.submission_id, "worker": context.worker_id}
    with open(Path(out) / "evaluation.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    time.sleep(5)
    return record


def score(scale: int) -> dict:
    """One point of the sweep on a quarter GPU: a small JAX result, and its job."""
    import jax.numpy as jnp

    import rayslice

    return {"scale": scale, "score": int(jnp.sum(jnp.arange(8) * scale)),
            "submission_id": rayslice.get_step_context().submission_id}


with DAG("day_train", schedule=None, start_date=START, catchup=False):
    task.tpu_slice(tpu="v6e-16", num_slices=(1, 2), multislice=True, elastic_wait=10, preemptible=True,
                   preemption_retries=3, priority=0, ray_conn_id="day_research", retries=0,
                   checkpoint_root="{{ dag_run.conf['root'] }}", task_id="train")(train)(
        steps="{{ dag_run.conf['steps'] }}", checkpoint_every="{{ dag_run.conf['every'] }}",
        seconds_per_step="{{ dag_run.conf['seconds_per_step'] }}", seed="{{ dag_run.conf['seed'] }}",
        feed="{{ dag_run.conf['feed'] }}")
    task.ray_accelerator(accelerator="GPU", count=0.25, ray_conn_id="day_research", retries=0,
                         task_id="sweep")(score).expand(scale=[1, 2, 3, 4])

with DAG("day_eval", schedule=None, start_date=START, catchup=False):
    task.tpu_slice(tpu="v6e-16", priority=10, ray_conn_id="day_oncall", retries=0, capacity_timeout=300,
                   task_id="evaluate")(evaluate)(out="{{ dag_run.conf['out'] }}")
