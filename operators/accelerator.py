"""Run a step on some (or a fraction) of one accelerator: a quarter of a GPU, 2 NPUs, 4 TPU chips."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rayslice.operators.step import RayStepOperator

from rayslice.core.accelerators import AcceleratorRequest

__all__ = ["AcceleratorOperator"]


class AcceleratorOperator(RayStepOperator):
    """``AcceleratorOperator(task_id=..., accelerator="GPU", count=0.25, python_callable=f)``.

    The XCom is the function's return value.

    :param accelerator: Ray's resource name: "GPU", "NPU", "TPU", "neuron_cores" or "HPU" (templated).
    :param count: how many (fractions ≤ 1 for GPU/NPU; 1, 2, 4 or 8 TPU chips) (templated).
    :param accelerator_type: pin the model, e.g. "H100" or "TPU-V6E" (templated).
    """

    template_fields: Sequence[str] = (*RayStepOperator.template_fields, "accelerator", "count",
                                      "accelerator_type")
    request_fields = ("accelerator", "count", "accelerator_type")

    def __init__(
        self,
        *,
        accelerator: str,
        count: float | str = 1,
        accelerator_type: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.accelerator = accelerator
        self.count = count
        self.accelerator_type = accelerator_type
        self.validate_literal_request()
        self.plan_trigger_start()

    @staticmethod
    def make_request(accelerator: Any, count: Any = 1, accelerator_type: Any = None) -> AcceleratorRequest:
        return AcceleratorRequest(resource=accelerator, count=count, accelerator_type=accelerator_type)
