"""Issue 40: a training step checkpointed with orbax on N slices resumes on another slice count, exactly.

`dags/training_pipeline.py:fit(..., global_rows=...)` draws each step's global batch from (seed, step)
only and lets each process feed its own block of it, so data-parallel training is the same math on
any number of slices; orbax restores the replicated parameters onto whatever mesh the resumed run
builds. On a cluster of its own (three single-host v6e-4 slices, so 1, 2 and 3 slices of one type),
the real launcher saves on 2 slices (multislice, 8 devices), then resumes on 1 (4 devices) and,
from there, on 3 (12 devices); and, from a copy of the 2-slice checkpoint, on 3 directly. Every host
of every run ends where an uninterrupted fixed-size run ends (numpy, `tests/training_reference.py`),
within 1e-4 (float32 sums in another order: the differences seen are about 2e-6).

The cluster-free tests run `fit` in one process with 8, 4 and 12 CPU devices: the same restore onto
another device count, without Ray.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.context import checkpoint_dir_for
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster
from tests.conftest import private_cluster, wait_until
from tests.training_reference import assert_matches, reference_fit

pytestmark = pytest.mark.timeout(600)

DATASET = {"features": 4, "rows_per_device": 8, "seed": 11}
LEARNING_RATE = 0.05
GLOBAL_ROWS = 48  # divisible by 4, 8 and 12 devices (1, 2 and 3 v6e-4 slices)
SAVED, MIDDLE, END = 4, 6, 8  # steps: saved on 2 slices, continued on 1 to MIDDLE, then on 3 to END


# --------------------------------------------------------------------------- cluster-free


@pytest.mark.parametrize("processes", [1, 2, 3, 4, 6, 12])
def test_the_processes_blocks_make_up_one_global_batch_whatever_their_number(processes):
    from rayslice.dags.training_pipeline import process_block, step_batch

    x, y = step_batch(DATASET, 5, GLOBAL_ROWS)
    blocks = [process_block(DATASET, 5, GLOBAL_ROWS, p, processes) for p in range(processes)]
    np.testing.assert_array_equal(np.concatenate([bx for bx, _ in blocks]), x)
    np.testing.assert_array_equal(np.concatenate([by for _, by in blocks]), y)
    assert not np.array_equal(step_batch(DATASET, 6, GLOBAL_ROWS)[0], x)  # each step draws its own batch


def test_without_global_rows_the_training_depends_on_the_host_count():
    """Why `global_rows` exists: per-process batches make 1, 2 and 3 hosts train on different data."""
    ends = [reference_fit(DATASET, LEARNING_RATE, END, hosts=hosts)["weights"] for hosts in (1, 2, 3)]
    assert all(np.max(np.abs(np.subtract(ends[0], other))) > 1e-4 for other in ends[1:])
    fixed = reference_fit(DATASET, LEARNING_RATE, END, global_rows=GLOBAL_ROWS)
    assert fixed == reference_fit(DATASET, LEARNING_RATE, END, hosts=3, global_rows=GLOBAL_ROWS)
    assert fixed["loss"] < reference_fit(DATASET, LEARNING_RATE, 0, global_rows=GLOBAL_ROWS)["loss"]  # it learns


#: `fit` in a process of its own with `devices` CPU devices, the step context a command step's
#: process inherits (`RAYSLICE_*`), printing its result as JSON. `fit` comes by value on stdin, as a
#: step's function reaches the cluster: importing the DAG file would import Airflow (~2 s a process).
ONE_PROCESS = textwrap.dedent(
    """
    import base64, json, sys

    import cloudpickle

    fit = cloudpickle.loads(base64.b64decode(sys.stdin.read()))
    kwargs = json.loads(sys.argv[1])
    try:
        print("RESULT " + json.dumps(fit(**kwargs)), flush=True)
    except ValueError as exc:
        print("VALUEERROR " + str(exc), flush=True)
    """
)


def fit_by_value() -> str:
    """The DAG file's `fit`, with the helpers it calls, pickled by value (base64)."""
    import cloudpickle
    from rayslice.dags import training_pipeline

    cloudpickle.register_pickle_by_value(training_pipeline)
    try:
        return base64.b64encode(cloudpickle.dumps(training_pipeline.fit)).decode()
    finally:
        cloudpickle.unregister_pickle_by_value(training_pipeline)


