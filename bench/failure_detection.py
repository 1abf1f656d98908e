"""Q5: from one host's failure to the step failing and all its chips free, for three kinds of failure.

On a v6e-16 (4 hosts), every host initializes JAX across the slice; worker 2 fails while the
others wait in a cross-host collective (`process_allgather`):

- `raise`: the step raises on worker 2;
- `sigkill`: worker 2's process is SIGKILLed (it kills itself);
- `node`: worker 2's whole node dies (`local_cluster.kill_node`: every process of that Ray node
  SIGKILLed at once, as a preempted VM vanishes); the benchmark restarts it after each run;
- `command`: a command step (rayslice row only): an unmodified JAX program (`COMMAND_PROGRAM`)
  whose worker 2 exits 3 right after `jax.distributed.initialize()`, its peers in the collective.

The failure time is worker 2's `time.time()` just before it raises or kills itself, or the
benchmark's just before it kills the node. "Chips free" is the first poll (every 20 ms, the
GCS's per-node resource state) at which every chip of the slice's *surviving* hosts is
available again (a dead node's chips are gone with it).

Rows: rayslice `run_step` (cancels the whole gang on the first failure) and the hand-written
head-targeted pattern of Ray's TPU docs: a task on `TPU-v6e-16-head` starts one task per host
with `{<slice name>: 1, "TPU": 4}` (one fresh process per host via `max_calls=1`, Ray's default
task retries), each wiring `jax.distributed` over gloo as rayslice does. Its peers stay blocked
in the collective, so every measurement is capped (`--cap`) and reported as "> cap"; after the
cap its tasks are force-cancelled.

    .venv/bin/python bench/failure_detection.py --kind raise      # its own 5-node cluster, ~5 min
    .venv/bin/python bench/failure_detection.py --kind sigkill
    .venv/bin/python bench/failure_detection.py --kind node
    .venv/bin/python bench/failure_detection.py --kind stop      # stop -> job ended, chips free
    .venv/bin/python bench/failure_detection.py --kind command   # a command step's program exits 3

For `stop` the "failure" time is the benchmark's just before it asks the Jobs API to stop the job;
"step failed" is when the job's status first reads ended.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
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
    wait_all_free,
    warm_up_workers,
)

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.exceptions import StepFailedError
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster, processes

NAME = "failure_detection"
SPEC = local_cluster.ClusterSpec(tpus=("v6e-16",))
REQUEST = TpuSliceRequest(tpu="v6e-16")
VICTIM = 2  # the worker that fails
KINDS = {
    "raise": "the step raises on worker 2",
    "sigkill": "worker 2's process is SIGKILLed",
    "node": "worker 2's node dies (preemption)",
    "stop": "`ray job stop` of the step's running Ray job (rayslice row only)",
    "command": "a command step's program exits 3 on worker 2 right after initialize() (rayslice row only)",
}
#: The `command` kind's program, run as `python program.py <mark_dir>`: it knows nothing of rayslice.
COMMAND_PROGRAM = """
import os, sys, time
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils

jax.distributed.initialize()
if jax.process_index() == 2:
    print("bad config on host 2", flush=True)
    with open(os.path.join(sys.argv[1], "failed"), "w") as f:
        f.write(repr(time.time()))
    sys.exit(3)
multihost_utils.process_allgather(jnp.ones(1))  # peers block here
"""


def fail_here(mark_dir: str, kind: str) -> None:
    """On the victim host, fail the way `kind` says; elsewhere return (and join the collective)."""
    import os
    import signal
    import time
    from pathlib import Path

    if os.environ["TPU_WORKER_ID"] != "2":
        return
    if kind == "node":  # the benchmark kills this node once its peers wait in the collective
        Path(mark_dir, "ready").write_text(str(os.getpid()))
        time.sleep(3600)
    Path(mark_dir, "failed").write_text(repr(time.time()))
    if kind == "raise":
        raise ValueError("bad batch on host 2")
    os.kill(os.getpid(), signal.SIGKILL)


def wait_for_stop(mark_dir: str) -> None:
    """Runs until the benchmark stops its job."""
    import time
    from pathlib import Path

    Path(mark_dir, "ready").touch()
    time.sleep(3600)


def rayslice_step(mark_dir: str, kind: str) -> int:
    """rayslice has initialized JAX across the slice before this runs."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    fail_here(mark_dir, kind)
    multihost_utils.process_allgather(jnp.ones(1))  # peers block here
    return jax.device_count()


