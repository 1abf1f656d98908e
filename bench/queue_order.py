"""Q30: admission order, waits and utilisation for a mixed stream under each queue policy, and under Ray's own order.

A private cluster of two v6e-16 slices (8 hosts) and a node with 3 logical GPUs. One driver runs the
same mixed stream three times, the capacity held by real reservations (the launcher's
`reserve_slices`, and a placement group of 0.25 GPU per quarter step), each held for its step's
length and then released, with no step program in between (the order is what is measured, not JAX):

- four streams of one-slice v6e-16 holds of `--step-s` (default 6 s), back to back for `--seconds`
  (default 60 s), staggered by 1.5 s, so one-slice requests always wait;
- 10 s in, one 2-slice multislice request (both slices);
- from 2 s in, one quarter-GPU hold every 0.5 s (3 s each), 5 s in one request for 2 whole GPUs.

Runs: `best-effort` and `strict` (the admission queue, `rayslice.cluster.queue`, every request
taking its place as the launcher does), and `ray` (no queue: every request goes straight to Ray,
which serves waiting placement groups in no order). Per run: when the 2-slice and the 2-GPU
requests started after asking, how many requests that asked after them started before them, the
one-slice and quarter waits, and the share of chip-seconds (and GPU-seconds) held over the streams'
span.

    .venv/bin/python bench/queue_order.py [--seconds 60] [--step-s 6]
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from _common import Report, Table, cluster, driver, fmt_s, log, median, parse_args, percentile, wait_all_free

from rayslice.cluster import queue
from rayslice.cluster.reservation import reserve_slices
from rayslice.core import queue as rules
from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.local import local_cluster

NAME = "queue_order"
SPEC = local_cluster.ClusterSpec(tpus=("v6e-16", "v6e-16"), gpus=3)
ONE = TpuSliceRequest(tpu="v6e-16")
TWO = TpuSliceRequest(tpu="v6e-16", num_slices=2, multislice=True)
QUARTER = AcceleratorRequest(resource="GPU", count=0.25)
PAIR = AcceleratorRequest(resource="GPU", count=2)
POLICIES = ("best-effort", "strict", "ray")


@dataclass
class Hold:
    what: str
    chips: float  # TPU chips, or GPUs
    family: str
    asked: float
    started: float | None = None
    ended: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _place(request: Any, policy: str, name: str) -> queue.Place:
    if policy == "ray":
        return queue.Place.unqueued()
    if _policy_set.get("policy") != policy:  # the operator's setting (`rayslice queue --set`), once per run
        import ray  # noqa: TID253

        ray.get(queue.broker().set_settings.remote(rules.QueueSettings(policy=policy).model_dump()), timeout=30)
        _policy_set["policy"] = policy
    entry = rules.entry_for(request, id=f"{name}/{time.time_ns()}", label=name)
    return queue.Place(entry, log=lambda message: None)


_policy_set: dict[str, str] = {}


def _hold_slices(request: TpuSliceRequest, seconds: float, policy: str, name: str, out: list[Hold]) -> None:
    hold = Hold(str(request), request.total_hosts * request.chips_per_host, "TPU", time.time())
    out.append(hold)
    place = _place(request, policy, name)
    reservation = reserve_slices(request, timeout=600, name=name, place=place, queued=policy != "ray")
    hold.started = time.time()
    time.sleep(seconds)
    reservation.release()
    hold.ended = time.time()


def _hold_gpus(request: AcceleratorRequest, seconds: float, policy: str, name: str, out: list[Hold]) -> None:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    hold = Hold(str(request), request.count, "GPU", time.time())
    out.append(hold)
    place = _place(request, policy, name)
    try:
        place.wait(600)
        group = placement_group([{"GPU": request.count}] if request.count <= 1 else [{"GPU": 1}] * int(request.count),
                                strategy="PACK", name=name)
        ray.get(group.ready(), timeout=600)
        hold.started = time.time()
        time.sleep(seconds)
        remove_placement_group(group)
        hold.ended = time.time()
    finally:
        place.leave()


def run_stream(policy: str, seconds: float, step_s: float) -> tuple[list[Hold], float, float]:
    """The mixed stream under `policy`; every hold, and the stream's start and the streams' end."""
    holds: list[Hold] = []
    start = time.time()
    threads: list[threading.Thread] = []
    tag = f"bench-q-{policy}-{time.time_ns()}"

    def tpu_stream(k: int) -> None:
        time.sleep(1.5 * k)
        n = 0
        while time.time() - start < seconds:
            _hold_slices(ONE, step_s, policy, f"{tag}-s{k}-{n}", holds)
            n += 1

    def two_slices() -> None:
        time.sleep(10)
        _hold_slices(TWO, step_s, policy, f"{tag}-two", holds)

    def gpu_stream() -> None:
        time.sleep(2)
        n = 0
        quarters: list[threading.Thread] = []
        while time.time() - start < seconds:
            t = threading.Thread(target=_hold_gpus, args=(QUARTER, 3.0, policy, f"{tag}-g{n}", holds))
            t.start()
            quarters.append(t)
            n += 1
            time.sleep(0.5)
        for t in quarters:
            t.join()

    def gpu_pair() -> None:
        time.sleep(5)
        _hold_gpus(PAIR, step_s, policy, f"{tag}-pair", holds)

    threads = [threading.Thread(target=tpu_stream, args=(k,)) for k in range(4)]
    threads += [threading.Thread(target=two_slices), threading.Thread(target=gpu_stream),
                threading.Thread(target=gpu_pair)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return holds, start, start + seconds


def _passed(holds: list[Hold], big: Hold) -> int:
    """Requests of big's family that asked after it and started before it."""
    return sum(1 for h in holds if h is not big and h.family == big.family and h.asked > big.asked
               and h.started is not None and big.started is not None and h.started < big.started)


