"""Q5: 32 deferred slice steps waiting for capacity at once, through a real Airflow.

A driver holds every TPU slice of the cluster (2 × v6e-16 and the v6e-4, reserved with
rayslice's own `reserve_slices`), then a real Airflow (`rayslice.local.airflow_stack.AirflowStack`:
api-server, scheduler with the LocalExecutor, dag-processor, triggerer, on SQLite) runs one
DAG run of `bench/airflow_dags/concurrency.py`: 16 mapped `@task.tpu_slice(tpu="v6e-4",
deferrable=True)` steps and 16 on `v6e-16`, plus a lag-probe trigger. Every step submits its
Ray job, defers, and waits in the triggerer, polling its job every `poll_interval` (2 s).

Measured once all 32 are deferred, over `--window` seconds cut into `--reps` equal parts:

- worker slots held: LocalExecutor worker processes busy with a task (their process title is
  `airflow worker -- LocalExecutor: <task>`, `<idle>` otherwise), sampled every 0.5 s, and the
  task instances the API reports `running`;
- the triggerer's event-loop lag: a probe trigger (`bench/airflow_dags/lag_probe.py`) in the same
  event loop sleeps 50 ms in a loop and records how late each sleep returns;
- HTTP requests per second to the Ray dashboard: Airflow's `ray` connection points at a counting
  reverse proxy in this process, which forwards to the dashboard.

Then the stack is stopped, the 32 Ray jobs stopped and the slices released.

    RAYSLICE_HOME=/tmp/rs-dev-home .venv/bin/python bench/airflow_concurrency.py --cluster dev
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _common import (
    ROOT,
    Report,
    Table,
    cluster,
    driver,
    loadavg,
    log,
    median,
    parse_args,
    percentile,
    wait_all_free,
)

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.local import local_cluster
from rayslice.local.airflow_stack import AirflowStack

NAME = "airflow_concurrency"
SPEC = local_cluster.ClusterSpec(tpus=("v6e-16", "v6e-16", "v6e-4"))
DAGS = ROOT / "bench" / "airflow_dags"
DAG_ID = "bench_airflow_concurrency"
HOLD = [TpuSliceRequest(tpu="v6e-16", num_slices=2), TpuSliceRequest(tpu="v6e-4")]
LAG_GOAL = 0.100
_HOP = {"host", "connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "upgrade"}


# ---------------------------------------------------------------------------------------------
# a counting reverse proxy in front of the Ray dashboard


class CountingProxy:
    """Forwards every HTTP request to `target` and records (time, method, path) of each."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.hits: list[tuple[float, str, str]] = []
        self.port = local_cluster.free_port()
        self.started = False
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> CountingProxy:
        self._thread.start()
        if not self._ready.wait(30) or not self.started:
            raise RuntimeError("the counting proxy did not start")
        return self

    def __exit__(self, *exc: Any) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            runner, session = self._loop.run_until_complete(self._start())
        finally:
            self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(runner.cleanup())
            self._loop.run_until_complete(session.close())

    async def _start(self) -> tuple[Any, Any]:
        from aiohttp import ClientSession, ClientTimeout, web

        session = ClientSession(timeout=ClientTimeout(total=120))

        async def forward(request: web.Request) -> web.Response:
            self.hits.append((time.time(), request.method, request.path))
            body = await request.read()
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
            async with session.request(
                request.method, self.target + request.rel_url.path_qs, headers=headers, data=body or None,
                allow_redirects=False,
            ) as resp:
                data = await resp.read()
                out = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
                return web.Response(status=resp.status, body=data, headers=out)

        app = web.Application(client_max_size=512 * 2**20)
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self.started = True
        return runner, session

    def between(self, start: float, end: float) -> list[tuple[float, str, str]]:
        return [h for h in list(self.hits) if start <= h[0] < end]


# ---------------------------------------------------------------------------------------------
# the Airflow stack, with this benchmark's settings


