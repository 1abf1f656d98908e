"""A daily pipeline: prepare on the worker, train on a TPU slice, evaluate on a quarter GPU, report.

The trigger form chooses the slice type (``tpu="{{ params.slice_type }}"`` is rendered, then
validated, before anything is submitted), the learning rate and the number of steps, which the
steps read from the ``params`` context key.

Training checkpoints with orbax into the step's ``checkpoint_dir`` and resumes from it after a
preemption (``preemption_retries=1``) or an Airflow retry; XCom carries only the checkpoint's
URL to the evaluation step, which restores it on a quarter GPU.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import Param, dag, task

#: Slice types offered in the trigger form (all valid v6e slices up to 32 chips).
SLICE_TYPES = ["v6e-4", "v6e-8", "v6e-16", "v6e-32"]


#: The weights the synthetic data is drawn from; evaluation reports how close training got.
TRUE_WEIGHTS = [1.0, 2.0, 3.0, 4.0]


def batch(dataset: dict, step: int, rows: int, process: int):
    """This process's share of step `step`'s batch: a function of (seed, step, process) only.

    So a run resumed from a checkpoint at step N sees exactly the batches an uninterrupted
    run sees from step N on, and ends with the same parameters.
    """
    import numpy as np

    rng = np.random.default_rng([dataset["seed"], step, process])
    x = rng.normal(size=(rows, dataset["features"])).astype(np.float32)
    return x, x @ np.asarray(TRUE_WEIGHTS[: dataset["features"]], dtype=np.float32)


def step_batch(dataset: dict, step: int, global_rows: int):
    """Step `step`'s whole global batch of `global_rows` rows: a function of (seed, step) only.

    No host count goes in, so the batch, and with it every step of `fit(..., global_rows=...)`, is
    the same on one slice or three: a run that resumes on another slice count ends as a fixed-size
    run ends. (`batch`'s batches depend on the process, so their global batch changes with the
    number of hosts.)
    """
    import numpy as np

    rng = np.random.default_rng([dataset["seed"], step])
    x = rng.normal(size=(global_rows, dataset["features"])).astype(np.float32)
    return x, x @ np.asarray(TRUE_WEIGHTS[: dataset["features"]], dtype=np.float32)


def process_block(dataset: dict, step: int, global_rows: int, process: int, processes: int):
    """Process `process`'s consecutive block of `step_batch`: `global_rows // processes` rows.

    Rows [process * n, (process + 1) * n) of the global batch: each process draws the whole (small)
    global batch and keeps its own block, in the order `jax.devices()` lists the processes'
    devices, so the blocks make up `step_batch` again.
    """
    if global_rows % processes:
        raise ValueError(f"global_rows={global_rows} does not split into {processes} equal per-process blocks")
    rows = global_rows // processes
    x, y = step_batch(dataset, step, global_rows)
    return x[process * rows:(process + 1) * rows], y[process * rows:(process + 1) * rows]


def fit(dataset: dict, learning_rate: float, steps: int, checkpoint_every: int = 2,
        seconds_per_step: float = 0.0, heed_notice: bool = True, global_rows: int | None = None) -> dict:
    """Gradient descent on y = x @ w, data-parallel over every device of the slice, checkpointed with orbax.

    Every `checkpoint_every` steps (and at the end) the parameters go to the step's
    `checkpoint_dir` (`rayslice.get_step_context()`); a start that finds a checkpoint there
    (a preemption retry, an Airflow retry, a suspension) resumes from the newest complete one.
    After each step the hosts agree whether a preemption notice reached any of them
    (`context.preempted`); if so they checkpoint that step and stop (`rayslice.StepSuspended`),
    so no completed step is lost. `heed_notice=False` ignores notices (the launcher then stops
    the step shortly before the deadline, and it resumes from its last periodic checkpoint).

    Without `global_rows`, each process draws `rows_per_device` rows per local device
    (`batch`), so the global batch, and the training, depend on the number of hosts: a resume
    must run on the slice shape that saved. With `global_rows`, each step's global batch is
    `step_batch(dataset, step, global_rows)`, a function of (seed, step) only, and each process
    feeds its own consecutive block of `global_rows // jax.process_count()` rows; the loss is the
    mean over that global batch, so the gradient and every step are the same on any number of
    slices (within float32 reduction order), and a run that resumes on another slice count ends
    where a fixed-size run ends. `global_rows` must be divisible by `jax.device_count()` (every
    device gets the same share of rows), or `ValueError`. The result then also says
    `resumed_from` (the checkpoint step it started from, 0 for a fresh start) and `devices`.

    The restore onto another mesh is orbax's: `StandardRestore` is given the freshly built
    parameters, replicated (`NamedSharding(mesh, P())`) on *this* run's mesh, as its target, so
    orbax reads the saved array and places it with that target's sharding, whatever mesh (how
    many devices, hosts or slices) wrote it. Nothing of the saving mesh is needed.
    """
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from rayslice import StepSuspended, get_step_context

    context = get_step_context()

    def any_host_noticed() -> bool:  # every host must stop at the same step: the checkpoint save is collective
        flag = np.array([int(context.preempted)], dtype=np.int32)
        return bool(np.asarray(multihost_utils.process_allgather(flag)).any()) if jax.process_count() > 1 \
            else bool(flag[0])

    if global_rows is not None and (global_rows <= 0 or global_rows % jax.device_count()):
        raise ValueError(f"global_rows={global_rows} must be a positive multiple of the {jax.device_count()} "
                         f"devices of this run ({jax.process_count()} process(es)), so every device gets as many rows")
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = dataset["rows_per_device"] * jax.local_device_count()
    by_row, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

    def global_batch(i: int):
        if global_rows is None:
            x, y = batch(dataset, i, rows, jax.process_index())
            return (jax.make_array_from_process_local_data(by_row, x),
                    jax.make_array_from_process_local_data(by_row, y))
        x, y = process_block(dataset, i, global_rows, jax.process_index(), jax.process_count())
        return (jax.make_array_from_process_local_data(by_row, x, (global_rows, dataset["features"])),
                jax.make_array_from_process_local_data(by_row, y, (global_rows,)))

    def loss_of(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    @jax.jit
    def train_step(w, x, y):  # the global arrays are arguments: a jit may not close over non-local shards
        loss, grad = jax.value_and_grad(loss_of)(w, x, y)
        return w - learning_rate * grad, loss

    w = jax.device_put(jnp.zeros(dataset["features"], dtype=jnp.float32), replicated)
    manager = None
    start = 0
    if context.checkpoint_path:
        manager = ocp.CheckpointManager(
            context.checkpoint_path,
            options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False),
        )
        if manager.latest_step() is not None:  # only complete checkpoints count; half-written ones are ignored
            start = manager.latest_step()
            w = manager.restore(start, args=ocp.args.StandardRestore({"w": w}))["w"]
            print(f"resumed from step {start} (preemption attempt {context.preemption_attempt}, "
                  f"try {context.try_number})", flush=True)
    for i in range(start, steps):
        w, loss = train_step(w, *global_batch(i))
        print(f"step {i}: loss {float(loss):.6f}", flush=True)
        if manager and (i + 1) % checkpoint_every == 0:
            manager.save(i + 1, args=ocp.args.StandardSave({"w": w}))
        if manager and heed_notice and i + 1 < steps and any_host_noticed():
            if manager.latest_step() != i + 1:
                manager.save(i + 1, args=ocp.args.StandardSave({"w": w}), force=True)
            manager.wait_until_finished()
            print(f"preemption notice: checkpointed step {i + 1} of {steps}; stopping", flush=True)
            raise StepSuspended(f"checkpointed step {i + 1} for a preemption notice")
        time.sleep(seconds_per_step)
    if manager:
        if manager.latest_step() != steps:
            manager.save(steps, args=ocp.args.StandardSave({"w": w}), force=True)
        manager.wait_until_finished()
    final = float(jax.jit(loss_of)(w, *global_batch(steps)))
    result = {
        "loss": final,
        "weights": [float(v) for v in np.asarray(jax.device_get(w))],
        "checkpoint": f"{context.checkpoint_dir}/{steps}" if context.checkpoint_dir else None,
    }
    if global_rows is not None:  # a resharding run says where it resumed and on how many devices
        result |= {"resumed_from": start, "devices": jax.device_count()}
    return result


def evaluate_checkpoint(checkpoint: str, dataset: dict) -> dict:
    """Restore the trained parameters from storage (orbax) on this one device and score them."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp

    from rayslice import as_path

    if not checkpoint:
        raise ValueError("training wrote no checkpoint: this pipeline hands the model over through storage, so give "
                         "the cluster a checkpoint root (RAYSLICE_CHECKPOINT_ROOT, the `ray` connection's "
                         "'checkpoint_root' extra, or checkpoint_root= on the task)")
    device = jax.devices()[0]
    target = {"w": jax.ShapeDtypeStruct((dataset["features"],), jnp.float32,
                                        sharding=jax.sharding.SingleDeviceSharding(device))}
    w = ocp.StandardCheckpointer().restore(f"{as_path(checkpoint)}/default", target)["w"]
    x, y = batch(dataset, step=10**6, rows=256, process=0)  # held out: no training step draws it
    return {
        "checkpoint": checkpoint,
        "heldout_loss": float(jnp.mean((jnp.asarray(x) @ w - jnp.asarray(y)) ** 2)),
        "weight_error": float(np.max(np.abs(np.asarray(w) - np.asarray(TRUE_WEIGHTS[: dataset["features"]])))),
    }