def fit_in_a_process(devices: int, checkpoint_dir: Path, steps: int, global_rows: int = GLOBAL_ROWS) -> dict | str:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("RAYSLICE_", "XLA_", "JAX_"))}
    env |= {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
            "RAYSLICE_SUBMISSION_ID": f"test-resharding-{time.time_ns()}", "RAYSLICE_NUM_PROCESSES": "1",
            "RAYSLICE_CHECKPOINT_DIR": checkpoint_dir.as_uri()}
    kwargs = {"dataset": DATASET, "learning_rate": LEARNING_RATE, "steps": steps, "global_rows": global_rows}
    done = subprocess.run([sys.executable, "-c", ONE_PROCESS, json.dumps(kwargs)], input=fit_by_value(), env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith(("RESULT ", "VALUEERROR ")))
    return json.loads(line.removeprefix("RESULT ")) if line.startswith("RESULT ") else line


def test_one_process_saves_on_8_devices_and_resumes_on_4_then_12_where_a_fixed_size_run_ends(tmp_path):
    saved = fit_in_a_process(8, tmp_path, SAVED)
    assert (saved["devices"], saved["resumed_from"]) == (8, 0)
    assert_matches([saved], reference_fit(DATASET, LEARNING_RATE, SAVED, global_rows=GLOBAL_ROWS))
    on_4 = fit_in_a_process(4, tmp_path, MIDDLE)
    assert (on_4["devices"], on_4["resumed_from"]) == (4, SAVED)
    assert_matches([on_4], reference_fit(DATASET, LEARNING_RATE, MIDDLE, global_rows=GLOBAL_ROWS))
    on_12 = fit_in_a_process(12, tmp_path, END)
    assert (on_12["devices"], on_12["resumed_from"]) == (12, MIDDLE)
    assert_matches([on_12], reference_fit(DATASET, LEARNING_RATE, END, global_rows=GLOBAL_ROWS))
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit())[-1] == END


def test_global_rows_that_do_not_split_evenly_over_the_devices_are_refused(tmp_path):
    refused = fit_in_a_process(8, tmp_path, 2, global_rows=12)
    assert isinstance(refused, str) and "global_rows=12" in refused and "8 devices" in refused, refused
    assert not any(p.name.isdigit() for p in tmp_path.iterdir())  # refused before any training or checkpoint


# --------------------------------------------------------------------------- on a cluster of its own


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory: pytest.TempPathFactory):
    """Three single-host v6e-4 slices (and the head): 1, 2 or 3 slices of one type, cheaply."""
    spec = local_cluster.ClusterSpec(tpus=("v6e-4", "v6e-4", "v6e-4"))
    home = tmp_path_factory.mktemp("resharding-home")
    with private_cluster(home, "resharding", lambda: local_cluster.up(spec, name="resharding")) as record:
        yield record


def train(record, root: Path, run_id: str, slices: int, steps: int) -> tuple[list[dict], str]:
    """`fit` on `slices` v6e-4 (multislice: one JAX group) through the real launcher; its hosts' results and log.

    Through the Jobs API (the job driver runs `rayslice.cluster.run_step`): this test process may
    already be a Ray driver of the session's cluster. The checkpoint folder is the owner's task
    folder under `root`, the same for every run of `run_id`.
    """
    from rayslice.dags.training_pipeline import fit

    from rayslice.client.submission import run_step_job

    spec = StepSpec.for_function(
        fit,
        request=TpuSliceRequest(tpu="v6e-4", num_slices=slices, multislice=slices > 1),
        kwargs={"dataset": DATASET, "learning_rate": LEARNING_RATE, "steps": steps, "global_rows": GLOBAL_ROWS},
        checkpoint_root=root.as_uri(),
        owner=Owner(dag_id="resharding", run_id=run_id, task_id="train",
                    submission_id=f"test-resharding-{slices}x-{time.time_ns()}"),
    )
    lines: list[str] = []
    results = asyncio.run(run_step_job(record.dashboard_url, spec, token=record.token, emit=lines.append))
    return results, "\n".join(lines)


