"""Q2: from a step's last host finishing to all its chips available and its hosts idle.

One v6e-16 slice (4 hosts). The step returns the time.time() at its very end on every host;
a watcher thread in the driver polls `ray.available_resources()["TPU"]` and the GCS cluster
resource state (`ray.autoscaler.v2.sdk.get_cluster_resource_state`, what Ray's autoscaler
reads) until the TPU total is back and every host of the slice reports IDLE.

Rows: rayslice `run_step`; (a) the hand-written head-targeted tasks; (b) `run_on_slice` with a
slice handle + `shutdown()`; and `run_on_slice` one-shot (no handle) in a long-lived driver,
which keeps its placement group until that driver exits: measured in a separate driver process
per repetition, waiting a bounded time for a release, then asking the driver to exit.

    RAYSLICE_HOME=/tmp/rs-dev-home .venv/bin/python bench/release_latency.py --cluster dev [--reps 10]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import _steps
from _common import (
    ReleaseWatcher,
    Report,
    Series,
    Table,
    cluster,
    driver,
    fmt_ratio,
    fmt_s,
    log,
    median,
    parse_args,
    quiet,
    slice_node_ids,
    wait_all_free,
    warm_up_workers,
)

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster

NAME = "release_latency"
SPEC = local_cluster.ClusterSpec(tpus=("v6e-16",))
REQUEST = TpuSliceRequest(tpu="v6e-16")
GOAL = 0.5
STEP_S = 1.0  # long enough that every method's hosts are seen busy before they finish

ONE_SHOT_DRIVER = r"""
import json, sys, time
import ray
from ray.util.tpu import run_on_slice

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)

@ray.remote
def step(seconds):
    import time
    start = time.time()
    time.sleep(seconds)
    return {"start": start, "end": time.time(), "node": ray.get_runtime_context().get_node_id()}