class BenchStack(AirflowStack):
    """The stack with the benchmark DAGs' folder importable and room for `steps` concurrent tasks."""

    def __init__(self, *args: Any, steps: int, poll_s: float = 2.0, extra_env: dict[str, str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps, self.poll_s, self.extra_env = steps, poll_s, dict(extra_env or {})

    def env(self) -> dict[str, str]:
        env = super().env()
        return env | self.extra_env | {
            "PYTHONPATH": os.pathsep.join(p for p in (str(DAGS), env.get("PYTHONPATH", "")) if p),
            "AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG": str(self.steps + 8),
            "AIRFLOW__CORE__MAX_MAP_LENGTH": str(max(1024, self.steps)),
            "AIRFLOW__TRIGGERER__CAPACITY": str(max(1000, self.steps + 8)),
            "RAYSLICE_BENCH_STEPS": str(self.steps),
            "RAYSLICE_BENCH_POLL_S": str(self.poll_s),
        }


def busy_worker_slots(stack: AirflowStack) -> tuple[int, int]:
    """(busy, all) LocalExecutor worker processes of the stack, from their process titles.

    Only the scheduler's own children count: a worker's forked task processes inherit its title.
    """
    busy = total = 0
    scheduler = stack.sessions.get("scheduler")
    for pid in stack.pids():
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == scheduler and title.startswith("airflow worker -- LocalExecutor"):
            total += 1
            busy += "<idle>" not in title
    return busy, total


@dataclass
class Sample:
    t: float
    states: collections.Counter = field(default_factory=collections.Counter)
    busy: int = 0
    workers: int = 0


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], extra=_flags)
    report = Report(NAME, args)
    probe_path = Path(tempfile.mkdtemp(prefix="rs-bench-lag-")) / "lag.jsonl"
    with cluster(SPEC, NAME) as record, driver(record) as ray:
        from rayslice.cluster.reservation import reserve_slices

        if not wait_all_free(ray, timeout=60):
            raise RuntimeError("the cluster's TPU chips are not all free: another step is running")
        held = [reserve_slices(r, timeout=60, name=f"bench-hold-{r.pod_type}") for r in HOLD]
        try:
            log(f"holding every slice; TPU chips free: {ray.available_resources().get('TPU', 0):.0f}")
            with CountingProxy(record.dashboard_url) as proxy:
                stack = BenchStack(proxy.url, record.token, dags_folder=DAGS, parallelism=args.parallelism,
                                   steps=args.steps, poll_s=args.poll_s)
                started = time.monotonic()
                try:
                    with stack:
                        log(f"Airflow up in {time.monotonic() - started:.0f} s at {stack.url}")
                        samples, window = _run(stack, args, probe_path)
                        report.add(_table(samples, window, proxy, probe_path, args, stack))
                finally:
                    Path(str(probe_path) + ".stop").touch()
                    stop_jobs(record)
        finally:
            for reservation in held:
                reservation.release()
        if not wait_all_free(ray, timeout=60):
            log("warning: TPU chips not all free after the benchmark")
    shutil.rmtree(probe_path.parent, ignore_errors=True)
    report.write()


def _flags(parser) -> None:
    parser.add_argument("--steps", type=int, default=32, help="deferred slice steps (default 32)")
    parser.add_argument("--poll-s", type=float, default=2.0, help="the steps' poll_interval (default 2 s)")
    parser.add_argument("--window", type=float, default=60.0, help="seconds measured once all are deferred")
    parser.add_argument("--parallelism", type=int, default=4, help="LocalExecutor worker slots (default 4)")
    parser.add_argument("--deferral-timeout", type=float, default=420.0, help="longest wait for all to defer (s)")


