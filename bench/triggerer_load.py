"""Q5b: what one Airflow triggerer process pays to follow many running rayslice steps at once.

Each deferred step is followed in the triggerer by one `RayStepTrigger`: it polls the job's status
every `poll_interval` (2 s, the operators' default) and relays the job's log, streamed over the
dashboard's log-tail websocket, line by line to its logger. This benchmark runs N such triggers
(`--triggers`, default 200) in one process, in one asyncio event loop, as the triggerer runs them,
while every followed step prints `--lines-per-second` (10) lines of about 100 bytes for
`--seconds` (60) and then succeeds. Measured in that process:

- memory: its RSS (psutil) sampled every 0.5 s: before the triggers start, the peak, and
  (peak - before) / N per trigger;
- the event loop's lag: a probe coroutine in the same loop sleeps 50 ms again and again and records
  how late each sleep returns (p50, p99, max, as bench/log_streaming.py does; also "steady" p99 and
  max, from 5 s after every trigger relayed its first line, which leaves out the start);
- CPU: user + system seconds of the process while the triggers run (`os.times`);
- lines: the triggers' logger goes to a counting handler, which checks that every line of every job
  arrived, each exactly once and in order, and every trigger's event: `success` with its job's result;
- the dashboard's side: HTTP requests by route and payload bytes it served (JSON bodies, websocket
  messages).

Running 200 real Ray jobs at once is impossible on a 2-core machine, so the Ray dashboard is a fake
Jobs API (aiohttp) in a *separate process* (it must not share the measured event loop or its
memory). It serves what rayslice's client uses, the way Ray 2.60 serves it: `GET /api/version`,
`GET /api/jobs/{id}` (job details with rayslice's metadata, `marker_tag` included), `GET
/api/jobs/{id}/logs`, the state API's bounded read, and the log tail websocket: the log so far,
then, after each 1 s of sleep (Ray's tail reads to the end of the driver's log file, then sleeps 1 s),
the new lines in text messages of at most 10 lines; closed (1000) once the job ended and its log was
sent. A job's log is host lines `(HostProcess pid=..., ip=...) job J step N: loss ...`, then the
driver's result line (`format_result`), after which the job is SUCCEEDED.

Rows, each in a fresh process of its own (so one row's memory does not carry into the next), in one
run: a baseline (the same process, imports and loop with N idle coroutines and the lag probe, no
triggers; as long as a trigger row), then `--also` triggers (default 50), then N.

    .venv/bin/python bench/triggerer_load.py [--triggers 200 --also 50 --seconds 60 --lines-per-second 10]
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import multiprocessing
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import httpx
from _common import Report, Table, fmt_s, log, median, parse_args, percentile

from rayslice.core.step import format_result

NAME = "triggerer_load"
CONN_ID = "ray_bench_triggerer"
#: Ray's log tail reads the driver's log file to its end, then sleeps this long (`LOG_TAIL_SLEEP_S`).
TAIL_SLEEP_S = 1.0
#: Ray's tail sends at most this many lines per websocket message.
LINES_PER_MESSAGE = 10
#: The driver exits this long after printing its result line; then the job is SUCCEEDED.
DRIVER_EXIT_S = 0.5
#: The loop lag's "steady" figures begin this long after every trigger relayed its first line (the start,
#: when every trigger opens its client and stream and catches up with its log, is left out).
STEADY_AFTER_S = 5.0
#: RSS samples of the measured process are this far apart.
SAMPLE_S = 0.5
LINE = re.compile(r"\bjob (\d{4}) step (\d{6}):")
#: The fake dashboard's routes, as the tables name them.
ROUTES = {"GET /api/jobs/{id}": "status", "GET /api/jobs/{id}/logs/tail": "log tail opened",
          "GET /api/jobs/{id}/logs": "whole log", "GET /api/v0/logs/file": "bounded log read",
          "GET /api/version": "version"}


# ---------------------------------------------------------------------------------------------
# the fake dashboard (a process of its own)


@dataclass
class FakeJob:
    """One running step's Ray job, as the fake dashboard serves it; its log is computed, never stored."""

    index: int
    sid: str
    tag: str
    registered: float  # Unix time the job became RUNNING
    start: float  # Unix time its first log line is written
    seconds: float
    rate: int

    @property
    def host_lines(self) -> int:
        return int(self.seconds * self.rate)

    @property
    def end(self) -> float:
        return self.start + self.seconds + DRIVER_EXIT_S

    def line(self, n: int) -> str:
        """Line `n` of the log (with its newline): a host's line, or the driver's result line last."""
        if n == self.host_lines:
            return format_result({"job": self.index, "lines": self.host_lines}, self.tag) + "\n"
        loss = 2.0 / (1 + n / 100)
        grad = 1 + (n * 7919 % 1000) / 1000
        tps = 100_000 + (n * 104_729 + self.index * 31) % 20_000
        return (f"(HostProcess pid={41000 + self.index}, ip=10.0.{self.index // 250}.{self.index % 250 + 2}) "
                f"job {self.index:04d} step {n:06d}: loss {loss:.4f} grad_norm {grad:.3f} tokens/s {tps:6d}\n")

    def written(self, now: float) -> int:
        """Lines of the log written by `now` (the result line is the last, at `start + seconds`)."""
        if now < self.start:
            return 0
        if now >= self.start + self.seconds:
            return self.host_lines + 1
        return min(self.host_lines, int((now - self.start) * self.rate) + 1)

    def text(self, lo: int, hi: int) -> str:
        return "".join(self.line(n) for n in range(lo, hi))

    def details(self, now: float) -> dict[str, Any]:
        """`GET /api/jobs/{id}`, shaped like Ray 2.60's job details for a rayslice step."""
        ended = now >= self.end
        return {
            "type": "SUBMISSION", "job_id": f"{self.index + 1:02x}000000", "submission_id": self.sid,
            "driver_info": {"id": f"{self.index + 1:02x}000000", "node_ip_address": "10.0.0.2",
                            "pid": str(40000 + self.index)},
            "status": "SUCCEEDED" if ended else "RUNNING",
            "entrypoint": "python -m rayslice.cluster spec.json",
            "message": "Job finished successfully." if ended else "Job is currently running.",
            "error_type": None, "start_time": int(self.registered * 1000),
            "end_time": int(self.end * 1000) if ended else None,
            "metadata": {"rayslice": "1", "request": "v6e-4", "dag_id": "bench", "run_id": "r1",
                         "task_id": f"step_{self.index}", "map_index": "-1", "try_number": "1",
                         "deployment": "bench", "ti_id": f"0199-{self.index:08d}", "submission_id": self.sid,
                         "marker_tag": self.tag, "priority": "0"},
            "runtime_env": {"working_dir": "gcs://_ray_pkg_0f3c1e9b7d5a4c2e8f6b0a1d3e5c7b9a2f4e6d8c.zip",
                            "py_modules": ["gcs://_ray_pkg_5b7d9f1a3c5e7b9d1f3a5c7e9b1d3f5a7c9e1b3d.zip",
                                           "gcs://_ray_pkg_9d1f3a5c7e9b1d3f5a7c9e1b3d5f7a9c1e3b5d7f.zip"],
                            "env_vars": {"RAY_DEDUP_LOGS": "0"}},
            "driver_agent_http_address": "http://10.0.0.2:52365",
            "driver_node_id": "f" * 56, "driver_exit_code": 0 if ended else None,
        }


