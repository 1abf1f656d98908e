"""Every example DAG imports cleanly and fast, and runs end to end with `dag.test()` on the cluster."""

from __future__ import annotations

import math
import re
import sys
import time
from pathlib import Path

import pytest

from rayslice.core.accelerators import TpuSliceRequest
from tests.airflow_env import EXAMPLE_DAGS, task_states, xcom_values

# A loaded 2-core machine can slow a multi-host step several-fold: a guard, not a budget.
pytestmark = pytest.mark.timeout(600)

EXPECTED_DAGS = {
    "rayslice_tpu_single_host",
    "rayslice_tpu_slice_training",
    "rayslice_tpu_multislice",
    "rayslice_gpu_fraction_sweep",
    "rayslice_gpu_fraction_mapping",
    "rayslice_training_pipeline",
    "rayslice_kuberay_cluster_per_run",  # run in tests/dags/test_kuberay_cluster_per_run.py (a fake Kubernetes API)
}


@pytest.fixture(scope="module")
def example_dags(airflow_db, ray_default):
    from airflow.dag_processing.dagbag import DagBag

    jax_before = "jax" in sys.modules
    started = time.monotonic()
    bag = DagBag(dag_folder=str(EXAMPLE_DAGS), safe_mode=False)
    parse_s = time.monotonic() - started
    assert bag.import_errors == {}
    if not jax_before:
        assert "jax" not in sys.modules, "an example DAG imports jax at module level"
    return bag.dags, parse_s


def test_example_dags_import_cleanly_and_fast(example_dags):
    dags, parse_s = example_dags
    assert set(dags) == EXPECTED_DAGS
    assert parse_s < 2 * len(dags), f"parsing {len(dags)} example DAGs took {parse_s:.1f} s"


def test_tpu_single_host(example_dags):
    dr = example_dags[0]["rayslice_tpu_single_host"].test()
    assert task_states(dr) == {"device_count": "success"}
    assert xcom_values(dr, "device_count") == [[4]]


def test_tpu_slice_training(example_dags, capfd):
    dr = example_dags[0]["rayslice_tpu_slice_training"].test()
    out = capfd.readouterr().out
    assert task_states(dr) == {"train": "success"}
    [per_host] = xcom_values(dr, "train")
    assert [h["devices"] for h in per_host] == [16] * 4
    losses = [h["loss"] for h in per_host]
    assert all(math.isfinite(x) for x in losses) and max(losses) - min(losses) < 1e-5
    for host in range(4):  # every host's loss per step reaches the task log once, prefixed with its host
        assert len(re.findall(rf"/host{host} pid=\d+\) step 4: loss", out)) == 1, out
    assert "step 4: loss" in out


def test_tpu_multislice(example_dags):
    dr = example_dags[0]["rayslice_tpu_multislice"].test()
    assert task_states(dr) == {"global_devices": "success"}
    assert xcom_values(dr, "global_devices") == [[32] * 8]


def test_gpu_fraction_sweep(example_dags):
    dr = example_dags[0]["rayslice_gpu_fraction_sweep"].test()
    assert set(task_states(dr).values()) == {"success"} and len(task_states(dr)) == 4
    results = xcom_values(dr, "evaluate")
    assert [r["checkpoint"] for r in results] == ["ckpt-100", "ckpt-200", "ckpt-300", "ckpt-400"]
    for r in results:  # a quarter of one GPU each, with JAX's memory capped to that share
        assert r["cuda_visible_devices"] in {"0", "1", "2"}
        assert float(r["memory_fraction"]) == pytest.approx(0.2375, abs=1e-3)
        assert 0 < r["score"] < 1


def test_gpu_fraction_mapping_maps_over_the_runs_shard_count(example_dags, capfd):
    dr = example_dags[0]["rayslice_gpu_fraction_mapping"].test(run_conf={"shards": 2})  # as the trigger form sends
    out = capfd.readouterr().out
    assert set(task_states(dr).values()) == {"success"}, out[-3000:]
    results = xcom_values(dr, "score")
    assert sorted(r["shard"] for r in results) == [0, 1] and {r["size"] for r in results} == {64}
    assert all(r["cuda_visible_devices"] in {"0", "1", "2"} and 0 < r["score"] < 1 for r in results)
    assert "shard 1: score" in out  # the step's own line, relayed from its host
    [summary] = xcom_values(dr, "summarize")
    assert summary["shards"] == 2 and summary["mean_score"] == round(sum(r["score"] for r in results) / 2, 6)


def test_training_pipeline_renders_the_slice_from_params(example_dags, capfd):
    dag = example_dags[0]["rayslice_training_pipeline"]
    assert dag.params["slice_type"] == "v6e-4"
    for slice_type in dag.params.get_param("slice_type").schema["enum"]:
        TpuSliceRequest(tpu=slice_type)  # every choice in the trigger form is a valid slice
    dr = dag.test(run_conf={"slice_type": "v6e-16", "learning_rate": 0.05, "steps": 4})  # as the trigger form sends
    out = capfd.readouterr().out
    assert set(task_states(dr).values()) == {"success"}, out[-3000:]
    assert "[rayslice] submitted v6e-16 as Ray job" in out  # "{{ params.slice_type }}", rendered from the run conf
    [hosts] = xcom_values(dr, "train")
    assert len(hosts) == 4  # v6e-16: four hosts, one data-parallel model: the same loss, weights and checkpoint
    assert len({(h["loss"], tuple(h["weights"]), h["checkpoint"]) for h in hosts}) == 1
    # The model goes from the TPU step to the GPU step through storage: XCom carries only its URL.
    checkpoint = hosts[0]["checkpoint"]
    assert checkpoint.startswith("file://") and "/rayslice_training_pipeline/" in checkpoint
    assert checkpoint.endswith("/train/4")
    assert Path(checkpoint.removeprefix("file://"), "default").is_dir()
    [metrics] = xcom_values(dr, "evaluate")
    assert metrics["checkpoint"] == checkpoint and metrics["hosts"] == 4
    assert math.isfinite(metrics["heldout_loss"]) and metrics["weight_error"] < 4
    [report] = xcom_values(dr, "report")
    assert report.startswith("v6e-16 trained on 4 host(s) at lr=0.05: loss ") and checkpoint in report
