"""Q7: following a chatty long step from the triggerer: whole-log polling against the log stream.

A step on a quarter GPU prints numbered lines of about 100 bytes at a steady rate for
`--seconds` (about 20 MB in total with the defaults). It is followed the way a deferred task is
followed, in this process's asyncio event loop, twice, on two runs of the same step:

- **polling** (the baseline, what rayslice did before): every `poll_interval` (2 s) fetch the job's
  status and its *whole* log (`GET /api/jobs/{id}/logs`), relay the new lines (`LogFollower`);
- **stream** (today's `RayStepTrigger`): the log over the dashboard's tail websocket, the small job
  status polled for the end.

Both relay every line to a logger (counted, checked for gaps and duplicates). Measured per mode:

- bytes pulled from the dashboard: everything the dashboard sent to this process, counted by a TCP
  proxy between the two (the `ray` connection points at the proxy), against the log's own size;
- the event loop's lag: a probe coroutine in the same loop sleeps 50 ms again and again and
  records how late each sleep returns (p50, p99, max);
- lines relayed: all of them, each once?

`--restart` instead follows one run of the step with a trigger that the benchmark cancels halfway
through the step (a triggerer restarting, or handing the trigger on), then with a
second trigger that resumes from what the first recorded (`rayslice_log_checkpoint`; in a triggerer
an XCom, here kept in memory): the bytes the second one pulls, the lines relayed twice, and the
peak of Python memory allocated while it follows (tracemalloc), against the log's size.

    .venv/bin/python bench/log_streaming.py --cluster dev [--seconds 200 --lines-per-second 1000] [--restart]
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import tempfile
import threading
import time
import tracemalloc
from typing import Any

from _common import Report, Table, cluster, log, parse_args, percentile, stopwatch

from rayslice.client.jobs_client import AsyncRayJobsClient
from rayslice.client.submission import LogFollower, submit_step
from rayslice.core.accelerators import AcceleratorRequest
from rayslice.core.step import Owner, StepSpec, parse_result
from rayslice.local import local_cluster

LINE = "x" * 80


def chatty_step(seconds: float, lines_per_second: int) -> int:
    """Prints `seconds * lines_per_second` numbered lines of ~100 bytes at a steady rate."""
    import time

    total = int(seconds * lines_per_second)
    start = time.monotonic()
    for i in range(total):
        print(f"line {i:08d} {LINE}", flush=False)
        if i % 100 == 99:
            print("", end="", flush=True)
            lag = start + (i + 1) / lines_per_second - time.monotonic()
            if lag > 0:
                time.sleep(lag)
    print("", end="", flush=True)
    return total


class CountingProxy:
    """A TCP proxy on 127.0.0.1 that counts the bytes the upstream (the dashboard) sends back."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.downstream_bytes = 0
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self._server.accept()
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, count: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if count:
                    with self._lock:
                        self.downstream_bytes += len(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class LineCounter(logging.Handler):
    """Receives the relayed lines; keeps the numbers of the step's `line NNNNNNNN` lines."""

    def __init__(self) -> None:
        super().__init__()
        self.numbers: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        at = text.find("line ")
        if at >= 0 and text[at + 5: at + 13].isdigit():
            self.numbers.append(int(text[at + 5: at + 13]))


async def lag_probe(stop: asyncio.Event, samples: list[float], interval: float = 0.05) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        before = loop.time()
        await asyncio.sleep(interval)
        samples.append(loop.time() - before - interval)


async def follow_by_polling(client: AsyncRayJobsClient, sid: str, emit, poll: float) -> Any:
    """The baseline: what the trigger did before the stream (status + whole log every poll)."""
    follower = LogFollower(emit)
    while True:
        job = await client.get(sid)
        text = await client.logs(sid)
        follower.feed(text)
        if job.status.is_terminal:
            return parse_result(text)[1]
        await asyncio.sleep(poll)


async def follow_by_stream(sid: str, emit_logger: logging.Logger, poll: float) -> Any:
    from rayslice.operators.triggers import RayStepTrigger

    trigger = RayStepTrigger(ray_conn_id="ray_bench", submission_id=sid, poll_interval=poll)
    trigger._log = emit_logger  # LoggingMixin's logger; the triggerer sends it to the task log, here to the counter
    event = await anext(trigger.run())
    return event.payload.get("result")


async def one_mode(mode: str, record, proxy: CountingProxy, args) -> dict[str, Any]:
    spec = StepSpec.for_function(chatty_step, request=AcceleratorRequest(resource="GPU", count=0.25),
                                 kwargs={"seconds": args.seconds, "lines_per_second": args.lines_per_second},
                                 owner=Owner(submission_id=f"bench-logs-{mode}-{time.time_ns()}"))
    counter = LineCounter()
    logger = logging.getLogger(f"bench.{mode}")
    logger.handlers, logger.propagate = [counter], False
    logger.setLevel(logging.INFO)
    async with AsyncRayJobsClient(record.dashboard_url, token=record.token) as direct:
        sid = await submit_step(direct, spec, emit=lambda line: None)
        while (await direct.get(sid)).status.value == "PENDING":
            await asyncio.sleep(0.2)
        stop, lags = asyncio.Event(), []
        probe = asyncio.create_task(lag_probe(stop, lags))
        before = proxy.downstream_bytes
        with stopwatch() as took:
            async with AsyncRayJobsClient(f"http://127.0.0.1:{proxy.port}", token=record.token) as via_proxy:
                if mode == "polling":
                    result = await follow_by_polling(via_proxy, sid, logger.info, args.poll_interval)
                else:
                    result = await follow_by_stream(sid, logger, args.poll_interval)
        stop.set()
        await probe
        pulled = proxy.downstream_bytes - before
        log_bytes = len((await direct.logs(sid)).encode())
    numbers = counter.numbers
    expected = int(args.seconds * args.lines_per_second)
    return {
        "mode": mode, "pulled": pulled, "log_bytes": log_bytes, "took": took.s, "result": result,
        "lines": len(numbers), "expected": expected, "missing": expected - len(set(numbers)),
        "duplicated": len(numbers) - len(set(numbers)), "in_order": numbers == sorted(numbers),
        "lag_p50": percentile(lags, 50), "lag_p99": percentile(lags, 99), "lag_max": max(lags, default=0.0),
    }


async def restarted(record, proxy: CountingProxy, args) -> dict[str, Any]:
    """One run of the step, followed by a trigger cancelled halfway, then by one resumed from its record."""
    from rayslice.operators.triggers import RayStepTrigger

    recorded: dict[str, Any] = {}

    class Recorded(RayStepTrigger):  # the triggerer's XCom record, in memory
        async def _checkpoint(self) -> dict[str, Any]:
            return dict(recorded) or {"offset": self.log_offset}

        async def _record(self, lines: LogFollower) -> None:
            recorded.update(lines.state())

    spec = StepSpec.for_function(chatty_step, request=AcceleratorRequest(resource="GPU", count=0.25),
                                 kwargs={"seconds": args.seconds, "lines_per_second": args.lines_per_second},
                                 owner=Owner(submission_id=f"bench-logs-restart-{time.time_ns()}"))
    expected = int(args.seconds * args.lines_per_second)
    counter = LineCounter()
    logger = logging.getLogger("bench.restart")
    logger.handlers, logger.propagate = [counter], False
    logger.setLevel(logging.INFO)
    async with AsyncRayJobsClient(record.dashboard_url, token=record.token) as direct:
        sid = await submit_step(direct, spec, emit=lambda line: None)
        first = Recorded(ray_conn_id="ray_bench", submission_id=sid, poll_interval=args.poll_interval)
        first._log = logger
        running = asyncio.create_task(anext(first.run()))
        while (await direct.get(sid)).status.value == "PENDING":
            await asyncio.sleep(0.2)
        await asyncio.wait([running], timeout=args.seconds / 2)  # the restart comes halfway through the step
        running.cancel()  # what the triggerer does to a trigger it stops or hands on
        try:
            await running
        except asyncio.CancelledError:
            pass
        before_restart = len(counter.numbers)
        pulled_before = proxy.downstream_bytes
        tracemalloc.start()
        second = Recorded(ray_conn_id="ray_bench", submission_id=sid, poll_interval=args.poll_interval)
        second._log = logger
        event = await anext(second.run())
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        pulled = proxy.downstream_bytes - pulled_before
        log_bytes = len((await direct.logs(sid)).encode())
    numbers = counter.numbers
    return {"log_bytes": log_bytes, "pulled": pulled, "peak": peak, "before": before_restart,
            "relayed_again": len(numbers) - len(set(numbers)), "missing": expected - len(set(numbers)),
            "lines": len(numbers), "expected": expected, "result": event.payload.get("result")}


def restart_report(args, report: Report, row: dict[str, Any]) -> None:
    table = Table(f"A trigger restarted halfway through a {row['log_bytes'] / 1e6:.1f} MB log "
                  f"(poll_interval {args.poll_interval:g} s)",
                  ["relayed before the restart", "pulled by the restarted trigger", "× log size",
                   "lines relayed again", "missing", "peak Python memory while following"])
    table.add(f"{row['before']} of {row['expected']}", f"{row['pulled'] / 1e6:.1f} MB",
              f"{row['pulled'] / row['log_bytes']:.2f}×", row["relayed_again"], row["missing"],
              f"{row['peak'] / 1e6:.2f} MB")
    report.note("The restarted trigger skips what the first relayed by its recorded offset: Ray's log tail "
                "re-sends the log from its start (it takes no offset), but no skipped part is held. Before this "
                f"record, a restarted trigger relayed the {row['before']} lines again.")
    report.add(table)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], default_reps=1, extra=lambda p: (
        p.add_argument("--seconds", type=float, default=200.0, help="how long the step prints (default 200)"),
        p.add_argument("--lines-per-second", type=int, default=1000, help="~100-byte lines a second (default 1000)"),
        p.add_argument("--poll-interval", type=float, default=2.0, help="the operator's poll_interval (default 2)"),
        p.add_argument("--restart", action="store_true", help="a trigger restarted halfway (see above)"),
    ))
    report = Report("log_streaming_restart" if args.restart else "log_streaming", args)
    with cluster(local_cluster.ClusterSpec(tpus=("v6e-4",), gpus=1), "log-streaming") as record:
        host, port = record.dashboard_url.removeprefix("http://").split(":")
        proxy = CountingProxy((host, int(port)))
        home = tempfile.mkdtemp(prefix="rayslice-bench-airflow-")
        os.environ.setdefault("AIRFLOW_HOME", home)
        os.environ["AIRFLOW_CONN_RAY_BENCH"] = json.dumps(
            {"conn_type": "ray", "host": f"http://127.0.0.1:{proxy.port}", **({"password": record.token}
                                                                                if record.token else {})})
        if args.restart:
            row = asyncio.run(restarted(record, proxy, args))
            log(f"restart: {json.dumps({k: v for k, v in row.items() if k != 'result'})}")
            restart_report(args, report, row)
            report.write()
            return
        rows = []
        for mode in ("polling", "stream"):
            log(f"{mode}: a {args.seconds:.0f} s step printing {args.lines_per_second} lines/s")
            rows.append(asyncio.run(one_mode(mode, record, proxy, args)))
            log(f"{mode}: {json.dumps({k: v for k, v in rows[-1].items() if k != 'result'})}")
    table = Table(f"Following a {rows[0]['log_bytes'] / 1e6:.1f} MB log over {args.seconds:.0f} s "
                  f"(poll_interval {args.poll_interval:g} s)",
                  ["mode", "bytes pulled", "× log size", "loop lag p50", "loop lag p99", "loop lag max",
                   "lines relayed", "missing", "duplicated", "in order"])
    for row in rows:
        table.add(row["mode"], f"{row['pulled'] / 1e6:.1f} MB", f"{row['pulled'] / row['log_bytes']:.2f}×",
                  f"{row['lag_p50'] * 1000:.1f} ms", f"{row['lag_p99'] * 1000:.1f} ms",
                  f"{row['lag_max'] * 1000:.0f} ms", f"{row['lines']} of {row['expected']}", row["missing"],
                  row["duplicated"], "yes" if row["in_order"] else "no")
    polling, stream = rows
    report.note(f"Stream / polling: bytes pulled {stream['pulled'] / polling['pulled']:.3f}×, "
                f"loop lag p99 {stream['lag_p99'] / max(polling['lag_p99'], 1e-9):.2f}×. "
                "Goals: stream ≤ 1.2× the log's size; lag p99 ≤ 100 ms; every line once.")
    report.add(table)
    report.write()


if __name__ == "__main__":
    main()