class FakeDashboard:
    """The Jobs API routes rayslice's client uses, and counters of what was served."""

    def __init__(self, seconds: float, rate: int) -> None:
        self.seconds, self.rate = seconds, rate
        self.jobs: dict[str, FakeJob] = {}
        self.requests: dict[str, int] = {}
        self.bytes = 0  # payload bytes served: JSON and text bodies, websocket messages
        self.ws_messages = 0
        self.ws_lines = 0  # log lines sent over websockets (a reopened stream re-sends its log)

    def app(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def count(request: web.Request, handler: Any) -> Any:
            route = request.match_info.route.resource
            path = route.canonical if route is not None else request.path
            if path.startswith("/bench/"):
                return await handler(request)
            label = f"{request.method} {path}"
            self.requests[label] = self.requests.get(label, 0) + 1  # counted as it comes: a tail runs long
            response = await handler(request)
            if isinstance(response, web.Response) and response.body is not None:
                self.bytes += len(response.body)
            return response

        app = web.Application(middlewares=[count])
        app.router.add_get("/api/version", self.version)
        app.router.add_get("/api/jobs/{id}", self.get)
        app.router.add_get("/api/jobs/{id}/logs", self.logs)
        app.router.add_get("/api/jobs/{id}/logs/tail", self.tail)
        app.router.add_get("/api/v0/logs/file", self.log_file)
        app.router.add_post("/bench/jobs", self.register)
        app.router.add_get("/bench/stats", self.stats)
        return app

    def _job(self, request: Any) -> FakeJob | None:
        return self.jobs.get(request.match_info["id"])

    @staticmethod
    def _missing(sid: str) -> Any:
        from aiohttp import web

        return web.Response(status=404, text=f"Job {sid} does not exist")

    async def version(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"version": "4", "ray_version": "2.60.0", "ray_commit": "fake",
                                  "session_name": "session_fake"})

    async def get(self, request: Any) -> Any:
        from aiohttp import web

        job = self._job(request)
        return web.json_response(job.details(time.time())) if job else self._missing(request.match_info["id"])

    async def logs(self, request: Any) -> Any:
        from aiohttp import web

        job = self._job(request)
        if job is None:
            return self._missing(request.match_info["id"])
        return web.json_response({"logs": job.text(0, job.written(time.time()))})

    async def log_file(self, request: Any) -> Any:
        from aiohttp import web

        sid = request.query.get("filename", "").removeprefix("job-driver-").removesuffix(".log")
        job = self.jobs.get(sid)
        if job is None:
            return web.Response(status=500, text=f"file {request.query.get('filename')} not found")
        written = job.written(time.time())
        return web.Response(text=job.text(max(0, written - int(request.query.get("lines", "1000"))), written))

    async def tail(self, request: Any) -> Any:
        """The log so far, then new lines after each `TAIL_SLEEP_S`, in messages of at most 10 lines."""
        from aiohttp import web

        job = self._job(request)
        if job is None:
            return self._missing(request.match_info["id"])
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        sent = 0
        try:
            while not ws.closed:
                now = time.time()
                written = job.written(now)
                while sent < written:
                    upto = min(written, sent + LINES_PER_MESSAGE)
                    message = job.text(sent, upto)
                    await ws.send_str(message)
                    self.bytes += len(message.encode())
                    self.ws_messages += 1
                    self.ws_lines += upto - sent
                    sent = upto
                if now >= job.end and sent == job.host_lines + 1:
                    break  # Ray's tail ends once the job ended and the log's end was read
                await asyncio.sleep(TAIL_SLEEP_S)
            await ws.close()  # code 1000
        except (ConnectionError, RuntimeError):
            pass  # the follower left
        return ws

    async def register(self, request: Any) -> Any:
        """`POST /bench/jobs {"sids": [...], "tags": [...]}`: these jobs start RUNNING now."""
        from aiohttp import web

        body = await request.json()
        now, n = time.time(), len(body["sids"])
        for index, (sid, tag) in enumerate(zip(body["sids"], body["tags"], strict=True)):
            # Log clocks spread over one second, as jobs started by different tasks would be.
            self.jobs[sid] = FakeJob(index, sid, tag, now, now + index / max(1, n), self.seconds, self.rate)
        return web.json_response({sid: {"start": job.start, "end": job.end, "lines": job.host_lines}
                                  for sid, job in self.jobs.items() if sid in set(body["sids"])})

    async def stats(self, request: Any) -> Any:
        from aiohttp import web

        times = os.times()
        return web.json_response({"requests": self.requests, "bytes": self.bytes, "ws_messages": self.ws_messages,
                                  "ws_lines": self.ws_lines, "cpu": times.user + times.system})


