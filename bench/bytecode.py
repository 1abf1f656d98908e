"""What cached bytecode is worth: imports, and one quarter-GPU step as a Ray job, cached against from source.

Every Ray worker, job driver, host process and Airflow task process is a fresh Python that
imports `ray`, `jax` or `airflow`. With the venv's bytecode cached (`scripts/bootstrap` compiles
it) those imports read `.pyc` files; without it (uv's default install where
`PYTHONDONTWRITEBYTECODE` is set, as on this repository's CI machine) every process compiles
them from source. "From source" here points `PYTHONPYCACHEPREFIX` at an empty folder (with
`PYTHONDONTWRITEBYTECODE=1`), so Python finds no cached bytecode and writes none, in every
process of that row, the private cluster's included.

    .venv/bin/python bench/bytecode.py [--reps 5]
"""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
import tempfile
from unittest import mock

from _common import Report, Series, Table, cluster, fmt_ratio, fmt_s, log, parse_args, stopwatch

from rayslice.client.submission import run_step_job
from rayslice.core.accelerators import AcceleratorRequest
from rayslice.core.step import StepSpec
from rayslice.local import local_cluster

NAME = "bytecode"
MODULES = ("ray", "jax", "airflow.sdk")
MODES = ("cached", "from source")


def device_count() -> int:
    import jax

    return jax.device_count()


def mode_env(mode: str, empty: str) -> dict[str, str]:
    return {"PYTHONPYCACHEPREFIX": empty, "PYTHONDONTWRITEBYTECODE": "1"} if mode == "from source" else {}


def machine_cpu_seconds() -> float:
    """Busy CPU time of the whole machine so far (every process: the cluster's, the job's, ours)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def import_row(module: str, env: dict[str, str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with stopwatch() as wall:
        subprocess.run([sys.executable, "-c", f"import {module}"], env={**os.environ, **env}, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall.s, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], default_reps=5)
    report = Report(NAME, args)
    empty = tempfile.mkdtemp(prefix="rayslice-no-bytecode-")

    imports = Table("A fresh `python -c 'import X'` (median over n reps)",
                    ["module", "n", "cached: wall", "cached: CPU", "from source: wall", "from source: CPU",
                     "CPU ×"])
    for module in MODULES:
        series = {(m, k): Series() for m in MODES for k in ("wall", "cpu")}
        for _ in range(args.reps):
            for mode in MODES:  # interleaved
                wall, cpu = import_row(module, mode_env(mode, empty))
                series[mode, "wall"].add(wall)
                series[mode, "cpu"].add(cpu)
        cached, source = series["cached", "cpu"].median(), series["from source", "cpu"].median()
        log(f"import {module}: {fmt_s(cached)} CPU cached, {fmt_s(source)} from source")
        imports.add(module, args.reps, fmt_s(series["cached", "wall"].median()), fmt_s(cached),
                    fmt_s(series["from source", "wall"].median()), fmt_s(source), fmt_ratio(source, cached))
    imports.notes = ["CPU: user + system time of the child process; CPU ×: from source ÷ cached"]
    report.add(imports)

    jobs = Table("One 0.25-GPU step (jax.device_count()) as a Ray job, submission to result (median / p90 over n reps)",
                 ["bytecode", "n", "total wall", "p90", "machine CPU-s", "p90", "× cached (wall)"])
    spec = local_cluster.ClusterSpec(gpus=1)
    walls: dict[str, Series] = {}
    for mode in MODES:
        # the cluster's processes, and so every worker, inherit the row's setting
        with mock.patch.dict(os.environ, mode_env(mode, empty)), \
                cluster(spec, f"{NAME}-{mode.replace(' ', '-')}", private=True) as record:
            wall, cpu = Series(), Series()
            request = AcceleratorRequest(resource="GPU", count=0.25)
            for rep in range(args.reps + 1):  # the first is not recorded
                step = StepSpec.for_function(device_count, request=request, launcher="installed")
                cpu_before = machine_cpu_seconds()
                with stopwatch() as took:
                    result = asyncio.run(run_step_job(record.dashboard_url, step, emit=lambda _line: None))
                used = machine_cpu_seconds() - cpu_before
                assert result == 1, result
                if rep:
                    wall.add(took.s)
                    cpu.add(used)
            log(f"{mode}: job {fmt_s(wall.median())}, machine CPU {cpu.median():.1f} s")
            walls[mode] = wall
            jobs.add(mode, wall.n, fmt_s(wall.median()), fmt_s(wall.p90()), f"{cpu.median():.1f}",
                     f"{cpu.p90():.1f}", fmt_ratio(wall.median(), walls["cached"].median()))
    jobs.notes = [
        "a private cluster per row (a head and one node with 1 logical GPU), started with that row's bytecode "
        "setting, which its job supervisors, drivers and host processes inherit; launcher installed",
        "total wall: submit through rayslice.client.submission.run_step_job until the result is back (status "
        "polled every 1 s, so up to ~1 s of it is the poll)",
        "machine CPU-s: busy CPU time of the whole machine over the job (/proc/stat), the idle cluster's share "
        "included",
    ]
    report.add(jobs)
    report.write()
    subprocess.run(["rm", "-rf", empty], check=False)


if __name__ == "__main__":
    main()
