"""The Slices page at scale: one refresh's time, peak memory and event-loop lag, before vs after.

A dashboard that has run 10,000 rayslice jobs and keeps 100,000 ended host actors (Ray's default
`maximum_gcs_destroyed_actor_cached_count`), plus a few running steps, is served from a recorded-
shape answer of that size (`/logical/actors`, `/api/jobs/`, `/api/jobs/<id>`, the state API) by a
small HTTP server in its own process: what Ray itself filters (the state API's `state` filters)
is answered already filtered, as Ray answers it. Each variant then runs in a fresh Python process
playing the API server: it reads what one page refresh reads (the capacity snapshot and the usage
timeline, together), `--reps` times, while a 5 ms ticker on the same event loop records how late
it runs (the lag every other request on that loop, e.g. Airflow's Execution API, would see).

- before: the page's reads at `--before` (default 1f4e919): the whole job list twice, the actor
  table decoded and parsed on the event loop.
- after: this tree: jobs by id with ended ones kept (`rayslice.client.job_records`), the actor
  table read and cut to the window in a child process (`rayslice.client.actor_table`; its peak
  memory is shown apart), the rest parsed in a thread.

Then 8 pages refreshing at the same moment: the dashboard requests and bytes they cause (after:
one shared reading, `rayslice.plugins.slices.shared`).

    .venv/bin/python bench/slices_page.py [--reps 5] [--before 1f4e919] [--jobs 10000] [--pages 8]

8 pages of the old code at once decode the actor table 8 times over in one process (gigabytes at
10,000 jobs): run that part on a smaller dashboard (`--jobs 1000`), the single refresh at full size
(`--pages 0`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import subprocess
import sys
import time
import types
from pathlib import Path

from _common import ROOT, Report, Table, median, parse_args, percentile, stopwatch

NAME = "slices_page"
JOBS = int(os.environ.get("SLICES_BENCH_JOBS", "10000"))  # --jobs, passed to the server process
ACTORS_PER_JOB, RUNNING = 10, 4
HOURS = 6.0


# --------------------------------------------------------------------------- the recorded-size dashboard


def _bodies(now: float) -> dict[str, bytes]:
    rng = random.Random(7)
    nodes = [{"node_id": f"{i:056x}", "state": "ALIVE", "resources_total": {"TPU": 4, "CPU": 8},
              "labels": {"ray.io/tpu-slice-name": f"v6e-16-{'ab'[i // 4]}", "ray.io/tpu-worker-id": str(i % 4),
                         "ray.io/tpu-pod-type": "v6e-16", "ray.io/tpu-topology": "4x4"}} for i in range(8)]
    nodes.append({"node_id": "g" * 56, "state": "ALIVE", "resources_total": {"GPU": 4, "CPU": 8}, "labels": {}})
    jobs, actors, by_id = [], {}, {}
    for j in range(JOBS):
        sid = f"rayslice-dag{j % 40}-run{j}-train-1-{j:08x}"
        start = now - rng.uniform(0, 72 * 3600)
        running = j < RUNNING
        job = {"type": "SUBMISSION", "job_id": f"{j + 2:08x}", "submission_id": sid,
               "driver_info": {"id": f"{j + 2:08x}", "node_ip_address": "10.0.0.1", "pid": str(1000 + j)},
               "status": "RUNNING" if running else "SUCCEEDED", "entrypoint": "python -m rayslice.cluster spec.json",
               "message": "Job finished successfully.", "error_type": None, "start_time": int(start * 1000),
               "end_time": None if running else int((start + 600) * 1000),
               "metadata": {"rayslice": "1", "dag_id": f"dag{j % 40}", "run_id": f"scheduled__{j}",
                            "task_id": "train", "map_index": "-1", "try_number": "1", "request": "v6e-16"},
               "runtime_env": {"working_dir": f"gcs://_ray_pkg_{j:040x}.zip",
                               "py_modules": ["gcs://_ray_pkg_0123456789abcdef.zip"], "env_vars": {"A": "1"}},
               "driver_agent_http_address": "http://10.0.0.1:52365", "driver_node_id": "0" * 56,
               "driver_exit_code": 0}
        jobs.append(job)
        by_id[sid] = by_id[job["job_id"]] = json.dumps(job).encode()
        for a in range(ACTORS_PER_JOB):
            actor_id = f"{j:016x}{a:08x}{'0' * 8}"
            slice_name, worker = f"v6e-16-{'ab'[a // 4 % 2]}", a % 4
            actors[actor_id] = {
                "actorId": actor_id, "jobId": job["job_id"], "placementGroupId": f"{j:036x}",
                "address": {"nodeId": nodes[worker]["node_id"], "ipAddress": "10.0.0.2", "port": 10000 + a,
                            "workerId": f"{j:048x}{a:08x}"},
                "state": "ALIVE" if running else "DEAD", "name": f"rayslice:{sid}/{slice_name}/host{worker}",
                "numRestarts": "0", "timestamp": int(start * 1000), "pid": 2000 + a, "startTime": int(start * 1000),
                "endTime": 0 if running else int((start + 600) * 1000),
                "requiredResources": {"TPU_group_0_" + f"{j:036x}": 4.0, "CPU": 1.0},
                "exitDetail": "The actor is dead because its owner has died." if not running else "-",
                "reprName": "", "className": "HostProcess", "actorClass": "HostProcess", "isDetached": False,
                "rayNamespace": "5d0b1b9c-1111-2222-3333-444455556666",
                "functionDescriptor": {"pythonFunctionDescriptor": {
                    "moduleName": "rayslice.cluster.host_process", "className": "HostProcess",
                    "functionName": "__init__",
                    "functionHash": "b2c3d4e5f6"}},
                "callSite": "", "labelSelector": {"ray.io/tpu-slice-name": slice_name}, "gpus": [],
                "processStats": None, "mem": []}
    alive = [{"actor_id": k, "state": "ALIVE", "name": v["name"], "job_id": v["jobId"],
              "node_id": v["address"]["nodeId"], "placement_group_id": v["placementGroupId"],
              "required_resources": {"TPU_group_0_x": 4.0}}
             for k, v in actors.items() if v["state"] == "ALIVE"]

    def state(rows: list) -> bytes:
        result = {"total": len(rows), "num_after_truncation": len(rows), "num_filtered": len(rows), "result": rows}
        return json.dumps({"result": True, "data": {"result": result}}).encode()

    return {"/api/v0/nodes": state(nodes), "/api/v0/placement_groups": state([]), "/api/v0/actors": state(alive),
            "/logical/actors": json.dumps({"result": True, "data": {"actors": actors}}).encode(),
            "/api/jobs/": json.dumps(jobs).encode(), "by_id": by_id}


def serve(port_file: str) -> None:
    """The dashboard: the bodies above, and /_counts (requests and bytes per path so far)."""
    from aiohttp import web

    bodies = _bodies(time.time())
    by_id = bodies.pop("by_id")
    counts: dict[str, list[int]] = {}

    def note(path: str, body: bytes) -> web.Response:
        row = counts.setdefault(path, [0, 0])
        row[0] += 1
        row[1] += len(body)
        return web.Response(body=body, content_type="application/json")

    async def fixed(request: web.Request) -> web.Response:
        if request.path == "/logical/actors" and "ids" in request.query:
            return note("/logical/actors?ids", b'{"result": true, "data": {"actors": {}}}')
        return note(request.path, bodies[request.path])

    async def one_job(request: web.Request) -> web.Response:
        body = by_id.get(request.match_info["job"])
        if body is None:
            return web.Response(status=404, text="no such job")
        return note("/api/jobs/<id>", body)

    async def count(request: web.Request) -> web.Response:
        return web.json_response(counts)

    app = web.Application()
    for path in bodies:
        app.router.add_get(path, fixed)
    app.router.add_get("/api/jobs/{job}", one_job)
    app.router.add_get("/_counts", count)

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        Path(port_file).write_text(str(site._server.sockets[0].getsockname()[1]))
        await asyncio.Event().wait()

    asyncio.run(main())


# --------------------------------------------------------------------------- the API server's side


def _old_modules(commit: str) -> tuple[types.ModuleType, types.ModuleType]:
    """`capacity` and `usage` as they were at `commit`, loaded beside today's."""
    def load(name: str, path: str, replace: tuple[str, str] | None = None) -> types.ModuleType:
        source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout
        if replace:
            source = source.replace(*replace)
        module = types.ModuleType(name)
        module.__file__ = f"{commit}:{path}"
        sys.modules[name] = module
        exec(compile(source, module.__file__, "exec"), module.__dict__)
        return module

    capacity = load("old_capacity", "rayslice/client/capacity.py")
    usage = load("old_usage", "rayslice/client/usage.py",
                 ("from rayslice.client.capacity import", "from old_capacity import"))
    return capacity, usage