def _run(stack: AirflowStack, args: Any, probe_path: Path) -> tuple[list[Sample], tuple[float, float]]:
    with httpx.Client(base_url=f"{stack.url}/api/v2", timeout=60,
                      headers={"Authorization": f"Bearer {stack.api_token()}"}) as api:
        deadline = time.monotonic() + 180
        while _get(api, f"/dags/{DAG_ID}") is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the DAG processor did not register {DAG_ID} from {DAGS}")
            time.sleep(1)
        run_id = f"bench-{int(time.time())}"
        resp = api.post(f"/dags/{DAG_ID}/dagRuns",
                        json={"dag_run_id": run_id, "logical_date": None, "conf": {"probe_path": str(probe_path)}})
        resp.raise_for_status()
        triggered = time.time()
        log(f"triggered {DAG_ID} run {run_id}")
        samples: list[Sample] = []
        all_deferred: float | None = None
        limit = time.monotonic() + args.deferral_timeout
        while True:
            sample = Sample(time.time())
            sample.busy, sample.workers = busy_worker_slots(stack)
            tis = _get(api, f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances?limit=1000")
            if tis is not None:
                sample.states.update(ti["state"] or "none" for ti in tis["task_instances"])
            samples.append(sample)
            if all_deferred is None and sample.states.get("deferred", 0) >= args.steps + 1:
                all_deferred = sample.t
                log(f"all {args.steps} steps and the probe deferred {all_deferred - triggered:.0f} s after the trigger")
            if all_deferred is None and time.monotonic() > limit:
                raise RuntimeError(f"not all deferred within {args.deferral_timeout:.0f} s: {dict(sample.states)}")
            if all_deferred is not None and sample.t >= all_deferred + args.window:
                args.load_at_end = loadavg()
                break
            if len(samples) % 20 == 0:
                log(f"{dict(sample.states)}; busy worker slots {sample.busy}/{sample.workers}")
            time.sleep(0.5)
    assert all_deferred is not None
    return samples, (all_deferred, all_deferred + args.window)


def _table(samples: list[Sample], window: tuple[float, float], proxy: CountingProxy, probe_path: Path,
           args: Any, stack: AirflowStack) -> Table:
    start, end = window
    part = (end - start) / args.reps
    cuts = [(start + i * part, start + (i + 1) * part) for i in range(args.reps)]
    lags = _lags(probe_path)
    per_part: dict[str, list[float]] = collections.defaultdict(list)
    table_parts: list[str] = []
    for lo, hi in cuts:
        inside = [s for s in samples if lo <= s.t < hi]
        per_part["busy"].append(max((s.busy for s in inside), default=math.nan))
        per_part["running"].append(max((s.states.get("running", 0) for s in inside), default=math.nan))
        per_part["rps"].append(len(proxy.between(lo, hi)) / part)
        part_lags = [lag for t, lag in lags if lo <= t < hi]
        per_part["lag_p99"].append(percentile(part_lags, 99) if part_lags else math.nan)
        table_parts.append(f"{per_part['busy'][-1]:.0f}/{per_part['running'][-1]:.0f}")
    in_window = [lag for t, lag in lags if start <= t < end]
    seconds = collections.Counter(int(t) for t, _, _ in proxy.between(start, end))
    per_second = [seconds.get(s, 0) for s in range(int(start), int(end))]
    paths = collections.Counter(_route(m, p) for _, m, p in proxy.between(start, end))
    before = [s for s in samples if s.t < start]
    deferred = [s.states.get("deferred", 0) for s in samples if start <= s.t < end]
    bound = 2 * args.steps / args.poll_s

    table = Table(
        f"{args.steps} deferred slice steps waiting for capacity (one DAG run; {args.window:.0f} s measured once all "
        f"were deferred, cut into {args.reps} parts of {part:.0f} s; median over the parts / over all samples)",
        ["metric", "median over parts", "p99 / max", "goal", "met"],
    )
    busy_max = max(per_part["busy"])
    table.add("worker slots held (LocalExecutor workers busy), max per part", f"{median(per_part['busy']):.0f}",
              f"max {busy_max:.0f} of {samples[-1].workers}", "0", "yes" if busy_max == 0 else "no")
    table.add("task instances `running` (API), max per part", f"{median(per_part['running']):.0f}",
              f"max {max(per_part['running']):.0f}", "0", "yes" if max(per_part["running"]) == 0 else "no")
    lag_p99 = percentile(in_window, 99) if in_window else math.nan
    table.add("triggerer event-loop lag (50 ms probe sleeps), p99", f"{median(per_part['lag_p99']) * 1000:.1f} ms",
              f"p99 {lag_p99 * 1000:.1f} ms, max {max(in_window, default=math.nan) * 1000:.1f} ms "
              f"(n={len(in_window)})", f"≤ {LAG_GOAL * 1000:.0f} ms p99", "yes" if lag_p99 <= LAG_GOAL else "no")
    table.add("triggerer event-loop lag, p50 / p90 over all samples",
              f"{percentile(in_window, 50) * 1000:.1f} ms" if in_window else "n/a",
              f"p90 {percentile(in_window, 90) * 1000:.1f} ms" if in_window else "n/a", "", "")
    table.add("HTTP requests/s to the Ray dashboard", f"{median(per_part['rps']):.1f}/s",
              f"max {max(per_second, default=0)} in one second", f"bounded: 2 × {args.steps} / {args.poll_s:g} s "
              f"= {bound:.0f}/s", "yes" if median(per_part["rps"]) <= bound * 1.1 else "no")
    table.notes = [
        "per part, max busy worker slots / running task instances: " + ", ".join(table_parts),
        f"deferred task instances during the window: {min(deferred, default=0)}–{max(deferred, default=0)} "
        f"(of {args.steps} steps + the lag probe)",
        "requests during the window by route: " + ", ".join(f"{k} {v}" for k, v in paths.most_common(6)),
        f"before all were deferred (submission phase, {start - samples[0].t:.0f} s): busy worker slots peaked at "
        f"{max((s.busy for s in before), default=0)} of {args.parallelism} (each step holds a slot only to submit its "
        "Ray job and defer)",
        f"triggerer watchdog warnings ('async thread was blocked' > 0.2 s), whole run: {_blocked_warnings(stack)}",
        f"load average at the end of the window: {args.load_at_end}",
        "the bound: each deferred step's trigger makes 2 calls (job status, job log) per poll_interval; "
        "the rate grows linearly with the number of waiting steps and inversely with poll_interval",
    ]
    return table


def _route(method: str, path: str) -> str:
    parts = path.strip("/").split("/")
    if len(parts) >= 3 and parts[:2] == ["api", "jobs"]:
        parts[2] = "{id}"
    return f"{method} /" + "/".join(parts)


def _lags(path: Path) -> list[tuple[float, float]]:
    if not path.exists():
        return []
    return [tuple(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def _blocked_warnings(stack: AirflowStack) -> int:
    try:
        return stack.log("triggerer").read_text(errors="replace").count("async thread was blocked")
    except OSError:
        return 0


def _get(api: httpx.Client, path: str) -> dict | None:
    try:
        resp = api.get(path)
    except httpx.TransportError:
        return None
    return resp.json() if resp.status_code == 200 else None


def stop_jobs(record: local_cluster.ClusterRecord, dag_id: str = DAG_ID) -> None:
    """Stop a DAG's Ray jobs (straight to the dashboard) and wait for their ends."""
    headers = {"Authorization": f"Bearer {record.token}"} if record.token else {}
    prefix = f"rayslice-{dag_id}--"
    with httpx.Client(base_url=record.dashboard_url, headers=headers, timeout=60) as client:
        def ours() -> list[dict]:
            return [j for j in client.get("/api/jobs/").json() if (j.get("submission_id") or "").startswith(prefix)]

        for job in ours():
            if job["status"] in ("PENDING", "RUNNING"):
                client.post(f"/api/jobs/{job['submission_id']}/stop")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            live = [j for j in ours() if j["status"] in ("PENDING", "RUNNING")]
            if not live:
                log("every Ray job of the benchmark has ended")
                return
            time.sleep(1)
        log(f"warning: {len(live)} Ray jobs of the benchmark still live")


if __name__ == "__main__":
    main()
