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
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rayslice.client.submission import run_step_job  # noqa: E402
from rayslice.core.accelerators import TpuSliceRequest  # noqa: E402
from rayslice.core.step import Owner, StepSpec  # noqa: E402
from rayslice.local import local_cluster  # noqa: E402
from rayslice.local.demo import EXAMPLES  # noqa: E402


def examples():
    from rayslice.dags.tpu_slice_training import train_linear_model

    return [*[(title, request, fn, {}) for title, request, fn in EXAMPLES],
            ("v6e-16, 5 training steps (optax)", TpuSliceRequest(tpu="v6e-16"), train_linear_model,
             {"steps": 5, "learning_rate": 0.1})]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", required=True, help="a running local cluster under this RAYSLICE_HOME")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    record = local_cluster.ClusterRecord.load(args.cluster)
    from importlib.metadata import version

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "?"
    print(f"python {sys.version.split()[0]}, jax {version('jax')}, commit {commit}, {args.reps} reps", flush=True)
    times: dict[str, list[float]] = {}
    for rep in range(args.reps):
        for title, request, fn, kwargs in examples():
            spec = StepSpec.for_function(fn, request=request, kwargs=kwargs, launcher="installed",
                                         owner=Owner(dag_id="bench", run_id=uuid.uuid4().hex))
            started = time.monotonic()
            asyncio.run(run_step_job(record.dashboard_url, spec, token=record.token, emit=lambda line: None))
            times.setdefault(title, []).append(time.monotonic() - started)
            print(f"rep {rep + 1}: {title}: {times[title][-1]:.1f} s", flush=True)
    print("\n| step | median s | min s | max s |\n|---|---:|---:|---:|")
    for title, values in times.items():
        print(f"| {title} | {statistics.median(values):.1f} | {min(values):.1f} | {max(values):.1f} |")
    total = sum(statistics.median(v) for v in times.values())
    print(f"| all six, sum of medians | {total:.1f} | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