def serve_fake(conn: Any, seconds: float, rate: int) -> None:
    """The fake dashboard's process: serves on a free port of 127.0.0.1, sent back through `conn`."""
    from aiohttp import web

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it (SIGTERM)

    async def main() -> None:
        runner = web.AppRunner(FakeDashboard(seconds, rate).app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        conn.send(runner.addresses[0][1])
        await asyncio.Event().wait()

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------
# the measured process (one per row)


class LineCounter(logging.Handler):
    """The triggers' logger: counts each job's relayed lines, checks each arrives once and in order."""

    def __init__(self, jobs: int) -> None:
        super().__init__()
        self.count = [0] * jobs
        self.first: list[float | None] = [None] * jobs  # when each job's first line came (time.monotonic)
        self.next = [0] * jobs  # the step number each job's next line should carry
        self.duplicated = 0
        self.out_of_order = 0
        self.other: list[str] = []  # anything but a job's line (warnings), the first few kept

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        found = LINE.search(text)
        if found is None:
            if len(self.other) < 20:
                self.other.append(f"{record.levelname}: {text[:300]}")
            return
        job, n = int(found[1]), int(found[2])
        if not self.count[job]:
            self.first[job] = time.monotonic()
        self.count[job] += 1
        if n == self.next[job]:
            self.next[job] = n + 1
        elif n < self.next[job]:
            self.duplicated += 1
        else:
            self.out_of_order += 1
            self.next[job] = n + 1


async def lag_probe(stop: asyncio.Event, samples: list[tuple[float, float]], interval: float = 0.05) -> None:
    """bench/log_streaming.py's probe, with when each sleep began: (loop time, lateness) pairs."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        before = loop.time()
        await asyncio.sleep(interval)
        samples.append((before, loop.time() - before - interval))


async def sample_rss(stop: asyncio.Event, samples: list[int]) -> None:
    import psutil

    process = psutil.Process()
    while not stop.is_set():
        samples.append(process.memory_info().rss)
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_S)
        except TimeoutError:
            pass


async def measure(kind: str, n: int, url: str, args: Any) -> dict[str, Any]:
    """One row: N triggers (or, for the baseline, N idle coroutines) and the probes, in this loop."""
    import psutil
    from rayslice.operators.triggers import RayStepTrigger

    stamp = time.time_ns()
    sids = [f"rayslice-bench-{kind}-{stamp}-{i:04d}" for i in range(n)]
    tags = [f"{stamp % 2**32:08x}{i:08x}" for i in range(n)]
    counter = LineCounter(n)
    logger = logging.getLogger(f"bench.triggers.{kind}")
    logger.handlers, logger.propagate = [counter], False
    logger.setLevel(logging.INFO)
    triggers = []
    for sid in sids:
        trigger = RayStepTrigger(ray_conn_id=CONN_ID, submission_id=sid, poll_interval=args.poll_interval)
        trigger._log = logger  # LoggingMixin's logger; the triggerer sends it to the task's log, here to the counter
        triggers.append(trigger)
    if kind == "baseline":
        triggers.clear()
    gc.collect()
    process = psutil.Process()
    rss_before = process.memory_info().rss

    stop, probed, rss = asyncio.Event(), [], []
    probes = [asyncio.create_task(lag_probe(stop, probed)), asyncio.create_task(sample_rss(stop, rss))]
    events: list[tuple[int, float, dict[str, Any]]] = []

    async def follow(index: int, trigger: RayStepTrigger) -> None:
        event = await anext(trigger.run())
        events.append((index, time.time(), event.payload))

    async def idle() -> None:
        await stop.wait()

    times_before, started = os.times(), time.monotonic()  # the loop's clock is time.monotonic too
    if kind == "baseline":
        tasks = [asyncio.create_task(idle()) for _ in range(n)]
        await asyncio.sleep(args.seconds + DRIVER_EXIT_S + 1.0)  # as long as the jobs of a trigger row run
        jobs: dict[str, Any] = {}
        stop.set()
    else:
        async with httpx.AsyncClient(base_url=url) as control:  # the jobs start now
            jobs = (await control.post("/bench/jobs", json={"sids": sids, "tags": tags})).json()
        tasks = [asyncio.create_task(follow(i, t)) for i, t in enumerate(triggers)]
        _, pending = await asyncio.wait(tasks, timeout=args.seconds + 120)
        for task in pending:
            task.cancel()
        stop.set()
    await asyncio.gather(*tasks, *probes, return_exceptions=True)
    wall = time.monotonic() - started
    times_after = os.times()

    lags = [lateness for _, lateness in probed]
    flowing = (max(counter.first) - started if triggers and None not in counter.first else None)
    steady_from = started + (flowing + STEADY_AFTER_S if flowing is not None else 0.0)
    steady = [lateness for at, lateness in probed if at >= steady_from] if triggers else lags
    expected = int(args.seconds * args.lines_per_second)
    ok = [p for i, _, p in events if p.get("status") == "success"
          and p.get("result") == {"job": i, "lines": expected}]
    late = [at - jobs[sids[i]]["end"] for i, at, _ in events]
    return {
        "kind": kind, "n": n, "wall": wall,
        "cpu": (times_after.user + times_after.system) - (times_before.user + times_before.system),
        "rss_before": rss_before, "rss_peak": max(rss, default=rss_before), "rss_end": process.memory_info().rss,
        "lag_p50": percentile(lags, 50), "lag_p99": percentile(lags, 99), "lag_max": max(lags, default=0.0),
        "lag_n": len(lags), "flowing": flowing,
        "steady_p99": percentile(steady, 99), "steady_max": max(steady, default=0.0),
        "events": len(events), "success": len(ok),
        "errors": [p for _, _, p in events if p.get("status") != "success"][:3],
        "late_p50": median(late) if late else None, "late_max": max(late, default=None),
        "relayed": sum(counter.count), "expected": expected * len(triggers),
        "complete": sum(1 for c, m in zip(counter.count, counter.next, strict=True) if c == expected == m),
        "duplicated": counter.duplicated, "out_of_order": counter.out_of_order, "other": counter.other,
    }


def measure_row(conn: Any, kind: str, n: int, url: str, args: Any) -> None:
    """A row's process: measure, send the row back through `conn`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn.send(asyncio.run(measure(kind, n, url, args)))


# ---------------------------------------------------------------------------------------------
# the run


def run_row(kind: str, n: int, url: str, args: Any) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    before = httpx.get(f"{url}/bench/stats").json()
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=measure_row, args=(send, kind, n, url, args), name=f"bench-{kind}")
    process.start()
    try:
        if not receive.poll(args.seconds + 300):
            raise RuntimeError(f"the {kind} row gave no result")
        row = receive.recv()
    finally:
        process.join(30)
        if process.is_alive():
            process.terminate()
    after = httpx.get(f"{url}/bench/stats").json()
    requests = {k: v - before["requests"].get(k, 0) for k, v in after["requests"].items()}
    row["requests"] = {k: v for k, v in requests.items() if v}
    row["served"] = after["bytes"] - before["bytes"]
    row["ws_lines"] = after["ws_lines"] - before["ws_lines"]
    row["ws_messages"] = after["ws_messages"] - before["ws_messages"]
    row["fake_cpu"] = after["cpu"] - before["cpu"]
    log(f"{kind} ({n}): {json.dumps({k: v for k, v in row.items() if k != 'other'})}")
    for line in row["other"]:
        log(f"  {kind} logged: {line}")
    return row