def hand_step(coordinator: str, num_processes: int, chips: int, mark_dir: str, kind: str) -> int:
    """The same step, with JAX wired by hand the way rayslice wires it on this simulated slice."""
    import os
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
    fail_here(mark_dir, kind)
    multihost_utils.process_allgather(jnp.ones(1))
    return jax.device_count()


@dataclass
class Row:
    label: str
    failed: Series = field(default_factory=Series)  # host failure -> the caller sees the step fail
    free: Series = field(default_factory=Series)  # host failure -> all surviving chips free
    how: list[str] = field(default_factory=list)


class SliceWatcher:
    """Polls, in a thread, the available and total TPU chips of each of the slice's hosts (GCS state)."""

    def __init__(self, ray: Any, nodes: list[str], interval: float = 0.02) -> None:
        from ray.autoscaler.v2.sdk import get_cluster_resource_state

        self._state = get_cluster_resource_state
        self._gcs = ray._private.worker.global_worker.gcs_client
        self._nodes = set(nodes)
        self._interval = interval
        self.samples: list[tuple[float, dict[str, bool]]] = []  # (time, {node: all its chips free})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SliceWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                states = self._state(self._gcs).node_states
            except Exception:  # noqa: BLE001  (a busy GCS: try again)
                states = []
            now = time.time()
            free = {}
            for node in states:
                node_id = node.node_id.hex()
                if node_id in self._nodes:
                    total = node.total_resources.get("TPU", 0.0)
                    free[node_id] = total > 0 and node.available_resources.get("TPU", 0.0) >= total
            if states:
                self.samples.append((now, free))
            self._stop.wait(self._interval)

    def when_free(self, after: float, nodes: set[str]) -> float | None:
        """First poll at or after `after` with every chip of `nodes` free, once they were seen in use."""
        seen_busy = False
        for t, free in list(self.samples):
            if not all(free.get(n, False) for n in nodes):
                seen_busy = True
            elif t >= after and seen_busy:
                return t
        return None


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], default_reps=5, extra=_flags)
    kinds = args.kind or [kind for kind in KINDS if kind not in ("stop", "command")]
    rows_wanted = args.row or ["rayslice", "a"]
    report = Report(NAME + ("" if len(kinds) == 3 else "_" + "_".join(kinds)), args)
    with cluster(SPEC, NAME) as record, driver(record) as ray:
        from rayslice.cluster import run_step

        host_task = ray.remote(max_calls=1)(hand_step)

        @ray.remote
        def run_on_pod(fn: Any, hosts: int, chips: int, *args: Any) -> list[Any]:
            import ray as _ray

            name = _ray.util.tpu.get_current_pod_name()
            return _ray.get([fn.options(resources={name: 1, "TPU": chips}).remote(*args) for _ in range(hosts)])

        slice_name = next(n.slice_name for n in record.nodes if n.role == "tpu")
        victim_index = next(i for i, n in enumerate(record.nodes)
                            if n.slice_name == slice_name and n.worker_id == VICTIM)

        def rayslice(mark_dir: str, kind: str, cap: float) -> tuple[float | None, str]:
            if kind == "command":
                Path(mark_dir, "program.py").write_text(COMMAND_PROGRAM)
                spec = StepSpec(request=REQUEST, command=[sys.executable, str(Path(mark_dir, "program.py")), mark_dir],
                                owner=Owner(submission_id=f"bench-fail-{time.time_ns()}"))
            else:
                spec = StepSpec.for_function(
                    rayslice_step,
                    request=REQUEST,
                    kwargs={"mark_dir": mark_dir, "kind": kind},
                    owner=Owner(submission_id=f"bench-fail-{time.time_ns()}"),
                )
            try:
                with quiet():
                    run_step(spec)
            except StepFailedError as exc:
                code = "" if exc.exit_code is None else f", exit code {exc.exit_code}"
                return time.time(), f"{type(exc).__name__} on worker {exc.worker_id}{code}"
            return None, "succeeded?!"

        def stopped_job(mark_dir: str, kind: str, cap: float) -> tuple[float | None, str]:
            """Submit the step as a real Ray job; once it runs, `ray job stop` it (the Jobs API's stop)."""
            import asyncio

            from rayslice.client.jobs_client import AsyncRayJobsClient, RayJobsClient
            from rayslice.client.submission import submit_step

            spec = StepSpec.for_function(wait_for_stop, request=REQUEST, kwargs={"mark_dir": mark_dir},
                                         owner=Owner(submission_id=f"bench-stop-{time.time_ns()}"))

            async def submit() -> str:
                async with AsyncRayJobsClient(record.dashboard_url, token=record.token) as client:
                    return await submit_step(client, spec, emit=lambda _: None)

            sid = asyncio.run(submit())
            with RayJobsClient(record.dashboard_url, token=record.token) as client:
                while not Path(mark_dir, "ready").exists():
                    time.sleep(0.05)
                time.sleep(1.0)  # every host in its step
                Path(mark_dir, "failed").write_text(repr(time.time()))
                client.stop(sid)
                while not client.get(sid).is_terminal:
                    time.sleep(0.05)
                ended = time.time()
                said = "stopped on request" in client.logs(sid)
            return ended, "job ended" + (
                ", 'stopped on request'" if said else ", no 'stopped on request' line")

        def hand_written(mark_dir: str, kind: str, cap: float) -> tuple[float | None, str]:
            with socket.socket() as sock:  # simulation only: every host is this machine
                sock.bind(("127.0.0.2", 0))
                port = sock.getsockname()[1]
            ref = run_on_pod.options(resources={REQUEST.head_resource: 1}).remote(
                host_task, REQUEST.hosts_per_slice, REQUEST.chips_per_host,
                f"127.0.0.2:{port}", REQUEST.hosts_per_slice, REQUEST.chips_per_host, mark_dir, kind,
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
                    except ray.exceptions.RayError as exc:
                        return time.time(), type(exc).__name__
                    return None, "succeeded?!"
                t_fail = _read_time(mark)
                if time.time() > (t_fail + cap if t_fail else submitted + cap + 180):
                    return None, "peers still blocked at the cap"

        def cleanup_hand(mark_dir: str) -> None:
            """Free the slice: cancel, then kill every host process this run started until the chips stay free.

            The head task has already ended, so a recursive cancel no longer reaches its host tasks,
            and Ray retries a killed host task (3 retries by default) into the freed chips: left
            alone, those retries would hold chips during the next measurement.
            """
            ref = getattr(hand_written, "last_ref", None)
            if ref is not None:
                ray.cancel(ref, force=True, recursive=True)
            killed: set[int] = set()
            free_since = None
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                for pid_file in Path(mark_dir).glob("pid-*"):
                    pid = int(pid_file.name.split("-", 1)[1])
                    if pid not in killed:
                        killed.add(pid)
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                if _surviving_free(ray):
                    free_since = free_since or time.monotonic()
                    if time.monotonic() - free_since >= 4:
                        log(f"hand-written run cleaned up: {len(killed)} host processes killed")
                        return
                else:
                    free_since = None
                time.sleep(0.2)
            log("warning: TPU chips still held after cleaning up the hand-written run")

        warm_up_workers(ray)
        rows = []
        for kind in kinds:
            if kind == "stop":
                rows.append((kind, Row("stop: rayslice job, `ray job stop`"), stopped_job, None))
                continue
            if kind == "command":
                rows.append((kind, Row("command: rayslice run_step, program exits 3"), rayslice, None))
                continue
            if "rayslice" in rows_wanted:
                rows.append((kind, Row(f"{kind}: rayslice run_step"), rayslice, None))
            if "a" in rows_wanted:
                rows.append((kind, Row(f"{kind}: (a) hand-written head-targeted tasks, JAX wired"), hand_written,
                             cleanup_hand))
        if "rayslice" in rows_wanted and set(kinds) - {"stop", "command"}:  # warm-up, unrecorded
            _measure(ray, record, victim_index, Row("warm-up"), "raise", rayslice, 60, None)
        started = time.monotonic()
        for rep in range(args.reps):
            for kind, row, fn, cleanup in rows:
                _measure(ray, record, victim_index, row, kind, fn, args.cap, cleanup)
            log(f"rep {rep + 1} done ({time.monotonic() - started:.0f} s)")
        for kind in kinds:
            report.add(_table(kind, [r for k, r, *_ in rows if k == kind], args))
    report.write()


def _flags(parser) -> None:
    parser.add_argument("--cap", type=float, default=15.0, help="longest wait for a failure or a release (s)")
    parser.add_argument("--kind", action="append", choices=list(KINDS),
                        help="this kind of failure only (repeatable; default all three, ~15 min on 2 cores)")
    parser.add_argument("--row", action="append", choices=["rayslice", "a"],
                        help="measure only this row (repeatable; default both)")


def _read_time(path: Path) -> float | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    return float(text) if text else None


def _slice_nodes(ray: Any) -> dict[str, str]:
    """{node id: TPU_WORKER_ID} of the live TPU hosts."""
    return {n["NodeID"]: n.get("Labels", {}).get("ray.io/tpu-worker-id", "?")
            for n in ray.nodes() if n["Alive"] and n["Resources"].get("TPU")}


def _surviving_free(ray: Any) -> bool:
    from ray._private.state import available_resources_per_node

    per_node = available_resources_per_node()
    totals = {n["NodeID"]: n["Resources"]["TPU"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("TPU")}
    return all(per_node.get(node, {}).get("TPU", 0) >= total for node, total in totals.items())


def _kill_node_when_ready(record: Any, index: int, mark_dir: str, stop: threading.Event) -> None:
    """Kill the victim's node 1 s after its step is running (its peers then wait in the collective)."""
    ready = Path(mark_dir, "ready")
    while not stop.is_set() and not ready.exists():
        time.sleep(0.02)
    if stop.wait(1.0):
        return
    Path(mark_dir, "failed").write_text(repr(time.time()))
    local_cluster.kill_node(record, index)


def _measure(ray: Any, record: Any, victim_index: int, row: Row, kind: str, fn: Any, cap: float,
             cleanup: Any) -> None:
    if not wait_all_free(ray, timeout=60):
        log("warning: TPU chips not all free before a measurement")
    hosts = _slice_nodes(ray)
    mark_dir = tempfile.mkdtemp(prefix="rs-bench-fail-")
    stop = threading.Event()
    killer = None
    if kind == "node":
        killer = threading.Thread(target=_kill_node_when_ready, args=(record, victim_index, mark_dir, stop),
                                  daemon=True)
        killer.start()
    try:
        with SliceWatcher(ray, list(hosts)) as watcher:
            failed_at, how = fn(mark_dir, kind, cap)
            t_fail = _read_time(Path(mark_dir, "failed"))
            if t_fail is None:
                raise RuntimeError(f"{row.label}: host 2 never reached its failure ({how})")
            surviving = {n for n, worker in hosts.items() if kind != "node" or worker != str(VICTIM)}
            free_at = watcher.when_free(t_fail, surviving)
            while free_at is None and time.time() < t_fail + cap:
                time.sleep(0.05)
                free_at = watcher.when_free(t_fail, surviving)
        row.failed.add(None if failed_at is None else failed_at - t_fail)
        row.free.add(None if free_at is None else free_at - t_fail)
        row.how.append(how)
        log(
            f"{row.label}: failed after {fmt_s(row.failed.values[-1], '> cap')}, "
            f"chips free after {fmt_s(row.free.values[-1], '> cap')} ({how})"
        )
    finally:
        stop.set()
        if killer:
            killer.join()
        if cleanup:
            cleanup(mark_dir)
        if kind == "node" and not processes.alive(record.nodes[victim_index].pid):
            log("restarting the killed node")
            local_cluster.restart_node(record, victim_index)
            deadline = time.monotonic() + 60
            while len(_slice_nodes(ray)) < REQUEST.hosts_per_slice and time.monotonic() < deadline:
                time.sleep(0.2)
            if cleanup:  # a retry that waited for the dead host's place runs on the new node
                cleanup(mark_dir)
        shutil.rmtree(mark_dir, ignore_errors=True)


def _table(kind: str, rows: list[Row], args: Any) -> Table:
    base = next((r for r in rows if "(a)" in r.label), None)
    cap = f"> {args.cap:.0f} s (cap)"
    table = Table(
        f"Failure detection, v6e-16 (4 hosts): {KINDS[kind]}, peers in a collective (median / p90)",
        ["method", "n", "step failed (caller sees it)", "p90", "all chips free", "p90", "× (a), failed",
         "× (a), chips free", "outcome"],
    )
    for row in rows:
        is_base = row is base
        table.add(
            row.label,
            row.failed.n,
            fmt_s(row.failed.median(), cap),
            fmt_s(row.failed.p90(), cap),
            fmt_s(row.free.median(), cap),
            fmt_s(row.free.p90(), cap),
            "1.00×" if is_base else (fmt_ratio(row.failed.median(), base.failed.median(), args.cap) if base else "—"),
            "1.00×" if is_base else (fmt_ratio(row.free.median(), base.free.median(), args.cap) if base else "—"),
            ", ".join(sorted(set(row.how))),
        )
    table.notes = [
        "times from the failure: worker 2's time.time() just before it raises or kills itself, or the benchmark's "
        "just before it kills worker 2's node",
        "chips free: every TPU chip of the slice's surviving hosts available again (GCS per-node state, polled "
        "every 20 ms)",
        f"every measurement is capped at {args.cap:.0f} s; after the cap the hand-written row's tasks are "
        "force-cancelled (ray.cancel(force=True, recursive=True)) so the next run starts on a free slice; "
        "'< x×' is a ratio against a baseline that had not got there at the cap",
    ]
    return table


if __name__ == "__main__":
    main()
