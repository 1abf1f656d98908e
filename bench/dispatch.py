"""Q1: dispatch of a JAX step, from submission to the step running on every host, against faithful baselines.

One run, one warm private cluster (a v6e-4 and two v6e-16), three sizes: 1 host (v6e-4), 4 hosts
(v6e-16) and 8 hosts (2 × v6e-16 as one multislice JAX job). The step is `jax.device_count()`
with JAX wired across the gang. Every Ray method is a Ray job submitted through the Jobs REST API
and followed by the same follower (`rayslice.client.submission.wait_for_step`):

- rayslice (`run_step_job`), twice: the launcher shipped with each job (the default) and the
  launcher installed on the cluster (`launcher="installed"`: the job carries only the step, and
  its host processes start without a runtime env);
- rayslice command step (installed launcher): the same work as an unmodified program run on every
  host, `python -c "import jax; jax.distributed.initialize(); ..."` (JAX's own auto-detection wires
  it), which writes its device count to `RAYSLICE_RESULT_FILE`: its host processes start one more
  Python each;
- (a) the hand-written head-targeted pattern of Ray's TPU docs (a task on `TPU-<type>-head` that
  starts one task per host with `{<slice name>: 1, "TPU": 4}`), each host wiring `jax.distributed`
  over gloo itself (`bench/_job_baseline.py`);
- (b) `ray.util.tpu.run_on_slice` (one-shot), each host wiring JAX the same way;
- the floor: N plain processes on this machine (process start, JAX import, `jax.distributed` wiring
  over gloo, the step), no Ray;
- with `--nojax-rows`: (a) and (b) without JAX (the step only reports its start time).

Repetitions are interleaved (rep 1 of every method, then rep 2, ...); the largest shape runs first,
after one unrecorded run of every method (the run stops if one of those fails). Each rayslice job prints its
phase times (`rayslice.cluster.phases`); the phase table gives their medians next to the floor's.

    .venv/bin/python bench/dispatch.py [--reps 5] [--shape v6e-4 --shape v6e-16 --shape 2xv6e-16]
"""

from __future__ import annotations

import asyncio
import functools
import io
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from _common import (
    ROOT,
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
    wait_all_free,
    warm_up_workers,
)

from rayslice.client import submission
from rayslice.cluster.phases import PHASES, parse_phases
from rayslice.core import launcher
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster

NAME = "dispatch"
SPEC = local_cluster.ClusterSpec(tpus=("v6e-4", "v6e-16", "v6e-16"))
SHAPES = {
    "v6e-4": ("v6e-4 (1 host)", TpuSliceRequest(tpu="v6e-4")),
    "v6e-16": ("v6e-16 (4 hosts)", TpuSliceRequest(tpu="v6e-16")),
    "2xv6e-16": ("2 × v6e-16 multislice (8 hosts)", TpuSliceRequest(tpu="v6e-16", num_slices=2, multislice=True)),
}
RAYSLICE, INSTALLED, COMMAND, HAND, ON_SLICE, FLOOR = (
    "rayslice as a Ray job, launcher shipped (run_step_job)",
    "rayslice as a Ray job, launcher installed (run_step_job)",
    "rayslice command step (python -c ...), launcher installed",
    "(a) hand-written head-targeted pattern + JAX wiring, as a Ray job",
    "(b) run_on_slice (one-shot) + JAX wiring, as a Ray job",
    "floor: N plain processes (start + JAX import + jax.distributed), no Ray",
)


def jax_step() -> dict[str, Any]:
    """rayslice's step: JAX is wired by the launcher; report when the device count is known."""
    import os
    import time

    import jax

    devices = jax.device_count()
    now = time.time()
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return {"t": now, "devices": devices, "pid": os.getpid(), "proc_start": time.time() - age}


#: The command step's program: JAX wires itself (jax.distributed.initialize() finds the slice).
COMMAND_PROGRAM = (
    "import json, os, time\n"
    "import jax\n"
    "jax.distributed.initialize()\n"
    "devices = jax.device_count()\n"
    "out = open(os.environ['RAYSLICE_RESULT_FILE'], 'w')\n"
    "json.dump({'t': time.time(), 'devices': devices, 'pid': os.getpid()}, out)\n"
)