t0 = time.time()
hosts = ray.get(run_on_slice(step, float(sys.argv[4]), topology=sys.argv[2], accelerator_version=sys.argv[3]))
print(json.dumps({"t0": t0, "hosts": hosts}), flush=True)
sys.stdin.read()  # a long-lived driver: it lives on until the benchmark closes our stdin
"""


@dataclass
class Row:
    label: str
    free: Series = field(default_factory=Series)
    idle: Series = field(default_factory=Series)
    after_exit: Series = field(default_factory=Series)  # one-shot only: driver exit -> chips free
    polls: list[float] = field(default_factory=list)
    busy_because: set[str] = field(default_factory=set)  # GCS node activity while not IDLE at the cap


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], extra=_flags)
    report = Report(NAME, args)
    with cluster(SPEC, NAME) as record, driver(record) as ray:
        import ray.cloudpickle

        from rayslice.cluster import run_step

        ray.cloudpickle.register_pickle_by_value(_steps)
        hand = _steps.hand_written(ray)
        step_task = ray.remote(_steps.now_and_return)
        if len(slice_node_ids(ray, ["v6e-16-a"])) != REQUEST.hosts_per_slice:
            raise RuntimeError("the cluster needs a v6e-16 slice named v6e-16-a (4 hosts)")

        def rayslice() -> list[dict]:
            spec = StepSpec.for_function(
                _steps.now_and_return,
                request=REQUEST,
                kwargs={"seconds": STEP_S},
                owner=Owner(submission_id=f"bench-{time.time_ns()}"),
            )
            with quiet():
                return run_step(spec)

        def hand_written() -> list[dict]:
            return _steps.flatten(ray.get(hand(step_task, REQUEST, STEP_S)))

        def run_on_slice() -> list[dict]:
            return _steps.run_on_slice_with_handle(ray, step_task, REQUEST, STEP_S)

        methods = [
            (Row("rayslice run_step"), rayslice),
            (Row("(a) hand-written head-targeted tasks"), hand_written),
            (Row("(b) run_on_slice, handle + shutdown()"), run_on_slice),
        ]
        one_shot = Row("(b) run_on_slice one-shot (no handle), long-lived driver")

        warm_up_workers(ray)
        for _row, fn in methods:  # warm-up, unrecorded
            _measure(ray, Row("warm-up"), fn, args.cap)
        started = time.monotonic()
        for rep in range(args.reps):
            for row, fn in methods:
                _measure(ray, row, fn, args.cap)
            if rep < args.one_shot_reps:
                _measure_one_shot(ray, record, one_shot, args.hold)
            log(f"rep {rep + 1}/{args.reps} done ({time.monotonic() - started:.0f} s)")
        report.add(_table([r for r, _ in methods] + [one_shot], args))
    report.write()


def _flags(parser) -> None:
    parser.add_argument("--cap", type=float, default=10.0, help="longest wait for a release (s)")
    parser.add_argument(
        "--hold", type=float, default=3.0, help="how long the one-shot driver is watched before it is told to exit"
    )
    parser.add_argument("--one-shot-reps", type=int, default=10, help="repetitions of the one-shot row")


def _measure(ray: Any, row: Row, fn: Any, cap: float) -> None:
    if not wait_all_free(ray):
        log("warning: TPU chips not all free before a measurement")
    with ReleaseWatcher(ray) as watcher:
        submitted = time.time()
        results = fn()
        end = max(h["end"] for h in results)
        hosts = sorted({h["node"] for h in results})  # the slice the step landed on
        free, idle = watcher.wait(end, submitted, cap, hosts)
    row.free.add(None if free is None else max(0.0, free - end))
    row.idle.add(None if idle is None else max(0.0, idle - end))
    row.polls.append(watcher.poll_interval())
    if idle is None:
        row.busy_because.update(watcher.activity_of(hosts))


def _measure_one_shot(ray: Any, record: Any, row: Row, hold: float) -> None:
    if not wait_all_free(ray):
        log("warning: TPU chips not all free before a measurement")
    proc = subprocess.Popen(
        [sys.executable, "-c", ONE_SHOT_DRIVER, record.gcs_address, REQUEST.topology, REQUEST.version, str(STEP_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        with ReleaseWatcher(ray) as watcher:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"one-shot driver exited with {proc.wait()}")
            data = json.loads(line)
            end = max(h["end"] for h in data["hosts"])
            hosts = sorted({h["node"] for h in data["hosts"]})
            free, idle = watcher.wait(end, data["t0"], hold, hosts)
            row.free.add(None if free is None else free - end)
            row.idle.add(None if idle is None else idle - end)
            exit_asked = time.time()
            proc.stdin.close()
            proc.wait(timeout=60)
            free_after, _ = watcher.wait(exit_asked, data["t0"], 30, hosts)
            row.after_exit.add(None if free_after is None else free_after - exit_asked)
            row.polls.append(watcher.poll_interval())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _table(rows: list[Row], args: Any) -> Table:
    base = rows[1]
    table = Table(
        f"Release latency, v6e-16 (4 hosts): last host done → released (median / p90 over {args.reps} reps)",
        ["method", "n", "all chips free", "p90", "× (a)", "all hosts IDLE in GCS", "p90", "× (a)", "goal ≤ 0.5 s"],
    )
    for row in rows:
        never = f"never within {args.hold:.0f} s (held until driver exit)" if row is rows[-1] else f"> {args.cap:.0f} s"
        free_median = row.free.median()
        met = (
            "n/a"
            if free_median is None and row is rows[-1]
            else (
                "yes"
                if free_median is not None and free_median <= GOAL and (row.idle.median() or 1e9) <= GOAL
                else "no"
            )
        )
        table.add(
            row.label,
            row.free.n,
            fmt_s(free_median, never),
            fmt_s(row.free.p90(), never),
            fmt_ratio(free_median, base.free.median()),
            fmt_s(row.idle.median(), never),
            fmt_s(row.idle.p90(), never),
            fmt_ratio(row.idle.median(), base.idle.median()),
            met if row is rows[0] else "",
        )
    polls = [p for r in rows for p in r.polls if p == p]
    table.notes = [
        f"the step runs {STEP_S:g} s on each host (so its hosts are seen busy) and returns time.time() at its end",
        f"watcher poll interval (resolution): median {fmt_s(median(polls)) if polls else 'n/a'}; "
        "each poll is two GCS RPCs (available resources, cluster resource state)",
        "rayslice's time includes the JAX shutdown barrier its hosts run after the step returns, killing the "
        "host actors, and removing the placement groups (run_step returns once Ray marks them REMOVED)",
    ]
    for row in rows:
        if row.busy_because:
            table.notes.append(
                f"{row.label}: hosts not IDLE at the cap; GCS node activity: "
                + "; ".join(sorted(row.busy_because))[:400]
            )
    if rows[-1].after_exit.n:
        table.notes.append(
            f"one-shot run_on_slice: {rows[-1].free.misses}/{rows[-1].free.n} runs never released while the driver "
            f"lived (watched {args.hold:.0f} s); after the driver was told to exit, chips were free in "
            f"{fmt_s(rows[-1].after_exit.median())} (median, n={rows[-1].after_exit.n}; includes the driver's exit)"
        )
    return table


if __name__ == "__main__":
    main()