def measure(variant: str, url: str, reps: int, commit: str) -> dict:
    """One variant in this (fresh) process: time per refresh, peak memory above the start, event-loop lag."""
    import psutil

    sys.path.insert(0, str(ROOT))
    if variant == "before":
        capacity, usage = _old_modules(commit)
    else:
        from rayslice.client import capacity, usage  # noqa: F811

    async def refresh() -> None:  # one page refresh: the same two readings in both variants
        await asyncio.gather(capacity.asnapshot(url, timeout=120), usage.ausage(url, hours=HOURS, timeout=120))

    async def main() -> dict:
        lags: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                due = time.perf_counter() + 0.005
                await asyncio.sleep(0.005)
                lags.append(max(0.0, time.perf_counter() - due))

        rss0 = psutil.Process().memory_info().rss
        tick = asyncio.create_task(ticker())
        times = []
        for _ in range(reps):
            with stopwatch() as took:
                await refresh()
            times.append(took.s)
        stop.set()
        await tick
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
        child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # after: the actor-table reader
        return {"first_s": times[0], "median_s": median(times[1:] or times), "peak_mb": peak / 2**20,
                "child_peak_mb": child / 2**20,
                "max_lag_ms": max(lags) * 1000, "p99_lag_ms": percentile(lags, 99) * 1000}

    return asyncio.run(main())