FLOOR_PROCESS = r"""
import json, os, sys, time
first = time.time()
coordinator, num_processes, process_id, chips = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={chips}"
import jax
imported = time.time()
if num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                               local_device_ids=list(range(chips)), cluster_detection_method="deactivate",
                               initialization_timeout=120)
wired = time.time()
devices = jax.device_count()
now = time.time()
if num_processes > 1:
    jax.distributed.shutdown()
print(json.dumps({"first": first, "imported": imported, "wired": wired, "t": now, "devices": devices}), flush=True)
"""


@dataclass
class Row:
    label: str
    run: Callable[[TpuSliceRequest], tuple[float, list[dict], float, dict]]  # -> (submit, hosts, returned, phases)
    running: Series = field(default_factory=Series)
    total: Series = field(default_factory=Series)
    phases: list[dict[str, float]] = field(default_factory=list)  # phase -> seconds since submission
    segments: list[dict[str, float]] = field(default_factory=list)  # segment -> seconds (SEGMENTS)
    errors: list[str] = field(default_factory=list)


def zip_file(path: Path) -> bytes:
    """One file as a working_dir package (fixed timestamp, so the same bytes upload once)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(zipfile.ZipInfo(path.name, date_time=(1980, 1, 1, 0, 0, 0)), path.read_text())
    return buf.getvalue()


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], default_reps=5, extra=_flags)
    shapes = args.shape or list(SHAPES)
    report = Report(NAME + ("" if len(shapes) == len(SHAPES) else "_" + "_".join(shapes)), args)
    with cluster(SPEC, NAME) as record, driver(record) as ray:
        slice_names = sorted({n["Labels"]["ray.io/tpu-slice-name"] for n in ray.nodes()
                              if n["Alive"] and n.get("Labels", {}).get("ray.io/tpu-pod-type") == "v6e-16"})
        rows = _rows(record, slice_names, args)
        warm_up_workers(ray)
        started = time.monotonic()
        results: dict[str, list[Row]] = {SHAPES[s][0]: [] for s in shapes}  # reported smallest first
        for label, request in (SHAPES[s] for s in reversed(shapes)):  # the largest, most involved shape first
            shape_rows = [Row(r.label, r.run) for r in rows]
            results[label] = shape_rows
            if label == SHAPES[shapes[-1]][0] and not args.no_warmup:  # the first shape: one unrecorded run each
                log(f"{label}: warm-up (one unrecorded run of each method)")
                for row in shape_rows:
                    if not _measure(ray, row, request, record=False):
                        raise SystemExit(f"warm-up of {row.label!r} failed: not measuring")
            for rep in range(args.reps):
                for row in shape_rows:  # interleaved, so load changes hit every method alike
                    _measure(ray, row, request)
                log(f"{label}: rep {rep + 1}/{args.reps} done ({time.monotonic() - started:.0f} s)")
        report.add(_table(results))
        report.add(_phase_table(results))
        report.add(_segment_table(results))
    report.write()


def _flags(parser) -> None:
    parser.add_argument("--shape", action="append", choices=list(SHAPES),
                        help="measure only this shape (repeatable; default: all three in one run)")
    parser.add_argument("--nojax-rows", action="store_true", help="add (a) and (b) without JAX as extra rows")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip the unrecorded run of each method (a cluster that has just run them)")
    parser.add_argument("--before", metavar="TREE",
                        help="add a row: the launcher shipped from another checkout's rayslice/ (e.g. the commit "
                        "before a change), interleaved with this checkout's in the same run")
    parser.add_argument("--row", action="append", choices=list(ROW_KEYS),
                        help="measure only this method (repeatable; default: all; the floor and (a) always run)")


def _rows(record: Any, slice_names: list[str], args: Any) -> list[Row]:
    from rayslice.client.jobs_client import AsyncRayJobsClient, RayJobsClient
    from rayslice.client.submission import run_step_job, wait_for_step

    package = zip_file(Path(__file__).with_name("_job_baseline.py"))

    def rayslice_job(launcher: str, command: bool = False, tree: str | None = None) -> Callable:
        def run(request: TpuSliceRequest) -> tuple[float, list[dict], float, dict]:
            if tree is not None:  # the launcher another checkout would ship, for this job only
                with mock.patch.object(submission, "launcher_packages", lambda: shipped_from(tree)):
                    return run_in(request)
            return run_in(request)

        def run_in(request: TpuSliceRequest) -> tuple[float, list[dict], float, dict]:
            lines: list[str] = []
            t0 = time.time()
            owner = Owner(submission_id=f"bench-{time.time_ns()}")
            if command:
                spec = StepSpec(command=["python", "-c", COMMAND_PROGRAM], request=request, launcher=launcher,
                                owner=owner)
            else:
                spec = StepSpec.for_function(jax_step, request=request, launcher=launcher, owner=owner)
            results = asyncio.run(run_step_job(record.dashboard_url, spec, token=record.token, emit=lines.append))
            t1 = time.time()
            # The full timing record stays in the Ray job's log (task logs and `emit` get the summary only).
            with RayJobsClient(record.dashboard_url, token=record.token) as client:
                found = parse_phases(client.logs(spec.owner.submission_id))
            return t0, results, t1, found[-1] if found else {}

        return run

    async def baseline_job(method: str, request: TpuSliceRequest) -> list[dict]:
        shape = {"head_resource": request.head_resource, "hosts": request.hosts_per_slice,
                 "chips": request.chips_per_host, "num_slices": request.num_slices, "multislice": request.multislice,
                 "topology": request.topology, "version": request.version, "pod_type": request.pod_type,
                 "slice_names": slice_names}
        async with AsyncRayJobsClient(record.dashboard_url, token=record.token) as client:
            uri = await client.ensure_package(package)
            sid = await client.submit(
                f"python _job_baseline.py {method} {shlex.quote(json.dumps(shape))}",
                submission_id=f"bench-{method}-{time.time_ns()}",
                runtime_env={"working_dir": uri, "env_vars": {"RAY_DEDUP_LOGS": "0"}},
            )
            return await wait_for_step(client, sid, emit=lambda _: None)  # the same follower as rayslice's

    def baseline(method: str) -> Callable:
        def run(request: TpuSliceRequest) -> tuple[float, list[dict], float, dict]:
            t0 = time.time()
            results = asyncio.run(baseline_job(method, request))
            return t0, results, time.time(), {}

        return run

    rows = [Row(RAYSLICE, rayslice_job("shipped")), Row(INSTALLED, rayslice_job("installed")),
            Row(COMMAND, rayslice_job("installed", command=True)), Row(HAND, baseline("a")),
            Row(ON_SLICE, baseline("b")), Row(FLOOR, floor)]
    if args.before:
        rows.insert(1, Row(BEFORE, rayslice_job("shipped", tree=args.before)))
    if args.row:
        wanted = {ROW_KEYS[key] for key in args.row} | {HAND, FLOOR, BEFORE}
        rows = [row for row in rows if row.label in wanted]
    if args.nojax_rows:
        rows += [Row("(a) hand-written head-targeted pattern, no JAX, as a Ray job", baseline("a-nojax")),
                 Row("(b) run_on_slice (one-shot), no JAX, as a Ray job", baseline("b-nojax"))]
    return rows


BEFORE = "rayslice as a Ray job, launcher shipped from --before (run_step_job)"


_THIS_LAUNCHER = submission.launcher_packages  # before any row patches it


@functools.cache
def shipped_from(tree: str) -> tuple[bytes, ...]:
    """What `launcher_packages()` ships, built from another checkout's `rayslice/` (cloudpickle: this one's)."""
    from rayslice.client.jobs_client import zip_directory

    return (zip_directory(Path(tree) / "rayslice", include=launcher.is_cluster_side, include_parent_dir=True),
            _THIS_LAUNCHER()[1])


#: `--row` names.
ROW_KEYS = {"shipped": RAYSLICE, "installed": INSTALLED, "command": COMMAND, "a": HAND, "b": ON_SLICE,
            "floor": FLOOR}

#: Where a step's start goes, segment by segment: (name, from moment, to moment). A moment is a phase
#: of the job's `[rayslice] phases` record, one of its driver-side details, or a host moment at its
#: latest host ("host:..."); "submitted" is the benchmark's submission. Consecutive, so they add up.
SEGMENTS = (
    ("Jobs API: submitted → accepted", "submitted", "accepted"),
    ("Ray's job supervisor starts the driver", "accepted", "driver_started"),
    ("driver: Python up, ray and the launcher imported (-m rayslice.cluster)", "driver_started", "main"),
    ("driver: spec decoded, version checks", "main", "imported"),
    ("driver: ray.init", "imported", "connected"),
    ("driver: checks, orphan sweep", "connected", "queued"),
    ("queue round trip (place taken → admitted)", "queued", "admitted"),
    ("placement groups (admitted → reserved)", "admitted", "reserved"),
    ("host actors requested", "reserved", "actors_created"),
    ("host processes spawned (latest host)", "actors_created", "host:hosts_started"),
    ("host: Ray worker boot, actor class import, __init__", "host:hosts_started", "host:actor_init"),
    ("host: spec decoded, JAX imported", "host:actor_init", "host:jax_imported"),
    ("host: step function loaded", "host:jax_imported", "host:prepared"),
    ("jax.distributed rendezvous", "host:prepared", "host:jax_ready"),
    ("step called", "host:jax_ready", "host:step_started"),
)
FLOOR_SEGMENTS = {"Jobs API: submitted → accepted": ("submitted", "hosts_started"),  # process start
                  "host: spec decoded, JAX imported": ("hosts_started", "jax_imported"),
                  "jax.distributed rendezvous": ("jax_imported", "jax_ready"),
                  "step called": ("jax_ready", "step_started")}


def segments(record: dict, t0: float) -> dict[str, float]:
    """Seconds per SEGMENTS entry of one job's phases record (a segment whose ends are unknown is left out)."""
    detail, hosts = record.get("detail", {}), record.get("hosts", [])

    def moment(name: str) -> float | None:
        if name == "submitted":
            return t0
        if name.startswith("host:"):
            values = [h.get(name[5:]) for h in hosts]
            return max(values) if values and None not in values else None
        return record.get(name, detail.get(name))

    out = {}
    for name, start, end in SEGMENTS:
        a, b = moment(start), moment(end)
        if a is not None and b is not None:
            out[name] = b - a
    return out


