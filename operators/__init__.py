"""Airflow operators for rayslice steps: `from rayslice.operators import TpuSliceOperator`.

Names load on first use, so importing the package stays cheap (the DAG processor imports it per file).
The TaskFlow decorators `@task.tpu_slice` and `@task.ray_accelerator` come from the provider. The two
step operators' shared base, `rayslice.operators.step.RayStepOperator`, is not one to use in a DAG.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "TpuSliceOperator": "tpu_slice",
    "AcceleratorOperator": "accelerator",
    "RayStepTrigger": "triggers",
    "RayJobLink": "links",
    "CreateTpuSliceOperator": "cloud_tpu",
    "DeleteTpuSliceOperator": "cloud_tpu",
    "CreateRayClusterOperator": "kuberay",
    "DeleteRayClusterOperator": "kuberay",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
