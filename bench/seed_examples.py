"""The seed examples' steps, timed end to end on a running local cluster: what a JAX upgrade costs them.

The steps are the demo's launcher examples (`rayslice.local.demo.EXAMPLES`: device count plus a
cross-host all-gather on v6e-4, v6e-16, 2 x v6e-16 multislice and independent, and a quarter GPU) and
the example DAG's data-parallel training step (`dags/tpu_slice_training.py`: 5 optax steps over a
16-device mesh). Each is a real Ray job submitted through the Jobs API, as the demo submits it
(`launcher="installed"`), timed from submission to its result. Repetitions are interleaved.

To compare two environments (e.g. JAX 0.10.2 on Python 3.11 against JAX 0.12 on 3.12), start a
cluster from each venv (`rayslice local up`; its nodes run that venv) and run this file with that
venv's Python against it; only rayslice's public launcher API is used, so the same file runs on both.

    RAYSLICE_HOME=... .venv/bin/python bench/seed_examples.py --cluster NAME [--reps 3]

Without `--cluster` it starts its own (a v6e-4, two v6e-16 and a GPU) from this venv. Each venv's
table goes to bench/results/seed_examples_py<version>_jax<version>.md (`--no-write`: printed only).
"""

from __future__ import annotations

import asyncio
import sys
import uuid

from _common import Report, Table, cluster, commit, log, median, parse_args, stopwatch

from rayslice.client.submission import run_step_job
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster
from rayslice.local.demo import EXAMPLES

NAME = "seed_examples"
SPEC = local_cluster.ClusterSpec(tpus=("v6e-4", "v6e-16", "v6e-16"), gpus=1)


def examples():
    from rayslice.dags.tpu_slice_training import train_linear_model

    return [*[(title, request, fn, {}) for title, request, fn in EXAMPLES],
            ("v6e-16, 5 training steps (optax)", TpuSliceRequest(tpu="v6e-16"), train_linear_model,
             {"steps": 5, "learning_rate": 0.1})]


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], default_reps=3)
    from importlib.metadata import version

    report = Report(f"{NAME}_py{sys.version_info.major}{sys.version_info.minor}_jax{version('jax')}", args)
    report.note(f"python {sys.version.split()[0]}, jax {version('jax')}, commit {commit()}, {args.reps} reps")
    times: dict[str, list[float]] = {}
    with cluster(SPEC, NAME) as record:
        for rep in range(args.reps):
            for title, request, fn, kwargs in examples():
                spec = StepSpec.for_function(fn, request=request, kwargs=kwargs, launcher="installed",
                                             owner=Owner(dag_id="bench", run_id=uuid.uuid4().hex))
                with stopwatch() as took:
                    asyncio.run(run_step_job(record.dashboard_url, spec, token=record.token, emit=lambda line: None))
                times.setdefault(title, []).append(took.s)
                log(f"rep {rep + 1}: {title}: {took.s:.1f} s")
    table = Table(f"The seed examples as Ray jobs, submission to result (python {sys.version.split()[0]}, "
                  f"jax {version('jax')}, {args.reps} reps)", ["step", "median s", "min s", "max s"])
    for title, values in times.items():
        table.add(title, f"{median(values):.1f}", f"{min(values):.1f}", f"{max(values):.1f}")
    table.add("all six, sum of medians", f"{sum(median(v) for v in times.values()):.1f}", "", "")
    report.add(table)
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
