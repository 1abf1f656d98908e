"""TpuSliceOperator: requests are validated when the DAG file is parsed."""

from __future__ import annotations

import textwrap

import pytest
from rayslice.hooks.ray import RayConnectionSettings
from rayslice.operators.tpu_slice import TpuSliceOperator

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.exceptions import InvalidRequestError
from tests.airflow_env import load_dag_file

BAD_SLICE_DAG = textwrap.dedent(
    """
    from datetime import datetime
    from airflow.sdk import DAG
    from rayslice.operators.tpu_slice import TpuSliceOperator

    with DAG("bad_slice", schedule=None, start_date=datetime(2026, 1, 1)):
        TpuSliceOperator(task_id="train", tpu="v6e-15", callable="pkg.train:main")
    """
)


def test_literal_request_is_built_at_parse_time():
    op = TpuSliceOperator(task_id="t", tpu="v6e-16", num_slices=2, multislice=True, callable="pkg.mod:fn")
    assert op.build_request() == TpuSliceRequest(tpu="v6e-16", num_slices=2, multislice=True)
    assert {"tpu", "num_slices", "op_kwargs", "callable", "command", "runtime_env"} <= set(op.template_fields)


def test_invalid_slice_fails_the_dag_import(tmp_path):
    path = tmp_path / "bad_slice.py"
    path.write_text(BAD_SLICE_DAG)
    dags, errors = load_dag_file(path)
    assert not dags
    [message] = errors.values()
    assert "InvalidRequestError" in message and "'v6e-15' is not a v6e slice" in message


def test_callable_or_entrypoint_but_not_both():
    with pytest.raises(InvalidRequestError, match="exactly one of"):
        TpuSliceOperator(task_id="t", tpu="v6e-4")
    with pytest.raises(InvalidRequestError, match="package.module:function"):
        TpuSliceOperator(task_id="t", tpu="v6e-4", callable="train.py")


def test_preemption_retries_reach_the_step_and_bad_values_fail_at_parse_time():
    from rayslice.core.step import Owner

    op = TpuSliceOperator(task_id="t", tpu="v6e-16", callable="pkg.mod:fn", preemption_retries=2)
    assert op._spec(op.build_request(), Owner(), context={}).preemption_retries == 2
    with pytest.raises(InvalidRequestError, match="preemption_retries of 't' must be a whole number >= 0"):
        TpuSliceOperator(task_id="t", tpu="v6e-16", callable="pkg.mod:fn", preemption_retries=-1)


def test_hang_timeout_reaches_the_step_and_bad_values_fail_at_parse_time():
    from rayslice.core.step import Owner

    default = TpuSliceOperator(task_id="t", tpu="v6e-16", callable="pkg.mod:fn")
    assert default._spec(default.build_request(), Owner(), context={}).hang_timeout == 300
    off = TpuSliceOperator(task_id="t", tpu="v6e-16", callable="pkg.mod:fn", hang_timeout=None)
    assert off._spec(off.build_request(), Owner(), context={}).hang_timeout is None
    for bad in (0, -5, "60", True):
        with pytest.raises(InvalidRequestError, match="hang_timeout of 't' must be a number of seconds > 0 or None"):
            TpuSliceOperator(task_id="t", tpu="v6e-16", callable="pkg.mod:fn", hang_timeout=bad)


def test_min_deferral_is_kept_and_bad_values_fail_at_parse_time():
    from rayslice.operators.step import MIN_DEFERRAL_S

    assert TpuSliceOperator(task_id="t", tpu="v6e-4", callable="pkg.mod:fn").min_deferral == MIN_DEFERRAL_S
    assert TpuSliceOperator(task_id="t", tpu="v6e-4", callable="pkg.mod:fn", min_deferral=0).min_deferral == 0
    for bad in (-1, "15", True, float("nan")):
        with pytest.raises(InvalidRequestError, match="min_deferral of 't' must be a number of seconds >= 0"):
            TpuSliceOperator(task_id="t", tpu="v6e-4", callable="pkg.mod:fn", min_deferral=bad)


def test_queue_priority_defaults_to_the_priority_weight_and_team_reaches_the_step():
    from types import SimpleNamespace

    from rayslice.core.step import Owner

    op = TpuSliceOperator(task_id="t", tpu="v6e-16", callable="pkg.mod:fn", priority_weight=7, team="research")
    op._settings = RayConnectionSettings(dashboard_url="http://h:1", team="research")
    spec = op._spec(op.build_request(), Owner(), context={})
    assert (spec.priority, spec.team) == (7, "research")
    assert op._spec(op.build_request(), Owner(), context={"ti": SimpleNamespace(priority_weight=12)}).priority == 12
    op = TpuSliceOperator(task_id="t", tpu="v6e-16", callable="pkg.mod:fn", priority=3)
    assert op._spec(op.build_request(), Owner(), context={"ti": SimpleNamespace(priority_weight=12)}).priority == 3
    with pytest.raises(InvalidRequestError, match="priority of 't' must be a whole number"):
        TpuSliceOperator(task_id="t", tpu="v6e-16", callable="pkg.mod:fn", priority="high")


@pytest.mark.parametrize(("platform", "asked", "team"), [
    ("research", None, "research"),  # a step that omits team= still counts against its connection's team
    ("research", "research/vision", "research/vision"),  # narrowing is allowed
    (None, None, None),
])
def test_a_steps_team_is_its_connections_which_it_may_only_narrow(platform, asked, team):
    """Issue 38 (3): a team over its quota omitted `team=`, or named another team, and was unlimited."""
    from rayslice.core.step import Owner

    op = TpuSliceOperator(task_id="t", tpu="v6e-16", callable="pkg.mod:fn", team=asked)
    op._settings = RayConnectionSettings(dashboard_url="http://h:1", team=platform)
    assert op._spec(op.build_request(), Owner(), context={}).team == team


@pytest.mark.parametrize(("platform", "asked", "error"), [
    ("research", "infra", "its connection belongs to team 'research'; a step may only narrow that"),
    ("research", "research-x", "its connection belongs to team 'research'"),
    (None, "research", "teams are set by the platform, not by a step"),
])
def test_a_step_cannot_name_another_team(platform, asked, error):
    from rayslice.core.step import Owner

    op = TpuSliceOperator(task_id="t", tpu="v6e-16", callable="pkg.mod:fn", team=asked)
    op._settings = RayConnectionSettings(dashboard_url="http://h:1", team=platform)
    from airflow.sdk.exceptions import AirflowFailException

    with pytest.raises(AirflowFailException, match=error):  # no retry: a retry would not change the team
        op._spec(op.build_request(), Owner(), context={})