def folder_of(root: Path, run_id: str) -> Path:
    return Path(checkpoint_dir_for(root.as_uri(), Owner(dag_id="resharding", run_id=run_id,
                                                        task_id="train")).removeprefix("file://"))


def assert_resumed(results: list[dict], log: str, hosts: int, devices: int, resumed_from: int, steps: int) -> None:
    assert len(results) == hosts, log[-4000:]
    assert {(r["devices"], r["resumed_from"]) for r in results} == {(devices, resumed_from)}, results
    assert_matches(results, reference_fit(DATASET, LEARNING_RATE, steps, global_rows=GLOBAL_ROWS))
    if resumed_from:  # the launcher's own look into the folder (the hosts' "resumed from step" lines may lag)
        assert f"the newest, step {resumed_from}," in log, log[-4000:]
    else:
        assert "holds no checkpoint: the step starts fresh" in log, log[-4000:]


def assert_all_released_on(record) -> None:
    """Every slice of the private cluster free again, and no rayslice placement group left."""
    from ray.util.state import list_placement_groups

    from rayslice.client.capacity import snapshot

    assert wait_until(lambda: all(s.state == "free" for s in snapshot(record.dashboard_url, record.token).slices),
                      timeout=10), snapshot(record.dashboard_url, record.token).slices
    left = list_placement_groups(address=record.dashboard_url, filters=[("state", "!=", "REMOVED")],
                                 raise_on_missing_output=False)
    assert [g.name for g in left if g.name.startswith("rayslice:")] == []


@pytest.fixture(scope="module")
def saved_on_two_slices(small_cluster, tmp_path_factory: pytest.TempPathFactory):
    """A checkpoint of step SAVED written by 2 × v6e-4 (multislice: 2 processes, 8 devices)."""
    root, run_id = tmp_path_factory.mktemp("resharding-checkpoints"), f"two-slices-{time.time_ns()}"
    results, log = train(small_cluster, root, run_id, slices=2, steps=SAVED)
    assert_resumed(results, log, hosts=2, devices=8, resumed_from=0, steps=SAVED)
    assert (folder_of(root, run_id) / str(SAVED)).is_dir()
    return root, run_id


def test_saved_on_2_slices_resumed_on_1_then_on_3_ends_where_a_fixed_size_run_ends(small_cluster, saved_on_two_slices,
                                                                                     tmp_path):
    root, saved_run = saved_on_two_slices
    run_id = f"two-one-three-{time.time_ns()}"
    shutil.copytree(folder_of(root, saved_run), folder_of(tmp_path, run_id))  # the 2-slice checkpoint, untouched
    results, log = train(small_cluster, tmp_path, run_id, slices=1, steps=MIDDLE)
    assert_resumed(results, log, hosts=1, devices=4, resumed_from=SAVED, steps=MIDDLE)
    results, log = train(small_cluster, tmp_path, run_id, slices=3, steps=END)
    assert_resumed(results, log, hosts=3, devices=12, resumed_from=MIDDLE, steps=END)
    assert_all_released_on(small_cluster)


def test_saved_on_2_slices_resumed_on_3_ends_where_a_fixed_size_run_ends(small_cluster, saved_on_two_slices,
                                                                          tmp_path):
    root, saved_run = saved_on_two_slices
    run_id = f"two-three-{time.time_ns()}"
    shutil.copytree(folder_of(root, saved_run), folder_of(tmp_path, run_id))
    results, log = train(small_cluster, tmp_path, run_id, slices=3, steps=END)
    assert_resumed(results, log, hosts=3, devices=12, resumed_from=SAVED, steps=END)
    assert_all_released_on(small_cluster)
