"""A templated command string: split before rendering, so a rendered value (a run conf's) stays one argument."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from rayslice.operators.tpu_slice import TpuSliceOperator

from rayslice.core.exceptions import InvalidRequestError
from rayslice.core.step import Owner


def rendered(command, **context):
    op = TpuSliceOperator(task_id="t", tpu="v6e-4", command=command)
    op.render_template_fields(context)
    return op._spec(op.build_request(), Owner(), context=context).command


def test_a_run_conf_value_cannot_add_arguments_to_a_templated_command_string():
    argv = rendered("python train.py --name {{ dag_run.conf['name'] }} --param {{ params.name }} --tag 'a b' "
                    "--run={{ run_id | upper }}",
                    dag_run=SimpleNamespace(conf={"name": "x --evil"}), params={"name": "x --evil"}, run_id="r1")
    assert argv == ["python", "train.py", "--name", "x --evil", "--param", "x --evil", "--tag", "a b", "--run=R1"]


def test_a_templated_list_keeps_each_value_one_argument():
    assert rendered(["python", "train.py", "--name", "{{ params.name }}"], params={"name": "x --evil"}) == [
        "python", "train.py", "--name", "x --evil"]


def test_a_jinja_expression_with_spaces_and_quotes_stays_whole():
    assert rendered("python t.py {{ params.get('name', 'a b') }}", params={}) == ["python", "t.py", "a b"]


def test_a_statement_in_a_command_string_is_refused_at_parse_time_in_the_users_words():
    with pytest.raises(InvalidRequestError, match=r"Jinja statement.*Give a list instead"):
        TpuSliceOperator(task_id="t", tpu="v6e-4", command="python t.py {% if params.x %}--x{% endif %}")
    with pytest.raises(InvalidRequestError, match="cannot be split like a shell would: No closing quotation"):
        TpuSliceOperator(task_id="t", tpu="v6e-4", command="python t.py '{{ params.x }}")
