"""The queue's plan when one team over its quota fills a line: this checkout against another's rules.

A line walk stops at the first entry within quota that must wait, so a queue of N ordinary waiting
steps costs what is admitted, not N. Steps of a team over its quota do not stop the walk (a step of
another team behind them may still go), so before 2026-12-05 a team with thousands of waiting steps
made every plan walk all of them, and format a reason for each: the plan grew with the queue.

The same entries (one v6e-16 line; a share of them from team `hog`, over its 16-chip quota, the
rest from seven teams without quotas, interleaved by arrival) are planned by this checkout's
`rayslice.core.queue.plan_lines` and, with `--before TREE`, by that tree's, interleaved rep by rep,
in this one process (no cluster: the plan is pure Python, as the broker actor runs it).

    .venv/bin/python bench/queue_plan_quota.py --before /path/to/base/checkout [--reps 30]
"""

from __future__ import annotations

import gc
import importlib.util
import sys
from pathlib import Path

from _common import Report, Table, fmt_ratio, log, median, parse_args, percentile, stopwatch

from rayslice.core import queue as this

NAME = "queue_plan_quota"


def rules_from(tree: str):
    """Another checkout's `rayslice/core/queue.py`, loaded beside this one (its imports are this package's)."""
    spec = importlib.util.spec_from_file_location("before_queue", Path(tree) / "rayslice" / "core" / "queue.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["before_queue"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def entries(rules, n: int, over: int):
    """`n` waiting one-slice steps, every (n // over)-th of team `hog` (over its quota), by arrival."""
    step = n // over if over else 0
    return [rules.Entry(id=f"e{i}", label=f"d.t{i}", family="TPU-v6e", kind="v6e-16", amount=1, chips=16,
                        what="1 x v6e-16", team="hog" if step and i % step == 0 else f"t{i % 7}",
                        arrival=1000.0 + i) for i in range(n)]


def plan_ms(rules, lines, settings, running) -> float:
    with stopwatch() as took:
        rules.plan_lines(lines, running, {"v6e-16": 2.0}, settings, now=5000.0)
    return took.s * 1000


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], default_reps=30, extra=lambda p: (
        p.add_argument("--before", metavar="TREE", help="also plan with this checkout's rayslice/core/queue.py"),
        p.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])))
    report = Report(NAME, args)
    versions = {"this checkout": this} | ({"--before": rules_from(args.before)} if args.before else {})
    table = Table("plan time (ms) with a share of the waiting steps from a team over its quota",
                  ["waiting", "over quota", *[f"{v} p50" for v in versions], *[f"{v} p99" for v in versions],
                   *(["this ÷ before (p50)"] if args.before else []), "÷ none over quota (this, p50)"])
    for n in args.sizes:
        base = None
        for share in (0.0, 0.5, 1.0):
            over = int(n * share)
            times: dict[str, list[float]] = {v: [] for v in versions}
            work = {}
            for name, rules in versions.items():
                settings = rules.QueueSettings(quotas={"hog": {"v6e-16": 16}})
                running = [rules.Entry(id="r0", label="x.y", family="TPU-v6e", kind="v6e-16", amount=1, chips=16,
                                       what="1 x v6e-16", team="hog", admitted=True)]
                work[name] = (rules, rules.lines_of(entries(rules, n, over)), settings, running)
            gc.collect()
            for _ in range(args.reps):
                for name in versions:  # interleaved
                    times[name].append(plan_ms(*work[name]))
            p50 = {v: median(t) for v, t in times.items()}
            base = p50["this checkout"] if share == 0.0 else base
            table.add(f"{n:,}", f"{over:,}", *[f"{p50[v]:.2f}" for v in versions],
                      *[f"{percentile(times[v], 99):.2f}" for v in versions],
                      *([fmt_ratio(p50["this checkout"], p50["--before"])] if args.before else []),
                      fmt_ratio(p50["this checkout"], base))
            log(f"{n} waiting, {over} over quota: " + ", ".join(f"{v} {p50[v]:.2f} ms" for v in versions))
    table.notes.append("one v6e-16 line, 2 slices, one held by team hog (quota 16 chips: every hog step waiting "
                       "is over it); the other steps' teams have no quota; the first step of theirs is admitted "
                       "and the next waits, which ends the walk of a line within quota")
    report.add(table)
    report.write()


if __name__ == "__main__":
    main()
