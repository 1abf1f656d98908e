"""Run as a subprocess by bench/single_cluster_cost.py: one measurement with rayslice imported from a given tree.

    python bench/_tree_probe.py TREE dispatch-tpu|dispatch-gpu|chain URL [TOKEN]

`TREE` is a checkout of rayslice (another commit's worktree). Its `rayslice` package comes first on the
path; its `hooks/`, `operators/`, `plugins/` and `dags/` are mapped into `rayslice.*` as the installed
package maps them, so this process (and the launcher it ships with each job: the connection's launcher
is `shipped`) runs that tree's code throughout. Prints one JSON line: what was measured.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path


def use_tree(tree: Path) -> None:
    sys.path.insert(0, str(tree))
    import rayslice

    assert Path(rayslice.__file__).parent == tree / "rayslice", rayslice.__file__
    for part in ("hooks", "operators", "plugins", "dags"):
        spec = importlib.util.spec_from_file_location(f"rayslice.{part}", tree / part / "__init__.py",
                                                      submodule_search_locations=[str(tree / part)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        setattr(rayslice, part, module)
        spec.loader.exec_module(module)


def body() -> float:
    import time

    return time.time()


def dispatch(request, url: str, token: str | None) -> dict:
    """Submit to the step body's start, and to the client's return, of one step (the shipped launcher)."""
    import asyncio

    from rayslice.client.submission import run_step_job
    from rayslice.core.step import StepSpec

    spec = StepSpec.for_function(body, request=request, launcher="shipped")
    asked = time.time()
    result = asyncio.run(run_step_job(url, spec, token=token, emit=lambda line: None))
    started = result[0] if isinstance(result, list) else result
    return {"start_s": started - asked, "end_s": time.time() - asked}


def chain() -> dict:
    """`dag.test()` of bench/airflow_dags/chain.py (four 1 s quarter-GPU steps), timed whole."""
    from airflow.dag_processing.dagbag import DagBag

    path = Path(__file__).parent / "airflow_dags" / "chain.py"  # in the DAG bundle the bench configures
    bag = DagBag(dag_folder=str(path), safe_mode=False)
    if bag.import_errors:
        raise SystemExit(f"the chain's DAG file did not import: {bag.import_errors}")
    dag = bag.dags["rayslice_bench_chain"]
    began = time.time()
    run = dag.test()
    return {"chain_s": time.time() - began, "state": str(getattr(run, "state", ""))}


def main() -> None:
    tree, what, url = Path(sys.argv[1]).resolve(), sys.argv[2], sys.argv[3]
    token = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] else None
    use_tree(tree)
    from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest

    if what == "dispatch-tpu":
        out = dispatch(TpuSliceRequest(tpu="v6e-4"), url, token)
    elif what == "dispatch-gpu":
        out = dispatch(AcceleratorRequest(resource="GPU", count=0.25), url, token)
    elif what == "chain":
        out = chain()
    else:
        raise SystemExit(f"unknown measurement {what!r}")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
