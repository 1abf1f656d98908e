"""Data-parallel training on a v6e-16 slice: JAX + optax across all 4 hosts, a few steps.

Every host runs the same program (SPMD). Each builds its own quarter of the batch, the
parameters are replicated over a 16-device mesh, and the gradient mean crosses hosts
inside the jitted step. Each host prints its loss per step (prefixed with its host in the
task log); the XCom holds, per host, the devices it trained on and its final loss:
``[{"devices": 16, "loss": ...}] * 4`` (the loss is global, so the same on every host).
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import dag, task

FEATURES = 4
ROWS_PER_DEVICE = 8


def make_local_batch(seed: int, rows: int):
    """This host's share of the data: y = x @ [1, 2, 3, 4] + 0.5."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    y = x @ np.arange(1, FEATURES + 1, dtype=np.float32) + 0.5
    return x, y


def train_linear_model(steps: int, learning_rate: float) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = ROWS_PER_DEVICE * jax.local_device_count()
    x_local, y_local = make_local_batch(jax.process_index(), rows)
    by_row = NamedSharding(mesh, P("data"))
    x = jax.make_array_from_process_local_data(by_row, x_local)
    y = jax.make_array_from_process_local_data(by_row, y_local)

    optimizer = optax.adam(learning_rate)
    replicated = NamedSharding(mesh, P())

    def init():
        params = {"w": jnp.zeros(FEATURES), "b": jnp.zeros(())}
        return params, optimizer.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        def loss_fn(p):
            return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state = jax.jit(init, out_shardings=replicated)()
    loss = None
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, x, y)
        print(f"step {i}: loss {float(loss):.4f} (host {jax.process_index()}, "
              f"{jax.device_count()} devices)", flush=True)
    return {"devices": jax.device_count(), "loss": float(loss)}


@dag(
    dag_id="rayslice_tpu_slice_training",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["rayslice", "tpu", "training"],
)
def tpu_slice_training():
    # 1800 s: on a cluster whose TPU pools scale from zero (docs/deploying-gke.md), node creation, TPU start and
    # the image pull on every host can take longer than the default 600 s.
    @task.tpu_slice(tpu="v6e-16", capacity_timeout=1800)
    def train(steps: int = 5, learning_rate: float = 0.1) -> dict:
        return train_linear_model(steps, learning_rate)

    train()


tpu_slice_training()
