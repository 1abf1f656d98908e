"""A step that names one cluster costs what it cost before cluster sets (issue 53, "Cost"), measured in one run.

The same steps, on one private cluster, with rayslice from two trees, alternating: this checkout, and a
worktree of the commit before issue 53's first change (`--base`, default 9065cef). Each measurement is
a fresh process (`bench/_tree_probe.py`) that imports that tree's rayslice, and ships that tree's
launcher with its job (`launcher: shipped`, the default), so both the Airflow side and the cluster
side are that commit's:

- dispatch: submit to the step body's start, and to the client's return, of a v6e-4 step and of a
  quarter-GPU step (`run_step_job`);
- the Airflow chain: `dag.test()` of four 1 s quarter-GPU steps in a chain (bench/airflow_dags/chain.py),
  through Airflow's own task runner and the operator's path, start in the triggerer included.

    .venv/bin/python bench/single_cluster_cost.py --reps 5
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import ROOT, Report, Series, Table, cluster, fmt_ratio, fmt_s, log, parse_args

from rayslice.local import local_cluster

SHAPE = local_cluster.ClusterSpec(tpus=("v6e-4",), gpus=1)
MEASURES = {"dispatch-tpu": ("start_s", "end_s"), "dispatch-gpu": ("start_s", "end_s"), "chain": ("chain_s",)}


def _flags(parser) -> None:
    parser.add_argument("--base", default="9065cef", help="the commit to compare with (default: before issue 53)")


def probe(tree: Path, what: str, record: local_cluster.ClusterRecord, airflow_home: Path) -> dict:
    env = {**os.environ, "AIRFLOW_HOME": str(airflow_home),
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{airflow_home}/airflow.db",
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "bench" / "airflow_dags"),
           "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps([{
               "name": "dags-folder", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
               "kwargs": {"path": str(ROOT / "bench" / "airflow_dags")}}]),
           "AIRFLOW_CONN_RAY_DEFAULT": json.dumps({"conn_type": "ray", "host": record.dashboard_url,
                                                   "password": record.token or "",
                                                   "extra": {"launcher": "shipped"}})}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "_tree_probe.py"), str(tree), what,
                           record.dashboard_url, record.token or ""], env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"{what} on {tree} failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], default_reps=5, extra=_flags, attach=False)
    report = Report("single_cluster_cost", args)
    with tempfile.TemporaryDirectory(prefix="rayslice-cost-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base), args.base], check=True)
        try:
            home = Path(tmp) / "airflow"
            home.mkdir()
            subprocess.run([str(Path(sys.executable).parent / "airflow"), "db", "migrate"], check=True,
                           capture_output=True, env={**os.environ, "AIRFLOW_HOME": str(home),
                                                     "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN":
                                                         f"sqlite:///{home}/airflow.db"})
            trees = {"before sets": base, "this commit": ROOT}
            series = {(t, w, m): Series() for t in trees for w, ms in MEASURES.items() for m in ms}
            with cluster(SHAPE, "cost") as record:
                for tree in trees.values():  # unrecorded: each tree's launcher package uploaded once
                    for what in MEASURES:
                        probe(tree, what, record, home)
                for rep in range(args.reps):
                    order = list(trees.items()) if rep % 2 == 0 else list(trees.items())[::-1]
                    for what in MEASURES:
                        for name, tree in order:
                            out = probe(tree, what, record, home)
                            for measure in MEASURES[what]:
                                series[(name, what, measure)].add(out[measure])
                            log(f"rep {rep + 1}: {what} {name}: {out}")
            table = Table(f"one cluster, before sets ({args.base}) and now, median of {args.reps}, alternating",
                          ["what", "before sets", "this commit", "ratio"])
            labels = {("dispatch-tpu", "start_s"): "v6e-4 step: submit -> body start",
                      ("dispatch-tpu", "end_s"): "v6e-4 step: submit -> result",
                      ("dispatch-gpu", "start_s"): "0.25 GPU step: submit -> body start",
                      ("dispatch-gpu", "end_s"): "0.25 GPU step: submit -> result",
                      ("chain", "chain_s"): "dag.test() of the chain of four 1 s 0.25 GPU steps"}
            for (what, measure), label in labels.items():
                before, now = (series[(t, what, measure)].median() for t in trees)
                table.add(label, fmt_s(before), fmt_s(now), fmt_ratio(now, before))
            report.add(table)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    report.write()


if __name__ == "__main__":
    main()