def mib(value: float) -> str:
    return f"{value / 2**20:.1f} MiB"


def report_rows(args: Any, report: Report, rows: list[dict[str, Any]]) -> None:
    title = (f"One process, one event loop, following N running steps that each print {args.lines_per_second} lines/s "
             f"of ~100 bytes for {args.seconds:g} s (RayStepTrigger, poll_interval {args.poll_interval:g} s; "
             "fake dashboard in another process)")
    cost = Table(title, ["row", "lines/s in total", "RSS before", "RSS peak", "RSS (peak − before) / N",
                         "every trigger's first line after", "loop lag p50", "loop lag p99", "loop lag max",
                         "steady lag p99 / max",
                         "CPU s (% of one core)", "CPU ms per trigger-second"])
    traffic = Table("The same rows: lines, events and what the (fake) dashboard served",
                    ["row", "lines relayed / written", "lines sent over websockets",
                     "jobs with every line once, in order", "events success",
                     "event after job end, p50 / max", "HTTP requests (per s)", "by route",
                     "bytes served", "fake dashboard CPU s"])
    for row in rows:
        n = row["n"]
        followed = 0 if row["kind"] == "baseline" else n
        label = f"{n} triggers" if followed else f"baseline: {n} idle coroutines"
        per = (row["rss_peak"] - row["rss_before"]) / n
        cpu_ms = f"{row['cpu'] * 1000 / (followed * row['wall']):.2f}" if followed else "—"
        cost.add(label, followed * args.lines_per_second, mib(row["rss_before"]), mib(row["rss_peak"]),
                 f"{per / 1024:.0f} KiB", fmt_s(row["flowing"], "—"),
                 f"{row['lag_p50'] * 1000:.1f} ms", f"{row['lag_p99'] * 1000:.1f} ms",
                 f"{row['lag_max'] * 1000:.0f} ms",
                 f"{row['steady_p99'] * 1000:.1f} ms / {row['steady_max'] * 1000:.0f} ms"
                 if not math.isnan(row["steady_p99"]) else "—",
                 f"{row['cpu']:.1f} s ({row['cpu'] / row['wall']:.0%})", cpu_ms)
        if not followed:
            continue
        total = sum(row["requests"].values())
        routes = ", ".join(f"{ROUTES.get(k, k)} {v}"
                           for k, v in sorted(row["requests"].items(), key=lambda kv: -kv[1])) or "—"
        late = f"{row['late_p50']:.2f} s / {row['late_max']:.2f} s" if row["late_p50"] is not None else "—"
        traffic.add(label, f"{row['relayed']} / {row['expected']}", row["ws_lines"], f"{row['complete']} of {n}",
                    f"{row['success']} of {n}", late, f"{total} ({total / row['wall']:.1f}/s)", routes,
                    f"{row['served'] / 1e6:.2f} MB", f"{row['fake_cpu']:.1f} s")
    cost.notes += [
        "each row runs in a fresh process with the same imports (Airflow, rayslice, RayStepTrigger); RSS sampled "
        f"every {SAMPLE_S:g} s; the baseline holds N idle coroutines and the probes as long as a trigger row runs",
        "all triggers of a row start at once (as after a triggerer restart): each opens its own HTTP client and "
        f"log stream; steady lag: from {STEADY_AFTER_S:g} s after every trigger relayed its first line to the end "
        "(the baseline: all its samples)",
        "loop lag: how late a 50 ms sleep in the same loop returns; CPU: user + system seconds of the measured "
        "process while the triggers ran; CPU ms per trigger-second = CPU / (triggers × wall time)",
        "relayed lines go to a counting logging handler (cheaper than the triggerer's per-task log files)",
    ]
    traffic.notes += [
        f"the fake dashboard (aiohttp, a process of its own) tails like Ray 2.60: the log so far, then new lines "
        f"every {TAIL_SLEEP_S:g} s, at most {LINES_PER_MESSAGE} lines per websocket message; closed (1000) after "
        f"the job's end; the job turns SUCCEEDED {DRIVER_EXIT_S:g} s after the driver's result line",
        "lines sent over websockets count each job's result line too (one per job), and any line a reopened "
        "stream sent again",
        "bytes served: JSON bodies and websocket message text, without HTTP and websocket headers",
        "event after job end: when the trigger's event came, after the fake job turned SUCCEEDED",
    ]
    report.add(cost)
    report.add(traffic)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], default_reps=1, extra=lambda p: (
        p.add_argument("--triggers", type=int, default=200, help="steps followed at once (default 200)"),
        p.add_argument("--also", type=int, nargs="*", default=[50], help="smaller row sizes too (default 50)"),
        p.add_argument("--seconds", type=float, default=60.0, help="how long each step prints (default 60)"),
        p.add_argument("--lines-per-second", type=int, default=10, help="~100-byte lines a second (default 10)"),
        p.add_argument("--poll-interval", type=float, default=2.0, help="the operators' poll_interval (default 2)"),
        p.add_argument("--no-baseline", action="store_true", help="skip the idle baseline row"),
    ))
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"signal {signum}"))
    report = Report(NAME, args)
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    fake = context.Process(target=serve_fake, args=(send, args.seconds, args.lines_per_second), name="fake-dashboard")
    fake.start()
    try:
        if not receive.poll(60):
            raise RuntimeError("the fake dashboard did not start")
        url = f"http://127.0.0.1:{receive.recv()}"
        log(f"fake dashboard at {url} (pid {fake.pid})")
        os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="rayslice-bench-airflow-"))
        os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps({"conn_type": "ray", "host": url})
        rows = []
        if not args.no_baseline:
            rows.append(run_row("baseline", args.triggers, url, args))
        for n in [*sorted(set(args.also) - {args.triggers}), args.triggers]:
            rows.append(run_row(f"n{n}", n, url, args))
    finally:
        fake.terminate()
        fake.join(10)
    report_rows(args, report, rows)
    report.write()


if __name__ == "__main__":
    main()
