"""Q30 with real steps: a 2-slice multislice step among four streams of one-slice steps, each a Ray job.

A private cluster of two v6e-16 slices (8 hosts). Four streams each run one-slice v6e-16 function
steps of `--step-s` (default 6 s) back to back for `--seconds` (default 80 s), staggered by 1.5 s,
so one-slice requests always wait; 10 s in, a 2-slice multislice step asks for both slices. Every
step is a whole rayslice step submitted through the Jobs API (`run_step_job`), as a deferred
Airflow task submits it: a job driver, the admission queue, the reservation, one host process per
host, JAX wired across the slice, the step's body, the release.

Reported for the 2-slice step: from asking (the submission) to its body starting on the first
host, and where that time went (the job's phase times: driver started, admitted by the queue,
capacity reserved, host processes started, JAX ready, step started), how many one-slice steps ran
and whether each returned its own result.

    .venv/bin/python bench/queue_real_steps.py [--seconds 80] [--step-s 6] [--reps 1]
"""

from __future__ import annotations

import asyncio
import time

from _common import Report, Table, cluster, driver, fmt_s, log, median, parse_args, wait_all_free

from rayslice.client.jobs_client import RayJobsClient
from rayslice.client.submission import run_step_job
from rayslice.cluster import queue
from rayslice.cluster.phases import parse_phases
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster

NAME = "queue_real_steps"
SPEC = local_cluster.ClusterSpec(tpus=("v6e-16", "v6e-16"))
ONE = TpuSliceRequest(tpu="v6e-16")
TWO = TpuSliceRequest(tpu="v6e-16", num_slices=2, multislice=True)


def one_slice_step(stream: int, n: int, seconds: float) -> list[int]:
    import time

    time.sleep(seconds)
    return [stream, n]


def two_slice_step() -> float:
    import time

    return time.time()