def _utilisation(holds: list[Hold], family: str, capacity: float, start: float, end: float) -> float:
    used = sum(h.chips * max(0.0, min(h.ended or end, end) - max(h.started or end, start))
               for h in holds if h.family == family)
    return used / (capacity * (end - start))


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], default_reps=1, extra=lambda p: (
        p.add_argument("--seconds", type=float, default=60.0, help="how long the streams ask (s)"),
        p.add_argument("--step-s", type=float, default=6.0, help="how long each slice step holds (s)")))
    report = Report(NAME, args)
    table = Table(f"A mixed stream for {args.seconds:g} s under each policy (one run each, same cluster)",
                  ["order", "2 x v6e-16: started after", "asked later, started before it",
                   "1-slice wait median / p90", "TPU chips held", "2 GPUs: started after",
                   "asked later, started before it", "quarter wait median / p90", "GPUs held"])
    with cluster(SPEC, NAME) as record, driver(record) as ray:
        queue.snapshot()  # the broker exists before the first run
        for policy in POLICIES:
            wait_all_free(ray)
            holds, start, end = run_stream(policy, args.seconds, args.step_s)
            two = next(h for h in holds if h.what == str(TWO))
            pair = next(h for h in holds if h.what == str(PAIR))
            ones = [h.started - h.asked for h in holds if h.what == str(ONE) and h.started]
            quarters = [h.started - h.asked for h in holds if h.what == str(QUARTER) and h.started]
            row = ("Ray's own (no queue)" if policy == "ray" else policy,
                   fmt_s(two.started - two.asked), _passed(holds, two),
                   f"{fmt_s(median(ones))} / {fmt_s(percentile(ones, 90))}",
                   f"{_utilisation(holds, 'TPU', 32, start, end):.0%}",
                   fmt_s(pair.started - pair.asked), _passed(holds, pair),
                   f"{fmt_s(median(quarters))} / {fmt_s(percentile(quarters, 90))}",
                   f"{_utilisation(holds, 'GPU', 3, start, end):.0%}")
            log(f"{policy}: {row}")
            table.add(*row)
    table.notes = [
        "started after: from asking to holding the capacity; asked later, started before it: requests of the "
        "same kind (TPU slices, or GPUs) that asked after it and got capacity before it did",
        "held: chip-seconds (GPU-seconds) held during the streams' span over what the cluster has (32 chips, "
        "3 GPUs); the 2-slice request holds both slices, so what it waits for is idle while it waits",
        "Ray's own: reserve_slices(queued=False) and plain placement groups, no place in the queue",
    ]
    report.add(table)
    report.write()


if __name__ == "__main__":
    main()