def floor(request: TpuSliceRequest) -> tuple[float, list[dict], float, dict]:
    """N processes started at once on this machine, wired as one JAX group (as rayslice wires its gang)."""
    processes = request.total_hosts if request.multislice else request.hosts_per_slice
    with socket.socket() as sock:
        sock.bind(("127.0.0.2", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "JAX_", "XLA_"))}
    t0 = time.time()
    # One group per slice (a multislice request is one group of all hosts): here, the first group's processes.
    children = [
        subprocess.Popen([sys.executable, "-c", FLOOR_PROCESS, f"127.0.0.2:{port}", str(processes), str(i),
                          str(request.chips_per_host)], stdout=subprocess.PIPE, env=env, cwd=ROOT)
        for i in range(processes)
    ]
    outputs = [child.communicate(timeout=300)[0] for child in children]
    t1 = time.time()
    if any(child.returncode for child in children):
        raise RuntimeError(f"floor processes failed: {[c.returncode for c in children]}")
    hosts = [json.loads(out.decode().strip().splitlines()[-1]) for out in outputs]
    phases = {"hosts_started": max(h["first"] for h in hosts) - t0,
              "jax_imported": max(h["imported"] for h in hosts) - t0, "jax_ready": max(h["wired"] for h in hosts) - t0,
              "step_started": max(h["t"] for h in hosts) - t0}
    # The floor runs one group; a multislice request's hosts form one group too, a single slice's likewise.
    return t0, hosts * (request.total_hosts // processes), t1, {"relative": phases}


def _measure(ray: Any, row: Row, request: TpuSliceRequest, record: bool = True) -> bool:
    if not wait_all_free(ray):
        log("warning: TPU chips not all free before a measurement")
    try:
        t0, hosts, t1, phases = row.run(request)
    except Exception as exc:  # noqa: BLE001 - a failed run is reported, not fatal
        log(f"{row.label}: {type(exc).__name__}: {str(exc)[:300]}")
        if record:
            row.errors.append(type(exc).__name__)
            row.running.add(None)
            row.total.add(None)
        return False
    if len(hosts) != request.total_hosts:
        raise RuntimeError(f"{row.label}: {len(hosts)} host results for {request}")
    wanted = request.chips_per_host * (request.total_hosts if request.multislice else request.hosts_per_slice)
    if any(h.get("devices", wanted) != wanted for h in hosts):
        raise RuntimeError(f"{row.label}: JAX saw {[h.get('devices') for h in hosts]} devices, wanted {wanted}")
    log(f"  {row.label[:40]}: running {max(h['t'] for h in hosts) - t0:.2f} s, total {t1 - t0:.2f} s")
    if not record:
        return True
    row.running.add(max(h["t"] for h in hosts) - t0)
    row.total.add(t1 - t0)
    if "relative" in phases:
        row.phases.append(phases["relative"] | {"result": t1 - t0})
        at = {"submitted": 0.0, **phases["relative"]}
        row.segments.append({name: at[b] - at[a] for name, (a, b) in FLOOR_SEGMENTS.items()}
                            | {"total": at["step_started"]})
    elif phases:
        row.segments.append(segments(phases, t0) | {"total": max(h["t"] for h in hosts) - t0})
        relative = {k: v - t0 for k, v in phases.items() if k in PHASES} | {"result": t1 - t0}
        detail, per_host = phases.get("detail", {}), phases.get("hosts", [])
        if "reserving" in detail and "reserved" in phases:
            relative["reservation"] = phases["reserved"] - detail["reserving"]
        for moment, key in (("actor_init", "workers_up"), ("jax_imported", "jax_imported")):  # host by host
            if per_host and all(moment in h for h in per_host):
                relative[key] = max(h[moment] for h in per_host) - t0
        if "released" in phases and per_host and all("left_group" in h for h in per_host):
            relative["release"] = phases["released"] - max(h["left_group"] for h in per_host)
        row.phases.append(relative)
    return True


def _table(results: dict[str, list[Row]]) -> Table:
    table = Table(
        "Dispatch of a JAX step (median / p90 over n reps; ratios of medians)",
        ["method", "n", "all hosts running", "p90", "× (a)", "× floor", "− floor", "total wall", "p90", "× (a)",
         "× (b)", "− floor"],
    )
    for label, rows in results.items():
        table.section(label)
        by = {row.label: row for row in rows}
        a, base = by[HAND], by[FLOOR]
        b = by.get(ON_SLICE, Row(ON_SLICE, floor))  # not measured (--row): its column stays empty
        for row in rows:
            above = (None if row.running.median() is None or base.running.median() is None
                     else row.running.median() - base.running.median())
            above_total = (None if row.total.median() is None or base.total.median() is None
                           else row.total.median() - base.total.median())
            table.add(
                row.label + (f" ({len(row.errors)} failed)" if row.errors else ""),
                row.running.n,
                fmt_s(row.running.median()),
                fmt_s(row.running.p90()),
                fmt_ratio(row.running.median(), a.running.median()),
                fmt_ratio(row.running.median(), base.running.median()),
                "—" if row is base else fmt_s(above),
                fmt_s(row.total.median()),
                fmt_s(row.total.p90()),
                fmt_ratio(row.total.median(), a.total.median()),
                fmt_ratio(row.total.median(), b.total.median()),
                "—" if row is base else fmt_s(above_total),
            )
    table.notes = [
        "all hosts running: the latest host's time.time() when jax.device_count() returned (JAX wired across the "
        "gang), minus the submission time",
        "total wall: submission until the caller has every host's result; rayslice's includes releasing its "
        "placement groups (waiting until Ray marks them REMOVED) before its driver exits",
        "Ray rows: a Ray job submitted through the Jobs REST API from this process and followed by "
        "rayslice.client.submission.wait_for_step (status polled every 1 s, the log streamed); the baselines print "
        "their result as rayslice's result line so the same follower reads it",
        "floor: the same number of JAX processes (one JAX group) started with subprocess from this process, "
        "coordinator on 127.0.0.2; total = until all exited",
        "− floor: the method's median minus the floor's median (same size, same run)",
    ]
    return table


def _phase_table(results: dict[str, list[Row]]) -> Table:
    at = list(PHASES).index("hosts_started") + 1
    shown = [*list(PHASES)[:at], "workers_up", "jax_imported", *list(PHASES)[at:], "result", "reservation", "release"]
    names = {**{p: p.replace("_", " ") for p in PHASES}, "workers_up": "Ray workers up",
             "jax_imported": "JAX imported", "result": "result in caller",
             "reservation": "reservation took", "release": "release after the last host returned"}
    table = Table("Where the time goes: seconds after submission (median per phase)",
                  ["method", *[names[p] for p in shown]])
    for label, rows in results.items():
        table.section(label)
        for row in rows:
            if row.label not in (RAYSLICE, BEFORE, INSTALLED, FLOOR) or not row.phases:
                continue
            cells = []
            for phase in shown:
                values = [p[phase] for p in row.phases if phase in p]
                if phase in ("reservation", "release"):
                    cells.append(f"{median(values) * 1000:.0f} ms" if values else "")
                else:
                    cells.append(f"{median(values):.2f}" if values else "")
            table.add(f"{row.label.split(' (')[0].split(':')[0]} (n={len(row.phases)})", *cells)
    table.notes = [
        "accepted: the job's start_time in Ray's job table; driver started: the job driver's process start; "
        "reserved: the launcher's placement groups ready; host phases: the latest host's time (hosts started = "
        "its process start, from /proc); Ray workers up: the latest host's Ray worker booted and its actor "
        "constructed; JAX imported: the latest host's `import jax` done; released: rayslice's placement groups "
        "REMOVED; result: the caller has it",
        "reservation took: from reserve_slices() called to both placement groups ready (free slices); release after "
        "the last host returned: from the last host's return (after leaving its JAX group) to every placement "
        "group REMOVED",
        "floor: hosts started = the latest process's first Python line, JAX ready = jax.distributed wired, "
        "step started = device_count() returned; result = every process exited",
    ]
    return table


def _segment_table(results: dict[str, list[Row]]) -> Table:
    shown = [row.label for row in next(iter(results.values()))
             if row.label in (RAYSLICE, BEFORE, INSTALLED, FLOOR)]
    short = {RAYSLICE: "shipped", BEFORE: "shipped, --before", INSTALLED: "installed", FLOOR: "floor"}
    table = Table("Where every second of the start goes: seconds per segment (median over reps)",
                  ["segment", *[short[label] for label in shown]])
    for label, rows in results.items():
        table.section(label)
        by = {row.label: row for row in rows}
        for name in [*(s[0] for s in SEGMENTS), "total"]:
            cells = []
            for key in shown:
                values = [seg[name] for seg in by[key].segments if name in seg]
                cells.append(f"{median(values):.2f}" if values else "")
            table.add("submitted → all hosts running (sum)" if name == "total" else name, *cells)
    table.notes = [
        "each segment ends where the next begins (host moments at the latest host), so they add up to the total",
        "floor: the first row is its processes' start (submitted → every process's first line), then JAX's import, "
        "jax.distributed.initialize and device_count()",
        "the driver's moments are its own `time.time()` (main: the driver's main() entered, after `python -m "
        "rayslice.cluster` imported the package; imported: the spec decoded; connected: ray.init returned); "
        "queued/admitted: the step's place in the admission queue taken and granted; host moments: each host's "
        "process start (/proc), actor constructed, JAX imported, step function loaded, jax.distributed wired, "
        "step called",
    ]
    return table


if __name__ == "__main__":
    main()
