"""One step over two clusters (issue 53): how soon a step naming (a, b) starts on b while a is held, against
the same step on b alone, in one run; and, with --many N, N steps naming (a, b) with capacity freeing on both
at random, checked from both clusters' job records (never a body on two clusters, every chip free after).

    .venv/bin/python bench/cluster_set.py --reps 3                 # two private v6e-16 clusters
    .venv/bin/python bench/cluster_set.py --tpu v6e-4 --many 50    # and the 50-step check
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import tempfile
import threading
import time
from pathlib import Path

from _common import Report, Table, cluster, fmt_ratio, fmt_s, log, median, parse_args

from rayslice.client import capacity
from rayslice.client.cluster_set import Member, run_on_set, spec_for_set
from rayslice.client.jobs_client import AsyncRayJobsClient, RayJobsClient
from rayslice.client.submission import run_step_job
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster


def body(seconds: float = 0.0, flag: str = "", record: str = "", step: str = "") -> dict:
    """The step: when it started (this host's clock), where, and (with `flag`) held until the flag exists.
    With `record`, each host appends its step's name, cluster, start and end there."""
    import json
    import time
    from pathlib import Path

    import ray

    started = time.time()
    gcs = ray.get_runtime_context().gcs_address
    if flag:
        Path(flag).with_suffix(".started").write_text(gcs)
        while not Path(flag).exists():
            time.sleep(0.05)
    time.sleep(seconds)
    if record:
        with open(record, "a") as out:
            out.write(json.dumps({"step": step, "gcs": gcs, "start": started, "end": time.time()}) + "\n")
    return {"gcs": gcs, "started": started}


def spec(tpu: str, task: str, shared: Path, **kwargs) -> StepSpec:
    return StepSpec.for_function(body, request=TpuSliceRequest(tpu=tpu), kwargs=kwargs, launcher="installed",
                                 owner=Owner(dag_id="bench_sets", run_id="r", task_id=task),
                                 checkpoint_root=f"file://{shared}", capacity_timeout=600)


def members(*records: local_cluster.ClusterRecord) -> list[Member]:
    return [Member(r.name, AsyncRayJobsClient(r.dashboard_url, token=r.token), launcher="installed") for r in records]


async def on_set(step: StepSpec, *records: local_cluster.ClusterRecord):
    clients = members(*records)
    try:
        return await run_on_set(step, clients, emit=lambda line: None)
    finally:
        for m in clients:
            await m.client.aclose()


def start_delay_alone(b, tpu: str, shared: Path, rep: int) -> float:
    step = spec(tpu, f"alone-{rep}", shared)
    asked = time.time()
    [result, *_] = asyncio.run(run_step_job(b.dashboard_url, step, token=b.token, emit=lambda line: None))
    return result["started"] - asked


@contextlib.contextmanager
def holding(a, tpu: str, shared: Path, name: str):
    """a's one slice held by a step of its own, from its body's start until the block ends."""
    flag = shared / f"hold-{name}"
    step = spec(tpu, f"holder-{name}", shared, flag=str(flag))
    holder = threading.Thread(target=lambda: asyncio.run(run_step_job(a.dashboard_url, step, token=a.token,
                                                                      emit=lambda line: None)))
    holder.start()
    try:
        while not flag.with_suffix(".started").exists():
            time.sleep(0.05)
        yield
    finally:
        flag.write_text("go")
        holder.join(300)


def start_delay_on_set(a, b, tpu: str, shared: Path, rep: int) -> float:
    with holding(a, tpu, shared, f"set-{rep}"):
        step = spec_for_set(spec(tpu, f"set-{rep}", shared), "bench", (a.name, b.name), shared_root=True)
        asked = time.time()
        [result, *_] = asyncio.run(on_set(step, a, b))
        assert result["gcs"] == b.gcs_address, "the step ran on the held cluster"
        return result["started"] - asked


def start_delay_alone_beside_a_job_on_a(a, b, tpu: str, shared: Path, rep: int) -> float:
    """The step on b alone while a's slice is held and a job of the same step starts on a at the same moment
    (it waits in a's queue, and is stopped once b's body started): what the two clusters sharing this
    machine's cores costs b, with no set at all. The set's own cost is the set row less this one."""
    with holding(a, tpu, shared, f"beside-{rep}"):
        waiting_on_a = spec(tpu, f"beside-{rep}", shared)
        mine = spec(tpu, f"alone-beside-{rep}", shared)
        sid = f"rayslice-bench-beside-{rep}-{time.time_ns()}"

        async def both():
            queued = asyncio.ensure_future(run_step_job(a.dashboard_url, waiting_on_a, token=a.token,
                                                        submission_id=sid, emit=lambda line: None))
            asked = time.time()
            [result, *_] = await run_step_job(b.dashboard_url, mine, token=b.token, emit=lambda line: None)
            queued.cancel()
            await asyncio.gather(queued, return_exceptions=True)
            return result["started"] - asked

        try:
            return asyncio.run(both())
        finally:
            with contextlib.suppress(Exception), RayJobsClient(a.dashboard_url, token=a.token) as on_a:
                on_a.stop(sid)


def free_chips(record) -> float:
    taken = capacity.snapshot(record.dashboard_url, record.token)
    return sum(h.chips - h.chips_used for s in taken.slices for h in s.hosts if h.state == "free")


def many(a, b, tpu: str, shared: Path, count: int, in_flight: int) -> dict:
    record = shared / "many.jsonl"
    rng = random.Random(53)
    steps = [spec_for_set(spec(tpu, f"many-{i}", shared, seconds=rng.uniform(0.2, 3.0), record=str(record),
                               step=f"many-{i}"), "bench", (a.name, b.name), shared_root=True) for i in range(count)]

    async def go():
        gate = asyncio.Semaphore(in_flight)

        async def one(step):
            async with gate:
                await asyncio.sleep(rng.uniform(0, 1.0))
                return await on_set(step, a, b)

        return await asyncio.gather(*(one(s) for s in steps))

    started = time.monotonic()
    asyncio.run(go())
    took = time.monotonic() - started
    ran_twice, not_once = [], []
    for step in steps:
        ran = []
        for r in (a, b):
            with RayJobsClient(r.dashboard_url, token=r.token) as client:
                job = client.get(step.owner.submission_id)
                text = client.logs(step.owner.submission_id)
            if "the step runs on cluster" in text:
                ran.append((r.name, job.status.value))
        if len(ran) > 1:
            ran_twice.append((step.owner.task_id, ran))
        elif len(ran) != 1 or ran[0][1] != "SUCCEEDED":
            not_once.append((step.owner.task_id, ran))
    hosts = [json.loads(line) for line in record.read_text().splitlines()]
    # One body per step: its hosts' span, on the one cluster they all ran on (a step on two would show here).
    bodies: dict[str, dict] = {}
    for x in hosts:
        seen = bodies.setdefault(x["step"], {"gcs": set(), "start": x["start"], "end": x["end"]})
        seen["gcs"].add(x["gcs"])
        seen["start"], seen["end"] = min(seen["start"], x["start"]), max(seen["end"], x["end"])
    on_two = sum(1 for x in bodies.values() if len(x["gcs"]) > 1)
    overlaps = 0
    for gcs in {g for x in bodies.values() for g in x["gcs"]}:
        mine = sorted((x["start"], x["end"]) for x in bodies.values() if gcs in x["gcs"])
        overlaps += sum(1 for (_, end), (nxt, _) in zip(mine, mine[1:], strict=False) if nxt < end)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(free_chips(r) == TpuSliceRequest(tpu=tpu).total_chips
                                                  for r in (a, b)):
        time.sleep(1)
    return {"steps": count, "seconds": took, "bodies": len(bodies), "ran_twice": ran_twice, "not_once": not_once,
            "overlaps": overlaps, "on_two": on_two, "free": {r.name: free_chips(r) for r in (a, b)},
            "on_b": sum(1 for x in bodies.values() if x["gcs"] == {b.gcs_address})}


def main() -> None:
    def extra(parser):
        parser.add_argument("--tpu", default="v6e-16", help="each cluster's one slice (default v6e-16)")
        parser.add_argument("--many", type=int, default=0, help="also run this many steps naming (a, b)")
        parser.add_argument("--in-flight", type=int, default=6, help="--many: steps submitted at once (default 6)")

    args = parse_args("one step over two clusters: start delay, and never on two at once", default_reps=3,
                      extra=extra, attach=False)
    shape = local_cluster.ClusterSpec(tpus=(args.tpu,), gpus=0)
    report = Report("cluster_set" + ("" if args.tpu == "v6e-16" else f"_{args.tpu}"), args)
    shared = Path(tempfile.mkdtemp(prefix="rayslice-bench-shared-"))
    with cluster(shape, "set-a", private=True) as a, cluster(shape, "set-b", private=True) as b:
        start_delay_alone(b, args.tpu, shared, -1)  # warm-up, unrecorded
        alone, on_set_, beside = [], [], []
        for rep in range(args.reps):
            alone.append(start_delay_alone(b, args.tpu, shared, rep))
            on_set_.append(start_delay_on_set(a, b, args.tpu, shared, rep))
            beside.append(start_delay_alone_beside_a_job_on_a(a, b, args.tpu, shared, rep))
            log(f"rep {rep}: alone {alone[-1]:.2f} s, on the set {on_set_[-1]:.2f} s, "
                f"alone beside a job starting on a {beside[-1]:.2f} s")
        table = Table(f"submit -> step body start on b ({args.tpu}), median of {args.reps}",
                      ["how", "seconds", "runs", "ratio"])
        table.add("on b alone", fmt_s(median(alone)), ", ".join(f"{x:.2f}" for x in alone), "1.00x")
        table.add("naming (a, b), a held", fmt_s(median(on_set_)), ", ".join(f"{x:.2f}" for x in on_set_),
                  fmt_ratio(median(on_set_), median(alone)))
        table.add("on b alone, a held, a job of the step starting on a at once (no set)", fmt_s(median(beside)),
                  ", ".join(f"{x:.2f}" for x in beside), fmt_ratio(median(beside), median(alone)))
        report.add(table)
        if args.many:
            result = many(a, b, args.tpu, shared, args.many, args.in_flight)
            checks = Table(f"{args.many} steps naming (a, b), {args.in_flight} at once, random lengths",
                           ["check", "value"])
            checks.add("seconds", fmt_s(result["seconds"]))
            checks.add("bodies (one per step)", result["bodies"])
            checks.add("of them on b", result["on_b"])
            checks.add("steps whose body ran on two clusters (job records)", len(result["ran_twice"]))
            checks.add("steps not run exactly once, successfully (job records)", len(result["not_once"]))
            checks.add("steps whose hosts ran on two clusters (the bodies' own records)", result["on_two"])
            checks.add("steps overlapping on one cluster's slice (the bodies' own records)", result["overlaps"])
            checks.add("free chips after (a, b)", ", ".join(f"{k}: {v:g}" for k, v in result["free"].items()))
            report.add(checks)
    report.write()


if __name__ == "__main__":
    main()
