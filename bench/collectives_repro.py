"""Bare-JAX reproduction of the CPU-collectives hang (no Ray, no rayslice): does a sharded training loop finish?

What the simulated cluster does, stripped to JAX: N processes on this machine, each
`jax.distributed.initialize` over gloo CPU collectives with `--xla_force_host_platform_device_count=D`
(D = chips per host), one global `Mesh` over every device, the batch fed per process with
`jax.make_array_from_process_local_data`, and S jitted full-batch gradient steps of a linear model
(data parallel: the gradient's sum over the batch is a cross-process all-reduce). Each process prints
its weights' distance from the same S steps computed in one process with numpy.

With JAX/jaxlib 0.10.2 (the newest on Python 3.11) this hangs with 4 devices per process: every
process idle inside the jitted step, each at a different step (2026-12-02: steps 34, 22, 34, 34 of
200 after 240 s). With JAX 0.12.0.1 it finishes (200 steps in 31 s, all processes within 2.2e-07 of
numpy). With `--sync` (wait for each step before dispatching the next) 0.10.2 finished too in that
run: the hang needs processes that dispatch ahead of each other, as a training loop does. The run
has a deadline, so a hang is reported (with each process's last dispatched step), never waited on.
No changelog entry of JAX or XLA found so far names the fix (openxla/xla#16430, a crash with CPU
collectives and several host-platform devices per process, is the closest upstream report); which
release between 0.10.2 and 0.12.0.1 fixed it is found by running this file on each.

    .venv/bin/python bench/collectives_repro.py [--processes 4] [--devices 4] [--steps 200] [--timeout 300] [--sync]

Only `jax` and `numpy` are needed, so any venv runs it (e.g. one with `jax==0.10.2` on Python 3.11).
Exit 0: every process finished and matched the reference (max abs diff <= 1e-4); 1: a mismatch;
2: the deadline passed (the hang).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

ROWS_PER_DEVICE = 8
FEATURES = 16
LEARNING_RATE = 0.05


def problem(num_rows: int):
    """The same data in every process (seeded): x (rows, features), y = x @ w_true + noise."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(num_rows, FEATURES)).astype(np.float32)
    w_true = rng.normal(size=(FEATURES,)).astype(np.float32)
    y = (x @ w_true + 0.1 * rng.normal(size=(num_rows,))).astype(np.float32)
    return x, y


def numpy_reference(x, y, steps: int):
    """The same full-batch gradient descent in one process (float64)."""
    import numpy as np

    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    w = np.zeros(x.shape[1])
    for _ in range(steps):
        w = w - LEARNING_RATE * 2.0 / len(y64) * x64.T @ (x64 @ w - y64)
    return w


def worker(process_id: int, num_processes: int, coordinator: str, steps: int, sync: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = ROWS_PER_DEVICE * jax.device_count()
    x, y = problem(rows)
    per_process = rows // num_processes
    mine = slice(process_id * per_process, (process_id + 1) * per_process)
    batch = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())
    xs = jax.make_array_from_process_local_data(batch, x[mine], x.shape)
    ys = jax.make_array_from_process_local_data(batch, y[mine], y.shape)

    def step(w, xs, ys):
        grad = jax.grad(lambda w: jnp.mean((xs @ w - ys) ** 2))(w)
        return w - LEARNING_RATE * grad

    step = jax.jit(step, out_shardings=replicated)
    w = jax.device_put(jnp.zeros(FEATURES, jnp.float32), replicated)
    for i in range(steps):
        w = step(w, xs, ys)  # dispatched; a process may run ahead of its peers, as a training loop does
        if sync:
            w.block_until_ready()
        print(json.dumps({"process": process_id, "step": i + 1}), flush=True)
    got = np.asarray(w.addressable_data(0))
    diff = float(np.max(np.abs(got - numpy_reference(x, y, steps))))
    print(json.dumps({"process": process_id, "done": True, "max_abs_diff": diff}), flush=True)
    jax.distributed.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--devices", type=int, default=4, help="host-platform devices per process (chips per host)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the run counts as hung")
    parser.add_argument("--sync", action="store_true", help="wait for each step before dispatching the next")
    parser.add_argument("--worker", nargs=3, type=int, metavar=("PROCESS_ID", "NUM_PROCESSES", "PORT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        process_id, num_processes, port = args.worker
        worker(process_id, num_processes, f"127.0.0.1:{port}", args.steps, args.sync)
        return 0

    import jax

    print(f"python {sys.version.split()[0]}, jax {jax.__version__}: {args.processes} processes x "
          f"{args.devices} devices, {args.steps} steps, deadline {args.timeout:.0f} s", flush=True)
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}"}
    port = free_port()
    logs = []
    procs = []
    started = time.monotonic()
    for pid in range(args.processes):
        out = open(f"/tmp/collectives_repro.{os.getpid()}.{pid}.log", "w+")
        logs.append(out)
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--steps", str(args.steps), *(["--sync"] if args.sync else []),
             "--worker", str(pid), str(args.processes), str(port)], env=env, stdout=out, stderr=subprocess.STDOUT))
    deadline = started + args.timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.5)
    hung = any(p.poll() is None for p in procs)
    for p in procs:  # only the processes this script started
        if p.poll() is None:
            p.kill()
            p.wait()
    elapsed = time.monotonic() - started
    results, last_steps = {}, {}
    for pid, out in enumerate(logs):
        out.seek(0)
        for line in out:
            if line.startswith("{"):
                record = json.loads(line)
                last_steps[pid] = record.get("step", last_steps.get(pid))
                if record.get("done"):
                    results[pid] = record["max_abs_diff"]
        out.close()
        os.unlink(out.name)
    if hung:
        steps = ", ".join(f"process {pid}: step {last_steps.get(pid, 0)}" for pid in range(args.processes))
        print(f"HUNG: not finished after {elapsed:.0f} s ({steps})")
        return 2
    failed = [pid for pid, p in enumerate(procs) if p.returncode != 0 or pid not in results]
    if failed:
        print(f"FAILED: processes {failed} exited without a result (exit codes {[p.returncode for p in procs]})")
        return 1
    worst = max(results.values())
    agree = worst <= 1e-4
    print(f"FINISHED in {elapsed:.1f} s: all {args.processes} processes ran {args.steps} steps; "
          f"max abs diff from the numpy reference {worst:.2e} ({'agree' if agree else 'DISAGREE'})")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
