"""Q5: from one host's failure to the step failing and all its chips free.

On a v6e-16 (4 hosts), every host initializes JAX across the slice; worker 2 raises while the
others wait in a cross-host collective (`process_allgather`). Worker 2 writes the time.time()
just before it raises; a watcher thread polls the free TPU chips.

Rows: rayslice `run_step` (cancels the whole gang on the first error) and the hand-written
head-targeted pattern (one fresh process per host via `max_calls=1`, JAX initialized by hand,
JAX's default timeouts), whose peers stay blocked: its measurements are capped (`--cap`, default
15 s, so 10 repetitions of each row fit in 10 minutes on 2 cores) and reported as "> cap"; after
the cap the benchmark force-cancels its tasks.

    RAYSLICE_HOME=/tmp/rs-dev-home .venv/bin/python bench/failure_detection.py --cluster dev --row rayslice
    RAYSLICE_HOME=/tmp/rs-dev-home .venv/bin/python bench/failure_detection.py --cluster dev --row a [--cap 15]
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    parse_args,
    quiet,
    slice_node_ids,
    wait_all_free,
    warm_up_workers,
)

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.exceptions import StepFailedError
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster

NAME = "failure_detection"
SPEC = local_cluster.ClusterSpec(tpus=("v6e-16",))
REQUEST = TpuSliceRequest(tpu="v6e-16")


def rayslice_step(mark_dir: str) -> int:
    """rayslice has initialized JAX across the slice before this runs."""
    import os
    import time
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    if os.environ["TPU_WORKER_ID"] == "2":
        Path(mark_dir, "failed").write_text(repr(time.time()))
        raise ValueError("bad batch on host 2")
    multihost_utils.process_allgather(jnp.ones(1))  # peers block here
    return jax.device_count()


def hand_step(coordinator: str, num_processes: int, chips: int, mark_dir: str) -> int:
    """The same step, hand-wired as a user of the docs pattern would on this simulated slice."""
    import os
    import time
    from pathlib import Path

    Path(mark_dir, f"pid-{os.getpid()}").touch()
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={chips}"
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=int(os.environ["TPU_WORKER_ID"]),
        local_device_ids=list(range(chips)),
        cluster_detection_method="deactivate",
    )
    if os.environ["TPU_WORKER_ID"] == "2":
        Path(mark_dir, "failed").write_text(repr(time.time()))
        raise ValueError("bad batch on host 2")
    multihost_utils.process_allgather(jnp.ones(1))
    return jax.device_count()


@dataclass
class Row:
    label: str
    failed: Series = field(default_factory=Series)  # host failure -> the caller sees the step fail
    free: Series = field(default_factory=Series)  # host failure -> all chips free
    how: list[str] = field(default_factory=list)


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], extra=_flags)
    chosen = args.row or ["rayslice", "a"]
    report = Report(NAME + ("" if len(chosen) == 2 else f"_{chosen[0]}"), args)
    with cluster(SPEC, NAME) as record, driver(record) as ray:
        from rayslice.cluster import run_step

        host_task = ray.remote(max_calls=1)(hand_step)

        @ray.remote
        def run_on_pod(fn: Any, hosts: int, chips: int, *args: Any) -> list[Any]:
            import ray as _ray

            name = _ray.util.tpu.get_current_pod_name()
            return _ray.get([fn.options(resources={name: 1, "TPU": chips}).remote(*args) for _ in range(hosts)])

        hosts = slice_node_ids(ray, ["v6e-16-a"])

        def rayslice(mark_dir: str, cap: float) -> tuple[float | None, str]:
            spec = StepSpec.for_function(
                rayslice_step,
                request=REQUEST,
                kwargs={"mark_dir": mark_dir},
                owner=Owner(submission_id=f"bench-fail-{time.time_ns()}"),
            )
            try:
                with quiet():
                    run_step(spec)
            except StepFailedError as exc:
                return time.time(), f"StepFailedError on worker {exc.worker_id}"
            return None, "succeeded?!"

        def hand_written(mark_dir: str, cap: float) -> tuple[float | None, str]:
            with socket.socket() as sock:  # simulation only: every host is this machine
                sock.bind(("127.0.0.2", 0))
                port = sock.getsockname()[1]
            ref = run_on_pod.options(resources={REQUEST.head_resource: 1}).remote(
                host_task,
                REQUEST.hosts_per_slice,
                REQUEST.chips_per_host,
                f"127.0.0.2:{port}",
                REQUEST.hosts_per_slice,
                REQUEST.chips_per_host,
                mark_dir,
            )
            hand_written.last_ref = ref
            submitted = time.time()
            mark = Path(mark_dir, "failed")
            while True:  # wait for the step to fail, at most `cap` after host 2 failed
                ready, _ = ray.wait([ref], timeout=0.1)
                if ready:
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayTaskError as exc:
                        return time.time(), type(exc.cause).__name__ if exc.cause else "RayTaskError"
                    return None, "succeeded?!"
                t_fail = float(mark.read_text()) if mark.exists() and mark.read_text() else None
                if time.time() > (t_fail + cap if t_fail else submitted + cap + 120):
                    return None, "peers still blocked at the cap"

        def cleanup_hand(mark_dir: str) -> None:
            ref = getattr(hand_written, "last_ref", None)
            if ref is not None:
                ray.cancel(ref, force=True, recursive=True)
            if wait_all_free(ray, timeout=20):
                return
            # Force-cancel did not free them: end the per-host processes we started ourselves.
            for pid_file in Path(mark_dir).glob("pid-*"):
                pid = int(pid_file.name.split("-", 1)[1])
                try:
                    os.kill(pid, signal.SIGKILL)
                    log(f"killed blocked host process {pid}")
                except ProcessLookupError:
                    pass
            if not wait_all_free(ray, timeout=30):
                log("warning: TPU chips still held after cleanup")

        warm_up_workers(ray)
        rows = []
        if "rayslice" in chosen:
            rows.append((Row("rayslice run_step"), rayslice, args.reps, None))
            _measure(ray, hosts, Row("warm-up"), rayslice, 60, None)  # warm-up, unrecorded
        if "a" in chosen:
            baseline = Row("(a) hand-written head-targeted tasks (JAX defaults)")
            rows.append((baseline, hand_written, args.baseline_reps, cleanup_hand))
        started = time.monotonic()
        for rep in range(max(args.reps, args.baseline_reps)):
            for row, fn, reps, cleanup in rows:
                if rep < reps:
                    _measure(ray, hosts, row, fn, args.cap, cleanup)
            log(f"rep {rep + 1} done ({time.monotonic() - started:.0f} s)")
        report.add(_table([r for r, *_ in rows], args))
    report.write()


def _flags(parser) -> None:
    parser.add_argument("--cap", type=float, default=15.0, help="longest wait for a failure or a release (s)")
    parser.add_argument("--baseline-reps", type=int, default=10, help="repetitions of the (slow) hand-written row")
    parser.add_argument(
        "--row",
        action="append",
        choices=["rayslice", "a"],
        help="measure only this row (repeatable; default both, which takes longer than 10 minutes on 2 cores: "
        "one row per command)",
    )


def _measure(ray: Any, hosts: list[str], row: Row, fn: Any, cap: float, cleanup: Any) -> None:
    if not wait_all_free(ray, timeout=60):
        log("warning: TPU chips not all free before a measurement")
    mark_dir = tempfile.mkdtemp(prefix="rs-bench-fail-")
    try:
        with ReleaseWatcher(ray, hosts, interval=0.02) as watcher:
            failed_at, how = fn(mark_dir, cap)
            mark = Path(mark_dir, "failed")
            if not mark.exists():
                raise RuntimeError(f"{row.label}: host 2 never reached its failure ({how})")
            t_fail = float(mark.read_text())
            free_at = watcher.when_free(t_fail)
            while free_at is None and time.time() < t_fail + cap:
                time.sleep(0.05)
                free_at = watcher.when_free(t_fail)
        row.failed.add(None if failed_at is None else failed_at - t_fail)
        row.free.add(None if free_at is None else free_at - t_fail)
        row.how.append(how)
        log(
            f"{row.label}: failed after {fmt_s(row.failed.values[-1], '> cap')}, "
            f"chips free after {fmt_s(row.free.values[-1], '> cap')} ({how})"
        )
    finally:
        if cleanup:
            cleanup(mark_dir)
        shutil.rmtree(mark_dir, ignore_errors=True)


def _table(rows: list[Row], args: Any) -> Table:
    base = next((r for r in rows if r.label.startswith("(a)")), Row("(a) not measured in this run"))
    cap = f"> {args.cap:.0f} s (cap)"
    table = Table(
        "Failure detection, v6e-16 (4 hosts): worker 2 raises, peers in a collective (median / p90)",
        ["method", "n", "step failed (caller sees it)", "p90", "all chips free", "p90", "× (a), chips free", "outcome"],
    )
    for row in rows:
        table.add(
            row.label,
            row.failed.n,
            fmt_s(row.failed.median(), cap),
            fmt_s(row.failed.p90(), cap),
            fmt_s(row.free.median(), cap),
            fmt_s(row.free.p90(), cap),
            fmt_ratio(row.free.median(), base.free.median()) if base.free.median() else "—",
            ", ".join(sorted(set(row.how))),
        )
    table.notes = [
        "times from worker 2's time.time() just before it raises",
        f"the hand-written row is capped at {args.cap:.0f} s per run; after the cap its tasks are force-cancelled "
        "(ray.cancel(force=True, recursive=True)) so the next run starts on a free slice",
    ]
    return table


if __name__ == "__main__":
    main()
