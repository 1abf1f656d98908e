"""What a step's processes import before JAX: CPU-seconds, this checkout against another (`--before`).

A host process is a Ray worker (it has imported `ray`) that imports the launcher's host module
(`rayslice.cluster.host_process`, which Ray loads to build the host actor) and then JAX; the job's
driver (`python -m rayslice.cluster`) imports the launcher package. Each is timed in a fresh
`python` process (CPU time of the import, `time.process_time`, which a loaded machine inflates
less than wall time), the two checkouts interleaved rep by rep. No Ray cluster is needed.

    .venv/bin/python bench/startup_imports.py --before /path/to/other/checkout [--reps 9]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from _common import ROOT, Report, Series, Table, fmt_ratio, log, parse_args

NAME = "startup_imports"

#: (label, what the process has imported before the clock starts, what is timed)
CASES = (
    ("host process: the host actor's module", "import ray, ray._private.worker",
     "import rayslice.cluster.host_process"),
    ("host process: JAX, after it", "import ray, ray._private.worker, rayslice.cluster.host_process", "import jax"),
    ("job driver: the launcher package", "", "import rayslice.cluster"),
)

PROBE = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
exec(sys.argv[2])
cpu = time.process_time()
exec(sys.argv[3])
cpu = time.process_time() - cpu
print(json.dumps({"cpu": cpu, "modules": len(sys.modules), "from": __import__("rayslice").__file__}))
"""


def host_module(tree: str, code: str) -> str:
    """`code` for this checkout: one from before the gang split (issue 51) has its host actor in cluster/gang.py."""
    if (Path(tree) / "rayslice" / "cluster" / "host_process.py").exists():
        return code
    return code.replace("rayslice.cluster.host_process", "rayslice.cluster.gang")


def probe(tree: str, before: str, timed: str) -> dict:
    before, timed = host_module(tree, before), host_module(tree, timed)
    out = subprocess.run([sys.executable, "-c", PROBE, tree, before, timed], capture_output=True, text=True,
                         check=True, cwd="/")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], default_reps=9, extra=lambda p: p.add_argument(
        "--before", required=True, metavar="TREE", help="the other checkout (its rayslice/ is imported)"))
    trees = {"this checkout": str(ROOT), "--before": args.before}
    results = {(case[0], name): Series() for case in CASES for name in trees}
    modules: dict[tuple[str, str], int] = {}
    for rep in range(args.reps):
        for label, before, timed in CASES:
            for name, tree in trees.items():  # interleaved: load changes hit both alike
                found = probe(tree, before, timed)
                if not found["from"].startswith(tree):
                    raise SystemExit(f"{name}: rayslice came from {found['from']}, not {tree}")
                results[(label, name)].add(found["cpu"])
                modules[(label, name)] = found["modules"]
        log(f"rep {rep + 1}/{args.reps} done")
    table = Table("CPU-seconds of each import (median / p90 over n reps, fresh process each)",
                  ["what", "n", "this checkout", "p90", "--before", "p90", "this ÷ before",
                   "modules after (this / before)"])
    for label, _, _ in CASES:
        now, then = results[(label, "this checkout")], results[(label, "--before")]
        table.add(label, now.n, f"{now.median():.3f} s", f"{now.p90():.3f} s", f"{then.median():.3f} s",
                  f"{then.p90():.3f} s", fmt_ratio(now.median(), then.median()),
                  f"{modules[(label, 'this checkout')]} / {modules[(label, '--before')]}")
    table.notes = ["CPU time of the timed import only (`time.process_time`), in a fresh interpreter of this venv; "
                   "the before-column imports the other checkout's rayslice/ first on sys.path"]
    report = Report(NAME, args)
    report.add(table)
    report.write()


if __name__ == "__main__":
    main()
