"""Q38: the real broker actor with 1,000 and 10,000 waiting launchers (simulated), on the test cluster's shape.

Each simulated launcher is one queue entry whose heartbeats go to the cluster's real broker
(`rayslice-broker-v1`) exactly as `rayslice.cluster.queue.Place` sends them: the whole entry, at the
interval the broker's last answer asked for (0.5 s near the front of a line, 5 s further back). They
live in `--procs` driver processes (asynchronous calls, no thread per launcher). An admitted
launcher "runs" for `--hold-s` (the capacity stays counted), then leaves and is replaced by a new
one, so the queue stays `N` deep. Kinds: 70 % one v6e-16, 10 % two v6e-16, 10 % a v6e-4, 10 % one GPU
(the cluster: two v6e-16, one v6e-4, 3 GPUs).

Measured over `--seconds` after the queue is full: the broker's plan (an admission decision over the
whole queue) p50/p99, heartbeat round trips p50/p99 as the launchers see them, beats per second,
admissions per second, and places the broker expired while their launcher lived (must be 0).

    RAYSLICE_HOME=... .venv/bin/python bench/queue_scale.py --cluster NAME [--sizes 1000 10000] [--procs 4]
"""

from __future__ import annotations

import heapq
import json
import multiprocessing
import os
import random
import time
from typing import Any

from _common import Report, Table, cluster, driver, log, parse_args, percentile

from rayslice.local import local_cluster

NAME = "queue_scale"
SPEC = local_cluster.ClusterSpec(tpus=("v6e-16", "v6e-16", "v6e-4"), gpus=3)


def _request(rng: random.Random) -> Any:
    from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest

    draw = rng.random()
    if draw < 0.7:
        return TpuSliceRequest(tpu="v6e-16")
    if draw < 0.8:
        return TpuSliceRequest(tpu="v6e-16", num_slices=2)
    if draw < 0.9:
        return TpuSliceRequest(tpu="v6e-4")
    return AcceleratorRequest(resource="GPU", count=1)


def simulate(index: int, count: int, gcs: str, seconds: float, fill_s: float, hold_s: float, out: Any,
             ready: Any) -> None:
    """One process's launchers: beat, run when admitted, leave, be replaced. Puts its measurements on `out`."""
    import ray  # noqa: TID253

    from rayslice.cluster import queue
    from rayslice.core import queue as rules

    ray.init(address=gcs, logging_level="ERROR", log_to_driver=False)
    rng = random.Random(index)
    broker = queue.broker()
    serial = 0

    def new(at: float) -> dict[str, Any]:
        nonlocal serial
        serial += 1
        entry = rules.entry_for(_request(rng), id=f"sim{index}-{serial}", label=f"bench.sim{index}-{serial}")
        return {"entry": entry, "next": at, "beat_s": queue.HEARTBEAT_S, "done_at": None}

    start = time.monotonic()
    # Join over `fill_s`, in arrival order, as launchers would; a heap of (next beat, n) says who is due.
    launchers = {n: new(start + fill_s * n / count) for n in range(count)}
    due = [(launcher["next"], n) for n, launcher in launchers.items()]
    heapq.heapify(due)
    pending: dict[Any, tuple[int, float]] = {}
    rtts: list[float] = []
    admitted = beats = 0
    measure_from = start + fill_s + 5
    end = measure_from + seconds
    said = False
    while time.monotonic() < end:
        now = time.monotonic()
        if not said and now >= measure_from:
            ready.put(index)
            said = True
        while due and due[0][0] <= now:
            _, n = heapq.heappop(due)
            launcher = launchers[n]
            if launcher["done_at"] is not None:  # ran its hold: leave, and a new launcher takes its slot
                broker.leave.remote(launcher["entry"].id)
                launchers[n] = launcher = new(now)
            ref = broker.heartbeat.remote(launcher["entry"].to_json(), beat_s=launcher["beat_s"])
            pending[ref] = (n, now)
        if not pending:
            time.sleep(0.01)
            continue
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0.02)
        at = time.monotonic()
        for ref, state in zip(done, ray.get(done), strict=True):
            n, sent = pending.pop(ref)
            launcher = launchers[n]
            if sent >= measure_from:
                rtts.append((at - sent) * 1000)
                beats += 1
            launcher["beat_s"] = float(state.get("beat_s", queue.HEARTBEAT_S))
            if state.get("admitted") and not launcher["entry"].admitted:
                launcher["entry"].admitted = True
                launcher["done_at"] = at + hold_s
                if at >= measure_from:
                    admitted += 1
            next_at = launcher["done_at"] if launcher["done_at"] is not None else sent + launcher["beat_s"]
            heapq.heappush(due, (max(next_at, at), n))
    out.put({"rtts": rtts, "beats": beats, "admitted": admitted})
    # Leave for good before this driver ends: an unsent leave would expire the place later, and count as a
    # place expired while its launcher lived.
    ray.get([broker.leave.remote(launcher["entry"].id) for launcher in launchers.values()], timeout=300)
    ray.shutdown()


