"""AcceleratorOperator: fractions of GPUs, whole TPU chips, and parse-time errors."""

from __future__ import annotations

import textwrap

import pytest
from rayslice.operators.accelerator import AcceleratorOperator

from rayslice.core.accelerators import AcceleratorRequest
from tests.airflow_env import load_dag_file

DAG_FILE = textwrap.dedent(
    """
    from datetime import datetime
    from airflow.sdk import DAG
    from rayslice.operators.accelerator import AcceleratorOperator

    with DAG("bad_accelerator", schedule=None, start_date=datetime(2026, 1, 1)):
        AcceleratorOperator(task_id="evaluate", callable="pkg.eval:main", {args})
    """
)


def test_literal_request_is_built_at_parse_time():
    op = AcceleratorOperator(task_id="t", accelerator="GPU", count=0.25, callable="pkg.mod:fn")
    assert op.build_request() == AcceleratorRequest(resource="GPU", count=0.25)
    assert {"accelerator", "count", "op_kwargs", "callable", "command", "runtime_env"} <= set(op.template_fields)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ('accelerator="TPU", count=0.5', "TPU count 0.5 is invalid"),
        ('accelerator="FPGA", count=1', "unknown resource 'FPGA'"),
        ('accelerator="gpu", count=1', "did you mean 'GPU'?"),
    ],
)
def test_invalid_request_fails_the_dag_import(tmp_path, args, message):
    path = tmp_path / "bad_accelerator.py"
    path.write_text(DAG_FILE.format(args=args))
    dags, errors = load_dag_file(path)
    assert not dags
    [error] = errors.values()
    assert "InvalidRequestError" in error and message in error