@dag(
    dag_id="rayslice_training_pipeline",
    schedule="@daily",
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["rayslice", "tpu", "gpu", "pipeline"],
    params={
        "slice_type": Param("v6e-4", enum=SLICE_TYPES, title="TPU slice type",
                            description="The slice the training step reserves."),
        "learning_rate": Param(0.1, type="number", minimum=0.0001, maximum=1.0, title="Learning rate"),
        "steps": Param(6, type="integer", minimum=1, maximum=1000, title="Training steps"),
    },
)
def training_pipeline():
    @task
    def prepare() -> dict:
        return {"features": 4, "rows_per_device": 8, "seed": 0}

    @task.tpu_slice(tpu="{{ params.slice_type }}", preemption_retries=1)
    def train(dataset: dict, params: dict | None = None) -> dict:
        return fit(dataset, float(params["learning_rate"]), steps=int(params["steps"]))

    @task.ray_accelerator(accelerator="GPU", count=0.25)
    def evaluate(trained: list, dataset: dict) -> dict:  # one result per host; they agree
        return {"hosts": len(trained), "train_loss": trained[0]["loss"],
                **evaluate_checkpoint(trained[0]["checkpoint"], dataset)}

    @task
    def report(metrics: dict, params: dict | None = None) -> str:
        return (f"{params['slice_type']} trained on {metrics['hosts']} host(s) at "
                f"lr={params['learning_rate']}: loss {metrics['train_loss']:.4f}, "
                f"held-out loss {metrics['heldout_loss']:.4f} from {metrics['checkpoint']}")

    dataset = prepare()
    report(evaluate(train(dataset), dataset))


training_pipeline()
