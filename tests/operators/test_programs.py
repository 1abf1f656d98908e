"""What a step runs, as the operators and decorators take it: a function, an import path or a command,
with Ray's runtime_env and a slice named by topology. Checked when the DAG file is parsed."""

from __future__ import annotations

import textwrap

import pytest
from airflow.sdk import task
from rayslice.hooks.ray import RayConnectionSettings, settings_from_connection
from rayslice.operators.accelerator import AcceleratorOperator
from rayslice.operators.tpu_slice import TpuSliceOperator

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.exceptions import InvalidRequestError
from rayslice.core.step import Owner
from tests.airflow_env import load_dag_file

BAD_RUNTIME_ENV_DAG = textwrap.dedent(
    """
    from datetime import datetime
    from airflow.sdk import DAG
    from rayslice.operators.tpu_slice import TpuSliceOperator

    with DAG("bad_env", schedule=None, start_date=datetime(2026, 1, 1)):
        TpuSliceOperator(task_id="train", tpu="v6e-16", command=["python", "train.py"],
                         runtime_env={"working_dir": "./program", "envvars": {"A": "1"}})
    """
)


def test_a_bad_runtime_env_fails_the_dag_import_naming_the_valid_keys(tmp_path):
    path = tmp_path / "bad_env.py"
    path.write_text(BAD_RUNTIME_ENV_DAG)
    dags, errors = load_dag_file(path)
    assert not dags
    [message] = errors.values()
    assert "runtime_env of 'train' has unknown key(s) 'envvars'; valid keys: working_dir, py_modules" in message


def test_a_command_step_ships_its_argv_and_runtime_env():
    op = TpuSliceOperator(task_id="t", tpu="v6e-16", command="python -m trainer.main --config c.yaml",
                          runtime_env={"working_dir": "./program", "env_vars": {"A": "1"}})
    spec = op._spec(op.build_request(), Owner(), context={})
    assert spec.command == ["python", "-m", "trainer.main", "--config", "c.yaml"]
    assert spec.runtime_env == {"working_dir": "./program", "env_vars": {"A": "1"}}
    assert spec.callable is None and spec.pickled is None
    assert {"command", "runtime_env", "callable"} <= set(op.template_fields)


def test_the_connections_runtime_env_merges_under_the_tasks():
    op = AcceleratorOperator(task_id="t", accelerator="GPU", count=0.25, callable="pkg.mod:fn",
                             runtime_env={"env_vars": {"B": "task"}, "working_dir": "./program"})
    op._settings = RayConnectionSettings(dashboard_url="http://ray:8265",
                                         runtime_env={"pip": ["tqdm"], "env_vars": {"A": "conn", "B": "conn"}})
    spec = op._spec(op.build_request(), Owner(), context={})
    assert spec.runtime_env == {"pip": ["tqdm"], "working_dir": "./program", "env_vars": {"A": "conn", "B": "task"}}


def test_the_connections_runtime_env_extra_is_validated():
    class Conn:
        host, schema, port, password = "http://ray:8265", None, None, None
        extra = '{"runtime_env": {"pip": 3}}'
        extra_dejson = {"runtime_env": {"pip": 3}}

    with pytest.raises(InvalidRequestError, match="extra 'runtime_env'\\['pip'\\] must be a list of requirements"):
        settings_from_connection(Conn())


def test_a_templated_runtime_env_and_command_are_checked_after_rendering():
    op = TpuSliceOperator(task_id="t", tpu="v6e-4", command="python train.py --run {{ run_id }}",
                          runtime_env={"env_vars": {"RUN": "{{ run_id }}"}})
    op.runtime_env = {"env_vars": {"RUN": 7}}  # what a bad rendering would leave
    with pytest.raises(Exception, match="must be a dict of variable names to string values"):
        op._spec(op.build_request(), Owner(), context={})


def test_topology_names_the_slice():
    op = TpuSliceOperator(task_id="t", tpu="v6e", topology="4x4", callable="pkg.mod:fn")
    assert op.build_request() == TpuSliceRequest(tpu="v6e-16")
    with pytest.raises(InvalidRequestError, match="3x3"):
        TpuSliceOperator(task_id="t", tpu="v6e", topology="3x3", callable="pkg.mod:fn")
    with pytest.raises(InvalidRequestError, match="3x3"):
        task.tpu_slice(tpu="v6e", topology="3x3")


def test_the_decorators_take_a_runtime_env_and_check_it_where_applied():
    with pytest.raises(InvalidRequestError, match="unknown key\\(s\\) 'pip_packages'"):
        task.tpu_slice(tpu="v6e-4", runtime_env={"pip_packages": ["x"]})
    with pytest.raises(InvalidRequestError, match="unknown key\\(s\\) 'pip_packages'"):
        task.ray_accelerator(accelerator="GPU", count=0.25, runtime_env={"pip_packages": ["x"]})


def test_entrypoint_still_works_for_one_release_with_a_warning():
    with pytest.warns(DeprecationWarning, match="TpuSliceOperator\\(entrypoint=...\\) is deprecated"):
        op = TpuSliceOperator(task_id="t", tpu="v6e-4", entrypoint="pkg.mod:fn")
    assert op.callable == op.entrypoint == "pkg.mod:fn"
    assert op._spec(op.build_request(), Owner(), context={}).callable == "pkg.mod:fn"
