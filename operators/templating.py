"""Whether an operator's argument is only known at run time (Jinja, or another task's output).

Every operator checks its literal arguments when the DAG file is parsed and leaves templated ones
until they are rendered; they share this one rule. Its own module because the step operator and
the KubeRay setup operators both need it, and the step operator also reads the setup operators
(a step below a `CreateRayClusterOperator` must run on the cluster it makes).
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import XComArg


def is_templated(value: Any) -> bool:
    """Whether a value is only known at run time (Jinja, or another task's output)."""
    if isinstance(value, str):
        return "{{" in value or "{%" in value
    if isinstance(value, (list, tuple)):  # Airflow renders inside them: `num_slices=(1, "{{ params.most }}")`
        return any(is_templated(item) for item in value)
    return isinstance(value, XComArg)