def concurrent(variant: str, url: str, pages: int, commit: str) -> None:
    """`pages` page refreshes at the same moment (each: capacity + usage), as the API server serves them."""
    sys.path.insert(0, str(ROOT))
    if variant == "before":
        capacity, usage = _old_modules(commit)

        async def page() -> None:
            await asyncio.gather(capacity.asnapshot(url, timeout=120), usage.ausage(url, hours=HOURS, timeout=120))
    else:
        from rayslice.plugins.slices import shared

        from rayslice.client import capacity, usage  # noqa: F811

        async def page() -> None:
            await asyncio.gather(shared("capacity", lambda: capacity.asnapshot(url, timeout=120)),
                                 shared("usage", lambda: usage.ausage(url, hours=HOURS, timeout=120)))

    async def main() -> None:
        await asyncio.gather(*(page() for _ in range(pages)))

    asyncio.run(main())


# --------------------------------------------------------------------------- the run


def _child(*args: str) -> str:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"{args}: {out.stderr[-3000:]}")
    return out.stdout


def main() -> None:
    global JOBS
    def options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--before", default="1f4e919")
        parser.add_argument("--pages", type=int, default=8, help="pages refreshing at once (0: skip that part)")
        parser.add_argument("--jobs", type=int, default=10_000, help="jobs on the recorded dashboard (10 actors each)")
        parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)

    args = parse_args(__doc__.splitlines()[0], default_reps=5, extra=options, attach=False)
    if args.child:
        kind, variant, url = args.child[:3]
        if kind == "serve":
            serve(url)
        elif kind == "measure":
            print(json.dumps(measure(variant, url, args.reps, args.before)))
        else:
            concurrent(variant, url, args.pages, args.before)
        return

    import httpx

    os.environ["SLICES_BENCH_JOBS"] = str(args.jobs)
    JOBS = args.jobs
    port_file = Path(f"/tmp/slices-page-bench-{os.getpid()}.port")
    server = subprocess.Popen([sys.executable, __file__, "--child", "serve", "x", str(port_file)])
    try:
        deadline = time.monotonic() + 300
        while not port_file.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the recorded dashboard did not start")
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port_file.read_text()}"

        def counts() -> dict:
            return httpx.get(f"{url}/_counts", timeout=60).json()

        sizes = {p: len(httpx.get(f"{url}{p}", timeout=120).content) for p in ("/logical/actors", "/api/jobs/")}
        print(f"dashboard: /logical/actors {sizes['/logical/actors'] / 2**20:.1f} MiB, "
              f"/api/jobs/ {sizes['/api/jobs/'] / 2**20:.1f} MiB ({JOBS} jobs, {JOBS * ACTORS_PER_JOB} actors)")
        rows = {}
        for variant in ("before", "after"):
            seen = counts()
            rows[variant] = json.loads(_child("--reps", str(args.reps), "--before", args.before,
                                              "--child", "measure", variant, url).strip().splitlines()[-1])
            after = counts()
            rows[variant]["requests"] = {p: after[p][0] - seen.get(p, [0])[0] for p in after
                                         if after[p][0] - seen.get(p, [0])[0]}
        conc = {}
        for variant in ("before", "after") if args.pages else ():
            seen = counts()
            with stopwatch() as took:
                _child("--pages", str(args.pages), "--before", args.before, "--child", "concurrent", variant, url)
            after = counts()
            conc[variant] = (sum(after[p][0] - seen.get(p, [0, 0])[0] for p in after),
                             sum(after[p][1] - seen.get(p, [0, 0])[1] for p in after) / 2**20, took.s)
    finally:
        server.terminate()
        server.wait(timeout=30)
        port_file.unlink(missing_ok=True)

    report = Report(NAME, args)
    refresh = Table(f"One refresh ({args.reps} reps, {JOBS} jobs)",
                    ["variant", "first", "median", "peak memory (child process)", "event-loop lag max (p99)",
                     "dashboard requests per run"])
    for variant, r in rows.items():
        reqs = ", ".join(f"{p} x{n}" for p, n in sorted(r["requests"].items()))
        refresh.add(variant, f"{r['first_s']:.2f} s", f"{r['median_s']:.2f} s",
                    f"{r['peak_mb']:.0f} MiB ({r['child_peak_mb']:.0f} MiB)",
                    f"{r['max_lag_ms']:.0f} ms ({r['p99_lag_ms']:.0f} ms)", reqs)
    report.add(refresh)
    if conc:
        pages = Table(f"{args.pages} pages refreshing at once",
                      ["variant", "dashboard requests", "bytes read", "wall (incl. start)"])
        for variant, (n, mb, took) in conc.items():
            pages.add(variant, n, f"{mb:.0f} MiB", f"{took:.1f} s")
        report.add(pages)
    report.write()


if __name__ == "__main__":
    main()
