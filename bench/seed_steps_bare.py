"""The seed examples' JAX work without Ray, timed per venv: what a JAX/Python upgrade costs each step.

A simulated slice step is Ray's part (the same Ray in both venvs) plus, on every host process,
Python start, `import jax`, `jax.distributed.initialize` over gloo and the step itself. This times the
second part exactly as the simulation lays it out (one process per host, `chips per host` CPU
devices each): the demo's device-count step (a cross-host all-gather of the process ids) on v6e-4
(1 x 4), v6e-16 (4 x 4) and 2 x v6e-16 multislice (8 x 4), and the example DAG's 5 optax training
steps over a v6e-16 mesh (`dags/tpu_slice_training.py`). Each row: from starting the processes to
the last one exiting. Only jax, numpy and optax are needed, so any venv runs it:

    .venv/bin/python bench/seed_steps_bare.py [--reps 3]
    /path/to/py311-venv/bin/python bench/seed_steps_bare.py [--reps 3]

Each venv's table goes to bench/results/seed_steps_bare_py<version>_jax<version>.md (`--no-write`:
printed only). The harness (`_common.py`) imports nothing at start that such a venv may lack.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

SHAPES = [("v6e-4 device count", 1, "count"), ("v6e-16 device count", 4, "count"),
          ("2 x v6e-16 multislice device count", 8, "count"), ("v6e-16 5 optax training steps", 4, "train")]
CHIPS_PER_HOST = 4
NAME = "seed_steps_bare"


def count() -> None:
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    multihost_utils.process_allgather(jnp.array([jax.process_index()]))


def train() -> None:
    """dags/tpu_slice_training.py's train_linear_model(steps=5), without Airflow."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    rng = np.random.default_rng(jax.process_index())
    x_local = rng.normal(size=(8 * jax.local_device_count(), 4)).astype(np.float32)
    y_local = x_local @ np.arange(1, 5, dtype=np.float32) + 0.5
    by_row = NamedSharding(mesh, P("data"))
    x = jax.make_array_from_process_local_data(by_row, x_local)
    y = jax.make_array_from_process_local_data(by_row, y_local)
    optimizer = optax.adam(0.1)

    def init():
        params = {"w": jnp.zeros(4), "b": jnp.zeros(())}
        return params, optimizer.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state = jax.jit(init, out_shardings=NamedSharding(mesh, P()))()
    for _ in range(5):
        params, opt_state, loss = step(params, opt_state, x, y)
        float(loss)


def host(process_id: int, num_processes: int, port: int, what: str) -> None:
    import jax

    if num_processes > 1:  # as the simulation wires it: one process is not wired
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes,
                                   process_id=process_id, local_device_ids=list(range(CHIPS_PER_HOST)))
    {"count": count, "train": train}[what]()
    if num_processes > 1:
        jax.distributed.shutdown()


def run_once(processes: int, what: str) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={CHIPS_PER_HOST}"}
    from _common import stopwatch

    with stopwatch() as took:
        procs = [subprocess.Popen([sys.executable, __file__, "--host", str(i), str(processes), str(port), what],
                                  env=env) for i in range(processes)]
        codes = [p.wait(timeout=600) for p in procs]
    if any(codes):
        raise SystemExit(f"{what} on {processes} processes failed: exit codes {codes}")
    return took.s


def main() -> int:
    if len(sys.argv) == 6 and sys.argv[1] == "--host":  # a host process: nothing before JAX but what it needs
        host(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return 0
    from _common import Report, Table, median, parse_args

    args = parse_args(__doc__.splitlines()[0], default_reps=3, attach=False)
    from importlib.metadata import version

    report = Report(f"{NAME}_py{sys.version_info.major}{sys.version_info.minor}_jax{version('jax')}", args)
    report.note(f"python {sys.version.split()[0]}, jax {version('jax')}, {args.reps} reps, "
                f"load {os.getloadavg()[0]:.1f}")
    times: dict[str, list[float]] = {title: [] for title, _, _ in SHAPES}
    for _ in range(args.reps):
        for title, processes, what in SHAPES:
            times[title].append(run_once(processes, what))
    table = Table(f"The seed steps' JAX work, no Ray (python {sys.version.split()[0]}, jax {version('jax')})",
                  ["step", "median s", "min s", "max s"])
    for title, values in times.items():
        table.add(title, f"{median(values):.2f}", f"{min(values):.2f}", f"{max(values):.2f}")
    table.add("sum of medians", f"{sum(median(v) for v in times.values()):.2f}", "", "")
    table.notes.append(f"load at end {os.getloadavg()[0]:.1f}")
    report.add(table)
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
