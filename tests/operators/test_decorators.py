"""@task.tpu_slice / @task.ray_accelerator: registered through the provider, validated at parse time."""

from __future__ import annotations

import textwrap
from datetime import datetime

import pytest
from airflow.sdk import DAG, task
from rayslice.operators.decorators import ray_accelerator_task, tpu_slice_task

from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.exceptions import InvalidRequestError
from tests.airflow_env import load_dag_file

BAD_DECORATOR_DAG = textwrap.dedent(
    """
    from datetime import datetime
    from airflow.sdk import dag, task

    @dag(schedule=None, start_date=datetime(2026, 1, 1))
    def bad_decorated():
        @task.tpu_slice(tpu="v6e-15")
        def train():
            return 1

        train()

    bad_decorated()
    """
)


def test_task_namespace_resolves_through_the_provider_registry():
    assert task.tpu_slice is tpu_slice_task
    assert task.ray_accelerator is ray_accelerator_task


def test_bad_literal_fails_where_the_decorator_is_applied():
    with pytest.raises(InvalidRequestError, match="'v6e-15' is not a v6e slice"):
        task.tpu_slice(tpu="v6e-15")
    with pytest.raises(InvalidRequestError, match="TPU count 0.5 is invalid"):
        task.ray_accelerator(accelerator="TPU", count=0.5)


def test_bad_literal_fails_the_dag_import(tmp_path):
    path = tmp_path / "bad_decorated.py"
    path.write_text(BAD_DECORATOR_DAG)
    dags, errors = load_dag_file(path)
    assert not dags
    [error] = errors.values()
    assert "'v6e-15' is not a v6e slice" in error


@pytest.fixture
def decorated_ops():
    with DAG("deco_kwargs", schedule=None, start_date=datetime(2026, 1, 1)) as dag:
        @task.tpu_slice(tpu="v6e-16", num_slices=2)
        def train(dataset, steps=3, ds=None, params=None):
            return dataset

        @task.ray_accelerator(accelerator="GPU", count=0.25)
        def needs_ti(ti=None):
            return 1

        train({"rows": 8}, steps=5)
        needs_ti()
    return dag.task_dict


def test_decorated_operators_build_requests_and_kwargs(decorated_ops):
    train, needs_ti = decorated_ops["train"], decorated_ops["needs_ti"]
    assert train.build_request() == TpuSliceRequest(tpu="v6e-16", num_slices=2)
    assert needs_ti.build_request() == AcceleratorRequest(resource="GPU", count=0.25)
    context = {"ds": "2026-01-02", "params": {"lr": 0.1}, "ti": object()}
    assert train.step_kwargs(context) == {"dataset": {"rows": 8}, "steps": 5, "ds": "2026-01-02",
                                          "params": {"lr": 0.1}}
    with pytest.raises(InvalidRequestError, match="context key 'ti'"):
        needs_ti.step_kwargs(context)