def run_once(record, seconds: float, step_s: float) -> dict:
    """The scenario once: the 2-slice step's ask, start and phases, and the one-slice steps' results."""
    started = time.time()
    out: dict = {"streams": [], "wrong": [], "asks": {}}

    async def step(fn, request, kwargs, timeout, tag):
        spec = StepSpec.for_function(fn, request=request, kwargs=kwargs, capacity_timeout=timeout,
                                     owner=Owner(submission_id=f"bench-queue-{tag}-{time.time_ns()}"))
        asked = time.time()
        result = await run_step_job(record.dashboard_url, spec, token=record.token, emit=lambda line: None)
        out["asks"][spec.owner.submission_id] = asked
        return spec.owner.submission_id, result

    async def stream(k: int) -> None:
        await asyncio.sleep(k * 1.5)
        n = 0
        while time.time() - started < seconds:
            _, result = await step(one_slice_step, ONE, {"stream": k, "n": n, "seconds": step_s}, 300, f"s{k}")
            (out["streams"] if result == [[k, n]] * ONE.hosts_per_slice else out["wrong"]).append((k, n))
            n += 1

    async def big() -> None:
        await asyncio.sleep(10)
        asked = time.time()
        sid, starts = await step(two_slice_step, TWO, {}, 300, "big")
        out.update(asked=asked, first_host=min(starts), hosts=len(starts), sid=sid, done=time.time() - started)

    async def everything() -> None:
        await asyncio.gather(big(), *(stream(k) for k in range(4)))

    asyncio.run(everything())
    out["moments"], out["holds"] = [], []
    with RayJobsClient(record.dashboard_url, token=record.token) as client:
        for sid, asked in sorted(out["asks"].items(), key=lambda item: item[1]):
            found = parse_phases(client.logs(sid))
            phases = found[-1] if found else {}
            if sid == out["sid"]:
                out["phases"] = phases
            if sid != out["sid"] and all(phases.get(k) for k in ("reserved", "step_started", "step_done", "released")):
                out["holds"].append((phases["released"] - phases["reserved"],
                                     phases["step_done"] - phases["step_started"]))
            at = {"asked": asked, "admitted": phases.get("detail", {}).get("admitted"),
                  **{phase: phases.get(phase) for phase in ("reserved", "jax_ready", "step_started", "released")}}
            out["moments"].append((sid.split("-")[2], {k: v - started if v else None for k, v in at.items()}))
    return out


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], default_reps=1, extra=lambda p: (
        p.add_argument("--seconds", type=float, default=80.0, help="how long the streams ask (s)"),
        p.add_argument("--step-s", type=float, default=6.0, help="how long each one-slice step's body runs (s)"),
        p.add_argument("--before", metavar="TREE", help="ship the launcher from another checkout's rayslice/ "
                       "(e.g. the commit before a change) instead of this one's")))
    if args.before:
        from unittest import mock

        from dispatch import shipped_from

        from rayslice.client import submission

        mock.patch.object(submission, "launcher_packages", lambda: shipped_from(args.before)).start()
    report = Report(NAME + ("_before" if args.before else ""), args)
    table = Table(f"2 x v6e-16 step among four streams of one-slice {args.step_s:g} s steps for {args.seconds:g} s "
                  "(real steps, best-effort queue)",
                  ["run", "asked to body started", "to driver started", "to admitted", "to reserved",
                   "to hosts started", "to JAX ready", "to step started", "one-slice steps (own results)",
                   "2-slice step ended at"])
    asks, timelines, holds = [], [], []
    with cluster(SPEC, NAME) as record, driver(record) as ray:
        queue.snapshot()  # the broker exists before the first run
        for rep in range(args.reps):
            wait_all_free(ray)
            out = run_once(record, args.seconds, args.step_s)
            phases, detail = out["phases"], out["phases"].get("detail", {})
            asked = out["asked"]

            def since(at, asked=asked):
                return fmt_s(at - asked) if at else "-"

            asks.append(out["first_host"] - asked)
            holds += out["holds"]
            row = (str(rep + 1), fmt_s(out["first_host"] - asked), since(phases.get("driver_started")),
                   since(detail.get("admitted")), since(phases.get("reserved")), since(phases.get("hosts_started")),
                   since(phases.get("jax_ready")), since(phases.get("step_started")),
                   f"{len(out['streams'])} ({len(out['wrong'])} wrong)", f"{out['done']:.0f} s in")
            log(f"run {rep + 1}: {row}")
            table.add(*row)
            steps = Table(f"Run {rep + 1}: every step, seconds after the streams began",
                          ["step", "asked", "admitted", "reserved", "JAX ready", "body started", "released"])
            for step, at in out["moments"]:
                steps.add(step, *(f"{v:.1f}" if v is not None else "-" for v in at.values()))
            timelines.append(steps)
    table.notes = [
        f"median of {len(asks)}: asked to body started {fmt_s(median(asks))}",
        "asked: the 2-slice step's submission through the Jobs API; the phase columns are the step's own phase "
        "times (its job log), counted from the same ask; body started: the earliest host's first line of the body",
        "every step is a Ray job with its own driver; the streams keep one-slice requests waiting the whole time",
    ]
    report.add(table)
    hold_table = Table("One-slice steps: how long each held its slice, against its body (median over every step)",
                       ["steps", "hold (reserved → released)", "body (step started → done, latest host)",
                        "hold ÷ body"])
    if holds:
        hold, body = median([h for h, _ in holds]), median([b for _, b in holds])
        hold_table.add(len(holds), fmt_s(hold), fmt_s(body), f"{median([h / b for h, b in holds]):.2f}×")
    hold_table.notes = ["hold ÷ body: the median of each step's own ratio; the rest of a hold is starting the "
                        "step's host processes (worker, imports, JAX wired) and releasing"]
    report.add(hold_table)
    for steps in timelines:
        report.add(steps)
    report.write()


if __name__ == "__main__":
    main()
