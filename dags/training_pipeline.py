"""A daily pipeline: prepare on the worker, train on a TPU slice, evaluate on a quarter GPU, report.

The trigger form chooses the slice type (``tpu="{{ params.slice_type }}"`` is rendered, then
validated, before anything is submitted) and the learning rate, which the steps read
from the ``params`` context key.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import Param, dag, task

#: Slice types offered in the trigger form (all valid v6e slices up to 32 chips).
SLICE_TYPES = ["v6e-4", "v6e-8", "v6e-16", "v6e-32"]


def fit(dataset: dict, learning_rate: float, steps: int) -> float:
    """Plain gradient descent on y = x @ w, data-parallel over every device of the slice."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = dataset["rows_per_device"] * jax.local_device_count()
    rng = np.random.default_rng(dataset["seed"] + jax.process_index())
    x_local = rng.normal(size=(rows, dataset["features"])).astype(np.float32)
    y_local = x_local @ np.ones(dataset["features"], dtype=np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), x_local)
    y = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), y_local)

    @jax.jit
    def step(w, x, y):  # the global arrays are arguments: a jit may not close over non-local shards
        loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
        return w - learning_rate * grad, loss

    w = jnp.zeros(dataset["features"])
    for i in range(steps):
        w, loss = step(w, x, y)
        print(f"step {i}: loss {float(loss):.4f}", flush=True)
    return float(loss)


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
    },
)
def training_pipeline():
    @task
    def prepare() -> dict:
        return {"features": 4, "rows_per_device": 8, "seed": 0}

    @task.tpu_slice(tpu="{{ params.slice_type }}")
    def train(dataset: dict, params: dict | None = None) -> float:
        return fit(dataset, float(params["learning_rate"]), steps=3)

    @task.ray_accelerator(accelerator="GPU", count=0.25)
    def evaluate(losses: list) -> dict:
        import jax.numpy as jnp

        return {"hosts": len(losses), "final_loss": float(jnp.mean(jnp.asarray(losses)))}

    @task
    def report(metrics: dict, params: dict | None = None) -> str:
        return (f"{params['slice_type']} trained on {metrics['hosts']} host(s) at "
                f"lr={params['learning_rate']}: loss {metrics['final_loss']:.4f}")

    report(evaluate(train(prepare())))


training_pipeline()