def run(size: int, procs: int, gcs: str, seconds: float, hold_s: float) -> dict[str, Any]:
    import ray  # noqa: TID253

    from rayslice.cluster import queue

    before = ray.get(queue.broker().stats.remote(), timeout=30)
    fill_s = max(5.0, size / 250)  # arrivals at 250 a second
    ctx = multiprocessing.get_context("spawn")
    out, ready = ctx.Queue(), ctx.Queue()
    workers = [ctx.Process(target=simulate, args=(i, size // procs, gcs, seconds, fill_s, hold_s, out, ready))
               for i in range(procs)]
    for w in workers:
        w.start()
    for _ in workers:
        ready.get(timeout=fill_s + 300)
    sizes = []
    while out.qsize() == 0:  # while every process measures: how many places the broker holds
        sizes.append(ray.get(queue.broker().stats.remote(), timeout=30)["entries"])
        time.sleep(2)
    results = [out.get(timeout=seconds + fill_s + 300) for _ in workers]
    for w in workers:
        w.join(timeout=60)
    after = ray.get(queue.broker().stats.remote(), timeout=30)
    plans = after["plan_ms"][-200:]
    rtts = [r for result in results for r in result["rtts"]]
    log(f"places the broker held while measuring (every 2 s): {sizes}")
    return {"size": size, "queued": min(sizes or [0]), "plan_p50": percentile(plans, 50),
            "plan_p99": percentile(plans, 99), "rtt_p50": percentile(rtts, 50), "rtt_p99": percentile(rtts, 99),
            "beats_s": sum(r["beats"] for r in results) / seconds,
            "admissions_s": sum(r["admitted"] for r in results) / seconds,
            "expired": after["expired"] - before["expired"]}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], default_reps=1, extra=lambda p: (
        p.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000]),
        p.add_argument("--procs", type=int, default=4),
        p.add_argument("--seconds", type=float, default=30.0),
        p.add_argument("--hold-s", type=float, default=1.0)))
    report = Report(NAME, args)
    table = Table("the real broker, N waiting simulated launchers",
                  ["waiting", "queued (least seen)", "plan p50 (ms)", "plan p99 (ms)", "beat p50 (ms)", "beat p99 (ms)",
                   "beats/s", "admissions/s", "expired while alive"])
    with cluster(SPEC, NAME) as record, driver(record):
        for size in args.sizes:
            log(f"{size} waiting launchers in {args.procs} processes, {args.seconds:g} s")
            r = run(size, args.procs, record.gcs_address, args.seconds, args.hold_s)
            log(json.dumps(r))
            table.add(f"{size:,}", f"{r['queued']:,}", f"{r['plan_p50']:.1f}", f"{r['plan_p99']:.1f}",
                      f"{r['rtt_p50']:.1f}", f"{r['rtt_p99']:.1f}", f"{r['beats_s']:.0f}",
                      f"{r['admissions_s']:.1f}", str(r["expired"]))
            time.sleep(queue_drain_s())
    report.add(table)
    report.note(f"{os.cpu_count()} cores; admitted launchers hold for {args.hold_s:g} s, so admissions/s is bounded by "
                "the 6 slots (2 v6e-16, 1 v6e-4, 3 GPUs) over hold + the time to learn of the admission.")
    report.write()


def queue_drain_s() -> float:
    return 20.0  # slow-beating places that left are gone from the broker by then


if __name__ == "__main__":
    main()
