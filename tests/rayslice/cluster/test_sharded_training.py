"""Real sharded training on the simulated slices: each loop finishes and matches numpy on every host.

The steps run through the real launcher (`run_step`) on the session cluster: one process per host,
`chips per host` CPU devices each, gloo collectives across processes. Every process builds the same
seeded problem, feeds only its own rows (`jax.make_array_from_process_local_data`), dispatches the
jitted steps without waiting on each (as a training loop does: the pattern that hung JAX 0.10.2's CPU
collectives, `bench/collectives_repro.py`), and returns the weights it holds; the test computes the
same steps in one process with numpy.
"""

from __future__ import annotations

import numpy as np
import pytest

from rayslice.core.accelerators import TpuSliceRequest
from tests.rayslice.cluster.test_launcher import assert_all_released, run

FEATURES = 8
OUTPUTS = 4
ROWS_PER_DEVICE = 4
LEARNING_RATE = 0.05
TOLERANCE = 1e-4


def problem(rows: int, outputs: int = 0):
    """The same seeded regression in every process and in the test: x, y (y is 2-D when outputs > 0)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    w_true = rng.normal(size=(FEATURES, outputs) if outputs else (FEATURES,)).astype(np.float32)
    y = (x @ w_true + 0.1 * rng.normal(size=(rows, outputs) if outputs else (rows,))).astype(np.float32)
    return x, y


def numpy_descent(x, y, steps: int):
    """Full-batch gradient descent on mean squared error, in one process (float64)."""
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    w = np.zeros((x.shape[1], *y.shape[1:]))
    for _ in range(steps):
        w = w - LEARNING_RATE * 2.0 / y64.size * x64.T @ (x64 @ w - y64)
    return w


def process_rows(total: int):
    """This process's block of rows: processes own consecutive blocks, as jax.devices() orders them."""
    import jax

    per_process = total // jax.process_count()
    return slice(jax.process_index() * per_process, (jax.process_index() + 1) * per_process)


def data_parallel(steps: int):
    """A global 1-D mesh of every device; batch sharded, weights replicated; jit's all-reduce."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    x, y = problem(ROWS_PER_DEVICE * jax.device_count())
    mine = process_rows(len(x))
    batch, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    xs = jax.make_array_from_process_local_data(batch, x[mine], x.shape)
    ys = jax.make_array_from_process_local_data(batch, y[mine], y.shape)

    def step(w, xs, ys):
        return w - LEARNING_RATE * jax.grad(lambda w: jnp.mean((xs @ w - ys) ** 2))(w)

    step = jax.jit(step, out_shardings=replicated)
    w = jax.jit(lambda: jnp.zeros(FEATURES, jnp.float32), out_shardings=replicated)()
    for _ in range(steps):
        w = step(w, xs, ys)
    return [jax.device_count(), np.asarray(w.addressable_data(0)).tolist()]


def data_and_model(steps: int):
    """A 2-D mesh (data = hosts, model = each host's chips); the weight matrix sharded by columns."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count()), ("data", "model"))
    x, y = problem(ROWS_PER_DEVICE * jax.device_count(), OUTPUTS * jax.local_device_count())
    mine = process_rows(len(x))
    xs = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data", None)), x[mine], x.shape)
    ys = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data", "model")), y[mine], y.shape)
    columns = NamedSharding(mesh, P(None, "model"))

    def step(w, xs, ys):
        return w - LEARNING_RATE * jax.grad(lambda w: jnp.mean((xs @ w - ys) ** 2))(w)

    step = jax.jit(step, out_shardings=columns)
    w = jax.jit(lambda: jnp.zeros((FEATURES, y.shape[1]), jnp.float32), out_shardings=columns)()
    for _ in range(steps):
        w = step(w, xs, ys)
    shard = w.addressable_shards[0].data.shape
    if shard != (FEATURES, OUTPUTS):
        raise AssertionError(f"the weight matrix is not split by columns: a shard is {shard}")
    whole = jax.jit(lambda w: w, out_shardings=NamedSharding(mesh, P()))(w)  # an all-gather of the columns
    return [jax.device_count(), np.asarray(whole.addressable_data(0)).tolist()]


def shard_map_psum(steps: int):
    """The gradient written per shard with `jax.shard_map`, summed across every device with `psum`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    x, y = problem(ROWS_PER_DEVICE * jax.device_count())
    mine = process_rows(len(x))
    batch = NamedSharding(mesh, P("data"))
    xs = jax.make_array_from_process_local_data(batch, x[mine], x.shape)
    ys = jax.make_array_from_process_local_data(batch, y[mine], y.shape)
    rows = len(x)

    def local_gradient(w, xs, ys):
        return jax.lax.psum(2.0 * xs.T @ (xs @ w - ys), "data") / rows

    gradient = jax.shard_map(local_gradient, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P())
    step = jax.jit(lambda w, xs, ys: w - LEARNING_RATE * gradient(w, xs, ys))
    w = jax.jit(lambda: jnp.zeros(FEATURES, jnp.float32), out_shardings=NamedSharding(mesh, P()))()
    for _ in range(steps):
        w = step(w, xs, ys)
    return [jax.device_count(), np.asarray(w.addressable_data(0)).tolist()]


def assert_every_host_matches(results, reference, devices):
    assert len(results) == devices // 4  # one result per host (4 chips each)
    for host, (seen, weights) in enumerate(results):
        assert seen == devices, (host, seen)
        diff = float(np.max(np.abs(np.asarray(weights) - reference)))
        assert diff <= TOLERANCE, f"host {host}: max abs diff {diff:.2e} from numpy"


@pytest.mark.parametrize(
    ("request_", "devices"),
    [
        (TpuSliceRequest(tpu="v6e-16"), 16),
        (TpuSliceRequest(tpu="v6e-16", num_slices=2, multislice=True), 32),
    ],
    ids=["v6e-16", "2xv6e-16-multislice"],
)
def test_data_parallel_training_matches_numpy(ray_driver, request_, devices):
    steps = 200
    results = run(request_, data_parallel, steps=steps)
    x, y = problem(ROWS_PER_DEVICE * devices)
    assert_every_host_matches(results, numpy_descent(x, y, steps), devices)
    assert_all_released(ray_driver)


def test_two_dimensional_mesh_shards_the_weight_matrix(ray_driver):
    steps = 100
    results = run(TpuSliceRequest(tpu="v6e-16"), data_and_model, steps=steps)
    x, y = problem(ROWS_PER_DEVICE * 16, OUTPUTS * 4)
    assert_every_host_matches(results, numpy_descent(x, y, steps), 16)
    assert_all_released(ray_driver)


def test_shard_map_psum_matches_numpy(ray_driver):
    steps = 100
    results = run(TpuSliceRequest(tpu="v6e-16"), shard_map_psum, steps=steps)
    x, y = problem(ROWS_PER_DEVICE * 16)
    assert_every_host_matches(results, numpy_descent(x, y, steps), 16)
    assert_all_released(ray_driver)
